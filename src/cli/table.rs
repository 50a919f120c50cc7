//! The human-readable op table of `mladb run`.

use crate::engine::OpEvent;

pub fn header() -> String {
    format!(
        "{:>5} {:<9} {:<52} {:<16} {:>11} {:>11} {:>11} {:>11} {:>10} {:>9}",
        "#", "phase", "op", "shape", "min", "max", "mean", "std", "abs-max", "nan/inf/0"
    )
}

fn num(v: f64) -> String {
    if v.is_nan() {
        "nan".into()
    } else if v != 0.0 && (v.abs() >= 1e5 || v.abs() < 1e-3) {
        format!("{v:.3e}")
    } else {
        format!("{v:.5}")
    }
}

/// Shortens a long op name from the left, keeping its tail (the informative part).
fn fit(name: &str, width: usize) -> String {
    let chars: Vec<char> = name.chars().collect();
    if chars.len() <= width {
        name.to_string()
    } else {
        let tail: String = chars[chars.len() - (width - 1)..].iter().collect();
        format!("…{tail}")
    }
}

/// The op's name, after its rank under tensor parallelism: `r1 model.layers.0.mlp`.
fn ranked_name(e: &OpEvent) -> String {
    match e.rank {
        Some(r) => format!("r{r} {}", e.name),
        None => e.name.clone(),
    }
}

pub fn row(e: &OpEvent) -> String {
    let s = &e.stats;
    let shape = format!("{:?}", e.shape);
    let specials = format!("{}/{}/{}", s.nan, s.pos_inf + s.neg_inf, s.zeros);
    format!(
        "{:>5} {:<9} {:<52} {:<16} {:>11} {:>11} {:>11} {:>11} {:>10} {:>9}",
        e.index,
        e.phase.to_string(),
        fit(&ranked_name(e), 52),
        shape,
        num(s.min),
        num(s.max),
        num(s.mean),
        num(s.std),
        num(s.abs_max),
        specials
    )
}
