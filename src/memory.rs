//! The memory a run needs, estimated from the layout and the schedule before anything is
//! allocated, and held against a limit (`--max-memory-gb`, by default the memory the machine has
//! available), so that a prompt too long for memory is an `error:` with the figure, not an abort.

use crate::error::{Error, Result};
use crate::model::{Layout, Model};
use std::ops::Range;

/// The largest buffers a run of `layers` over a context of `context` tokens holds at once, in
/// bytes (f32): the weights kept (at most `weight_cache_bytes`, plus the largest tensor fetched
/// beyond it), every layer's latent cache and naive K/V cache, and the widest phase's transient
/// buffers: attention scores and probabilities (heads × queries × keys, twice), the indexer's
/// scores, and a few activations of the widest projection. The widest phase is taken as a
/// prefill of the whole context, which `check` runs to compare prefill with decode.
pub fn estimate(
    layout: &Layout,
    context: usize,
    layers: &Range<usize>,
    weight_cache_bytes: u64,
) -> u128 {
    let e = Estimate::of(layout, context, layers, weight_cache_bytes);
    e.weights + e.attention + e.rest
}

/// An estimate in parts, for the error message.
struct Estimate {
    weights: u128,
    attention: u128,
    rest: u128,
}

impl Estimate {
    fn of(
        layout: &Layout,
        context: usize,
        layers: &Range<usize>,
        weight_cache_bytes: u64,
    ) -> Estimate {
        let f = 4u128;
        let t = context as u128;
        let n_layers = layers.len() as u128;
        let heads = layout.num_heads as u128;
        let weights_total = layout.parameter_count() * f;
        let largest_weight = [
            layout.vocab_size as u128 * layout.hidden_size as u128,
            layout.kv_lora_rank as u128
                * heads
                * (layout.qk_nope_head_dim + layout.v_head_dim) as u128,
            layout.intermediate_size as u128 * layout.hidden_size as u128,
            heads
                * layout.qk_head_dim() as u128
                * layout.q_lora_rank.unwrap_or(layout.hidden_size) as u128,
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
            * f;
        // The weights the run touches: embedding, head, and its share of the layers'.
        let base = layout.vocab_size as u128
            * layout.hidden_size as u128
            * if layout.tie_word_embeddings { 1 } else { 2 }
            * f;
        let per_layer = weights_total.saturating_sub(base) / (layout.num_layers.max(1) as u128);
        let touched = base + per_layer * n_layers;
        let weights = touched.min(weight_cache_bytes as u128 + largest_weight);
        // Caches: the latent rows and the naive path's decompressed K and V, per layer run.
        let caches = n_layers
            * t
            * (layout.latent_width() as u128
                + heads * (layout.qk_head_dim() + layout.v_head_dim) as u128)
            * f;
        // Attention over the whole context: scores and probabilities.
        let attention = 2 * heads * t * t * f;
        let indexer = layout
            .indexer
            .as_ref()
            .map(|ix| (ix.n_heads as u128 + 1) * t * t * f)
            .unwrap_or(0);
        let widest = [
            layout.vocab_size,
            layout.hidden_size,
            layout.num_heads * layout.qk_head_dim(),
            layout.num_heads * (layout.qk_nope_head_dim + layout.v_head_dim),
            layout.intermediate_size,
        ]
        .into_iter()
        .max()
        .unwrap_or(0) as u128;
        let activations = 8 * t * widest * f;
        Estimate {
            weights,
            attention: attention + indexer,
            rest: caches + activations,
        }
    }
}

/// The memory the machine has available (`MemAvailable` of /proc/meminfo), if it says.
pub fn available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// The memory a run may take, in bytes, and where that figure comes from: `limit_gb` (GB,
/// 10^9 bytes; `--max-memory-gb`), or by default the memory available (`None` where the
/// machine does not say).
pub fn limit(limit_gb: Option<f64>) -> Result<Option<(u128, &'static str)>> {
    match limit_gb {
        Some(gb) if gb.is_finite() && gb > 0.0 => Ok(Some(((gb * 1e9) as u128, "--max-memory-gb"))),
        Some(gb) => Err(Error::invalid(format!(
            "--max-memory-gb {gb} is not a positive, finite number of GB"
        ))),
        None => Ok(available().map(|b| {
            (
                b as u128,
                "the memory available; --max-memory-gb sets another limit",
            )
        })),
    }
}

/// Refuses a run of `model` over `context` tokens whose estimate (with the model's weight
/// cache budget) exceeds `limit_gb` (GB, 10^9 bytes), or by default the memory available.
pub fn check(
    model: &Model,
    context: usize,
    layers: &Range<usize>,
    limit_gb: Option<f64>,
) -> Result<()> {
    check_beside(model, context, layers, limit_gb, 0)
}

/// [`check`] for a run beside `held` bytes its caller already holds (a reference dump's
/// values): the two together must fit the limit.
pub fn check_beside(
    model: &Model,
    context: usize,
    layers: &Range<usize>,
    limit_gb: Option<f64>,
    held: u128,
) -> Result<()> {
    let layout = &model.layout;
    let weight_cache_bytes = model.weights.budget_bytes() as u64;
    let Some((limit, source)) = limit(limit_gb)? else {
        return Ok(());
    };
    let e = Estimate::of(layout, context, layers, weight_cache_bytes);
    let run = e.weights + e.attention + e.rest;
    let need = run + held;
    if need > limit {
        let beside = if held > 0 {
            format!(
                ", and the reference dump's values already held {}",
                size_text(held)
            )
        } else {
            String::new()
        };
        return Err(Error::Allocation {
            what: format!("about {}", size_text(need)),
            detail: format!(
                "{} layer(s) of {} over {context} tokens need about {} (weights {}, attention \
                 over the context, which grows with its square, {}, caches and activations {}){beside}, \
                 above the limit of {} ({source})",
                layers.len(),
                layout.name,
                size_text(run),
                size_text(e.weights),
                size_text(e.attention),
                size_text(e.rest),
                size_text(limit)
            ),
        });
    }
    Ok(())
}

/// A byte count in the largest decimal unit (GB, MB, kB) that leaves at least 1, two decimals:
/// a small `--max-memory-gb` reads as "0.50 MB", not "0.00 GB".
pub fn size_text(bytes: u128) -> String {
    let b = bytes as f64;
    match [(1e9, "GB"), (1e6, "MB"), (1e3, "kB")]
        .into_iter()
        .find(|&(unit, _)| b >= unit)
    {
        Some((unit, name)) => format!("{:.2} {name}", b / unit),
        None => format!("{bytes} bytes"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_grows_with_the_square_of_the_context() {
        let layout = Layout::resolve("glm5-tiny").unwrap();
        let layers = 0..layout.num_layers;
        let small = estimate(&layout, 100, &layers, 1 << 30);
        let big = estimate(&layout, 20000, &layers, 1 << 30);
        // glm5-tiny's attention probabilities alone at 20000 tokens: 4 × 20000² × 4 bytes.
        assert!(big > 4 * 20000u128 * 20000 * 4, "{big}");
        assert!(small < 100 << 20, "{small}");
        let model = Model::synthetic(layout, 0, 1 << 30).unwrap();
        assert!(check(&model, 20000, &layers, Some(2.0)).is_err());
        assert!(check(&model, 100, &layers, Some(2.0)).is_ok());
        assert!(check(&model, 100, &layers, Some(f64::NAN)).is_err());
    }

    #[test]
    fn a_limit_is_a_positive_finite_number_of_gb() {
        assert_eq!(limit(Some(1.5)).unwrap().map(|l| l.0), Some(1_500_000_000));
        for bad in [0.0, -1.0, f64::INFINITY, f64::NAN] {
            let e = limit(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("not a positive, finite number of GB"), "{e}");
        }
    }

    #[test]
    fn sizes_read_in_a_unit_that_keeps_their_digits() {
        assert_eq!(size_text(4_294_967_296), "4.29 GB");
        assert_eq!(size_text(500_000), "500.00 kB");
        assert_eq!(size_text(1_500_000), "1.50 MB");
        assert_eq!(size_text(999), "999 bytes");
        assert_eq!(size_text(0), "0 bytes");
    }
}
