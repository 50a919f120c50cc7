//! `kv-quant-mismatch`: with an fp8_ds_mla latent cache, whether every cached row is what E4M3
//! explains of the row that was written.
//!
//! The written row is c_kv (`self_attn.kv_a_layernorm`) and k_pe (`self_attn.k_rope`) of the
//! same layer and phase: what a bf16 cache would hold for the same inputs. Another run with a
//! bf16 cache would not give it: from the first layer on, its inputs differ from this run's by
//! the quantization they attended over, so the two caches differ by more than E4M3 does. That
//! run is still made, for the end-to-end effect, a note.
//!
//! Per element, a correct codec lands within half an E4M3 step: 2^-4 of the value in the normal
//! range, 2^-10 of the tile's scale (its amax / 448) among the subnormals; the RoPE values are
//! bf16, within 2^-8 (half a bf16 step). A token with an element beyond its bound is reported: a scale left at its
//! default, a scale taken over garbage, a wrong rounding or layout.

use super::detect::{Finding, FindingKind};
use super::flags::{latent_write, Flags};
use super::record::RunRecord;
use super::runner::Job;
use super::sample::holds_all;
use crate::engine::generate::Schedule;
use crate::engine::trace::Phase;
use crate::error::Result;
use crate::ops::kv_fp8::{E4M3_MAX, LATENT, ROPE, TILE};
use crate::ops::KvCacheDtype;

/// What the detector adds to a check.
pub struct KvQuantReport {
    pub findings: Vec<Finding>,
    pub notes: Vec<String>,
    /// Ops computed by the bf16-cache run.
    pub ops: usize,
}

/// One element beyond its bound.
#[derive(Debug, Clone, Copy)]
struct Excess {
    position: usize,
    element: usize,
    cached: f32,
    written: f32,
    bound: f64,
}

impl Excess {
    fn ratio(&self) -> f64 {
        (self.cached as f64 - self.written as f64).abs() / self.bound
    }
}

/// The largest distance a correct fp8_ds_mla round trip puts between `cached` and `written` at
/// element `i` of a row (latent elements of the tile whose scale is `scale`; RoPE in bf16).
fn bound(i: usize, written: f32, scale: f32) -> f64 {
    let x = (written as f64).abs();
    // A hair over the exact bounds: the f32 division and product around the E4M3 value.
    let slack = 1.0 + 2f64.powi(-12);
    if i >= LATENT {
        return x * 2f64.powi(-8) * slack;
    }
    (x * 2f64.powi(-4)).max(scale as f64 * 2f64.powi(-10)) * slack
}

/// The elements of one token's cached row beyond what E4M3 explains of its written row.
fn token_excess(position: usize, written: &[f32], cached: &[f32]) -> Vec<Excess> {
    let mut out = Vec::new();
    let scales: Vec<f32> = written[..LATENT]
        .chunks(TILE)
        .map(|t| {
            let amax = t.iter().fold(0f32, |m, v| m.max(v.abs()));
            (amax / E4M3_MAX).max(f32::MIN_POSITIVE)
        })
        .collect();
    for (i, (&x, &c)) in written.iter().zip(cached).enumerate() {
        let b = bound(i, x, scales[(i / TILE).min(scales.len() - 1)]);
        let d = (c as f64 - x as f64).abs();
        if d > b || d.is_nan() {
            out.push(Excess {
                position,
                element: i,
                cached: c,
                written: x,
                bound: b,
            });
        }
    }
    out
}

/// The written rows of the latent cache write at event `index` ([n, L+R]), from its layer's
/// c_kv and k_pe in the same phase; `None` when the run does not hold them whole.
fn written_rows(run: &RunRecord, index: usize) -> Option<Vec<f32>> {
    let e = &run.events[index];
    let prefix = e.name.strip_suffix("latent_cache")?;
    let part = |suffix: &str| {
        let i = run.find_for(e, &format!("{prefix}{suffix}"))?;
        let t = &run.outputs[i];
        holds_all(&run.events[i].shape, t.numel()).then_some(t.data())
    };
    let (c_kv, k_pe) = (part("kv_a_layernorm")?, part("k_rope")?);
    let n = e.shape.first().copied()?;
    if c_kv.len() != n * LATENT || k_pe.len() != n * ROPE {
        return None;
    }
    Some(
        (0..n)
            .flat_map(|t| {
                c_kv[t * LATENT..(t + 1) * LATENT]
                    .iter()
                    .chain(&k_pe[t * ROPE..(t + 1) * ROPE])
                    .copied()
            })
            .collect(),
    )
}

/// The findings of one run whose latent cache is fp8_ds_mla: one per latent cache write with a
/// token beyond its bound, and notes on what could not be checked.
pub fn cache_findings(run: &RunRecord) -> (Vec<Finding>, Vec<String>) {
    let (mut findings, mut unchecked) = (Vec::new(), 0);
    let width = LATENT + ROPE;
    for (index, e) in run.events.iter().enumerate() {
        if !latent_write(e) {
            continue;
        }
        let cached = &run.outputs[index];
        let written = match written_rows(run, index) {
            Some(w) if holds_all(&e.shape, cached.numel()) && w.len() == cached.numel() => w,
            _ => {
                unchecked += 1;
                continue;
            }
        };
        let n = written.len() / width;
        let excess: Vec<Vec<Excess>> = (0..n)
            .map(|t| {
                let row = t * width..(t + 1) * width;
                let position = e.positions.0 + t;
                token_excess(position, &written[row.clone()], &cached.data()[row])
            })
            .filter(|x| !x.is_empty())
            .collect();
        let Some(worst) = excess
            .iter()
            .flatten()
            .max_by(|a, b| a.ratio().total_cmp(&b.ratio()))
        else {
            continue;
        };
        let elements: usize = excess.iter().map(Vec::len).sum();
        let positions: Vec<String> = excess
            .iter()
            .take(6)
            .map(|x| x[0].position.to_string())
            .collect();
        let more = if excess.len() > 6 { ", …" } else { "" };
        let what = if worst.element < LATENT {
            format!(
                "tile {} element {}",
                worst.element / TILE,
                worst.element % TILE
            )
        } else {
            format!("RoPE element {}", worst.element - LATENT)
        };
        findings.push(Finding {
            rank: None,
            kind: FindingKind::KvQuantMismatch,
            phase: e.phase,
            op: e.name.clone(),
            index,
            detail: format!(
                "the FP8 cache holds {} of {n} tokens beyond what E4M3 explains of the written \
                 rows (positions {}{more}; {elements} elements): worst at position {}, {what}: \
                 cached {:.4e} vs written {:.4e} (|Δ| {:.2e}, {:.0}× its bound {:.2e})",
                excess.len(),
                positions.join(", "),
                worst.position,
                worst.cached,
                worst.written,
                (worst.cached as f64 - worst.written as f64).abs(),
                worst.ratio(),
                worst.bound
            ),
        });
    }
    let notes = (unchecked > 0)
        .then(|| {
            format!(
                "kv-quant-mismatch: {unchecked} latent cache writes not checked (the run does \
                 not hold their written rows whole)"
            )
        })
        .into_iter()
        .collect();
    (findings, notes)
}

/// `kv-quant-mismatch` for a check: nothing unless the run's cache is fp8_ds_mla; then the
/// cached rows against the written ones, and a note on how far the logits moved against a run
/// of the same tokens with a bf16 cache.
pub fn kv_quant_mismatch(
    job: &Job,
    run: &RunRecord,
    flags: Flags,
    forced: &Schedule,
) -> Result<KvQuantReport> {
    let mut report = KvQuantReport {
        findings: Vec::new(),
        notes: Vec::new(),
        ops: 0,
    };
    if flags.kv_cache != KvCacheDtype::Fp8DsMla {
        return Ok(report);
    }
    let (findings, notes) = cache_findings(run);
    report.findings = findings;
    report.notes = notes;
    let mut bf16 = flags;
    bf16.kv_cache = KvCacheDtype::Bf16;
    let other = job.run_schedule(bf16, forced, None)?;
    report.ops = other.counts.executed;
    let first_attention = format!(
        "{}.self_attn.attn_output",
        crate::model::catalog::layer_prefix(job.layers.start)
    );
    let worst = |name: &str| -> Option<(f64, Phase)> {
        let mut worst: Option<(f64, Phase)> = None;
        for (i, e) in run.events.iter().enumerate() {
            let theirs = match other.output_for(e, name) {
                Some(t) if e.name == name && t.numel() == run.outputs[i].numel() => t,
                _ => continue,
            };
            let d = crate::stats::rel_l2(run.outputs[i].data(), theirs.data());
            if worst.is_none_or(|(w, _)| d > w) {
                worst = Some((d, e.phase));
            }
        }
        worst
    };
    if let (Some((a, pa)), Some((l, pl))) = (worst(&first_attention), worst("logits")) {
        report.notes.push(format!(
            "fp8_ds_mla vs a bf16 latent cache (same tokens): {first_attention} differs by rel \
             L2 {a:.2e} at most ({pa}), the logits by {l:.2e} ({pl}; later layers and discrete \
             choices amplify what E4M3 does to the cache)"
        ));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::kv_fp8::round_trip;
    use crate::ops::Fp8Faults;

    fn row(seed: u64) -> Vec<f32> {
        let key = crate::model::weights::synthetic::tensor_key(seed, "row");
        (0..LATENT + ROPE)
            .map(|i| crate::model::weights::synthetic::normalish(key, i as u64))
            .collect()
    }

    #[test]
    fn the_codec_stays_within_its_bounds_and_its_faults_do_not() {
        for seed in 0..16 {
            let x = row(seed);
            let clean = round_trip(&x, Fp8Faults::default()).unwrap();
            assert!(token_excess(0, &x, &clean).is_empty(), "seed {seed}");
            // Stored in bf16 too (a bf16 run's cache rounds nothing more: it is f32).
            for faults in [
                Fp8Faults {
                    scale_default: true,
                    amax_padded: false,
                },
                Fp8Faults {
                    scale_default: false,
                    amax_padded: true,
                },
            ] {
                let bad = round_trip(&x, faults).unwrap();
                assert!(!token_excess(0, &x, &bad).is_empty(), "{faults:?} {seed}");
            }
        }
        // All-zero tiles and a zero row are exact.
        let zero = vec![0f32; LATENT + ROPE];
        let z = round_trip(&zero, Fp8Faults::default()).unwrap();
        assert!(token_excess(0, &zero, &z).is_empty());
    }
}
