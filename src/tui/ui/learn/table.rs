//! The cost table: FLOPs, bytes read and arithmetic intensity of one decoded token in one layer
//! on both paths at long contexts, against a stated roofline, and the context where absorption
//! starts to win, solved from the same model (see cost.rs).

use super::cost::{Cost, Dims, Gpu, H200};
use crate::model::Layout;
use crate::tui::app::App;
use ratatui::text::{Line, Span};

const CONTEXTS: [(u64, &str); 4] = [
    (1 << 10, "1k"),
    (8 << 10, "8k"),
    (32 << 10, "32k"),
    (128 << 10, "128k"),
];

pub fn lines(app: &App, layout: &Layout, context: u64) -> Vec<Line<'static>> {
    let t = &app.theme;
    let gpu = H200;
    let d = Dims::of(layout);
    let (nf, nb, af, ab) = d.per_token();
    let mut out = vec![
        Line::from(Span::styled(
            "Cost of one decoded token in one layer (bf16 cache)",
            t.title(),
        )),
        Line::from(Span::styled(
            format!(
                "  {:<8}{:<10}{:>9}{:>10}{:>8}  {:<8}{:>9}",
                "context",
                "path",
                "FLOPs",
                "bytes",
                "FLOP/B",
                "bound",
                format!("{} time", gpu.name)
            ),
            t.dim(),
        )),
    ];
    for (ctx, label) in CONTEXTS {
        let (naive, absorbed) = d.at(ctx);
        out.push(row(&gpu, label, "naive", &naive));
        out.push(row(&gpu, "", "absorbed", &absorbed));
    }
    out.extend([
        Line::from(format!(
            "  Ridge point {:.0} FLOP/B = {:.0} TFLOP/s ÷ {:.1} TB/s, the {}'s stated dense bf16 and memory figures: below it a kernel waits on memory, and the bound column says which limit sets the time.",
            gpu.ridge(),
            gpu.flops / 1e12,
            gpu.bandwidth / 1e12,
            gpu.name
        )),
        Line::from(format!(
            "  Per cached token: naive 2N(P+R+V) = {nf} FLOPs reading {nb} B ({:.1} FLOP/B); absorbed 2N(2L+R) = {af} FLOPs ({:.1}×) reading {ab} B ({:.1}× fewer, {:.0} FLOP/B). Both also pay 2N·L(P+V) = {} FLOPs per token whatever the context (W_UK and W_UV on one token). Weights and the query are left out.",
            nf as f64 / nb as f64,
            af as f64 / nf as f64,
            nb as f64 / ab as f64,
            af as f64 / ab as f64,
            si(d.fixed_flops() as f64, "")
        )),
    ]);
    out.push(crossover(&d, &gpu));
    if let Some(ix) = &layout.indexer {
        out.push(Line::from(format!(
            "  {}'s DSA indexer keeps the top {} keys per query: its sparse kernels read only those rows, so past {} tokens attention costs what it costs at {} (plus the indexer's scoring); the table counts dense attention.",
            layout.name, ix.topk, ix.topk, ix.topk
        )));
    }
    let (naive, absorbed) = d.at(context);
    out.push(Line::from(format!(
        "  This run, context {context}: naive {} FLOPs and {}, absorbed {} FLOPs ({:.2}×) and {}. At so short a context the fixed FLOPs hide the difference; the bytes show it.",
        si(naive.flops as f64, ""),
        si(naive.bytes as f64, "B"),
        si(absorbed.flops as f64, ""),
        absorbed.flops as f64 / naive.flops as f64,
        si(absorbed.bytes as f64, "B"),
    )));
    out
}

fn row(gpu: &Gpu, context: &str, path: &str, c: &Cost) -> Line<'static> {
    let bound = if gpu.compute_bound(c) {
        "compute"
    } else {
        "memory"
    };
    Line::from(format!(
        "  {context:<8}{path:<10}{:>9}{:>10}{:>8.1}  {bound:<8}{:>9}",
        si(c.flops as f64, ""),
        si(c.bytes as f64, "B"),
        c.intensity(),
        si(gpu.seconds(c), "s"),
    ))
}

/// The crossover, with the two times on either side of it.
fn crossover(d: &Dims, gpu: &Gpu) -> Line<'static> {
    let Some(t) = d.crossover(gpu) else {
        return Line::from(
            "  On this roofline the absorbed path never wins: its latent cache saves too few bytes for its extra FLOPs.",
        );
    };
    let times = |t: u64| {
        let (n, a) = d.at(t);
        let bound = |c: &Cost| {
            if gpu.compute_bound(c) {
                "compute"
            } else {
                "memory"
            }
        };
        format!(
            "at T = {t} naive {} ({}-bound) vs absorbed {} ({}-bound)",
            si(gpu.seconds(&n), "s"),
            bound(&n),
            si(gpu.seconds(&a), "s"),
            bound(&a)
        )
    };
    let before = match t {
        1 => String::new(),
        _ => format!("{}; ", times(t - 1)),
    };
    let (_, nb, _, ab) = d.per_token();
    Line::from(format!(
        "  Absorption wins from T = {t} cached token{} (the first T where max(FLOPs/peak, bytes/bandwidth) is lower on the absorbed path): {before}{}. From there the naive path waits on its cache reads, and the time ratio tends to the bytes ratio, {:.1}×.",
        if t == 1 { "" } else { "s" },
        times(t),
        nb as f64 / ab as f64
    ))
}

/// Three significant digits with an SI prefix: 96.5 M, 1.18 MB, 14.0 µs.
pub(super) fn si(x: f64, unit: &str) -> String {
    let prefixes = [
        (1e12, "T"),
        (1e9, "G"),
        (1e6, "M"),
        (1e3, "k"),
        (1.0, ""),
        (1e-3, "m"),
        (1e-6, "µ"),
        (1e-9, "n"),
    ];
    let (scale, p) = prefixes
        .iter()
        .find(|(s, _)| x.abs() >= *s)
        .copied()
        .unwrap_or((1e-9, "n"));
    let v = x / scale;
    let digits = if v.abs() >= 100.0 {
        0
    } else if v.abs() >= 10.0 {
        1
    } else {
        2
    };
    let sep = if p.is_empty() && unit.is_empty() {
        ""
    } else {
        " "
    };
    format!("{v:.digits$}{sep}{p}{unit}")
}

#[cfg(test)]
mod tests {
    use super::si;

    #[test]
    fn si_keeps_three_digits() {
        assert_eq!(si(96_468_992.0, ""), "96.5 M");
        assert_eq!(si(1_179_648.0, "B"), "1.18 MB");
        assert_eq!(si(13.98e-6, "s"), "14.0 µs");
        assert_eq!(si(246e-9, "s"), "246 ns");
        assert_eq!(si(512.0, ""), "512");
    }
}
