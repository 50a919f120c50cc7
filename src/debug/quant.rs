//! Checks of a quantized kv_b_proj: how far the two ways of making W_UK / W_UV from its blocks
//! (the identity matrix through the quantized linear, or force-dequantize) differ per head, how
//! far the attention outputs of a run with each differ per head, and whether the decoded weight
//! is as close to what was quantized as the quantization type allows (the `quant-mismatch`
//! detector, which catches a dequantization kernel that unpacks blocks wrongly).

use super::detect::{Finding, FindingKind};
use super::flags::Flags;
use super::record::RunRecord;
use super::runner::Job;
use crate::engine::generate::Schedule;
use crate::engine::{Fault, OpKind, Phase};
use crate::error::Result;
use crate::model::catalog::layer_prefix;
use crate::model::quant::{QuantFaults, QuantTensor};
use crate::stats::rel_l2;
use crate::tensor::Tensor;
use std::sync::Arc;

/// One layer's figures, per head.
#[derive(Debug, Clone)]
pub struct LayerQuantReport {
    pub layer: usize,
    pub ty: crate::gguf::GgmlType,
    /// Relative L2 between W_UK through the identity and W_UK force-dequantized, per head.
    pub w_uk: Vec<f64>,
    pub w_uv: Vec<f64>,
    /// Relative L2 between the attention outputs (`self_attn.attn_output`, every token of the
    /// run) with force-dequantize off and on, per head.
    pub attn: Vec<f64>,
}

fn kv_b_name(l: usize) -> String {
    format!("{}.self_attn.kv_b_proj.weight", layer_prefix(l))
}

/// The quantization faults `flags` plant (in any phase: a weight is decoded once).
pub fn quant_faults(flags: &Flags) -> QuantFaults {
    QuantFaults {
        q4k_scale_unpack: [Phase::Prefill, Phase::Decode(0)]
            .into_iter()
            .any(|p| flags.faults.active(Fault::Q4kScaleUnpack, p)),
    }
}

/// W through the identity matrix (the backend's quantized linear), and W decoded directly.
fn both_derivations(job: &Job, q: &QuantTensor, faults: QuantFaults) -> Result<(Tensor, Tensor)> {
    Ok((
        crate::backend::weight_through_identity(job.backend, q, faults)?,
        job.backend.dequantize(q, faults)?,
    ))
}

/// Per-head relative L2 of rows `offset..offset + rows` of each head's block of `block` rows.
fn per_head(
    a: &[f32],
    b: &[f32],
    heads: usize,
    block: usize,
    offset: usize,
    rows: usize,
    cols: usize,
) -> Vec<f64> {
    (0..heads)
        .map(|h| {
            let s = (h * block + offset) * cols;
            let e = s + rows * cols;
            rel_l2(&a[s..e], &b[s..e])
        })
        .collect()
}

/// The per-layer report; empty when no kv_b_proj is quantized. Runs the schedule twice (force
/// dequantize off and on) on the same tokens.
pub fn kv_b_report(job: &Job, flags: Flags) -> Result<Vec<LayerQuantReport>> {
    let layout = &job.model.layout;
    let (n, p, v, lat) = (
        layout.num_heads,
        layout.qk_nope_head_dim,
        layout.v_head_dim,
        layout.kv_lora_rank,
    );
    let quantized: Vec<(usize, Arc<QuantTensor>)> = job
        .layers
        .clone()
        .filter_map(|l| match job.model.weights.quantized(&kv_b_name(l)) {
            Ok(Some(q)) => Some(Ok((l, q))),
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        })
        .collect::<Result<_>>()?;
    if quantized.is_empty() {
        return Ok(Vec::new());
    }
    let (mut off, mut on) = (flags, flags);
    off.force_dequant = false;
    on.force_dequant = true;
    let a = job.run(off, None)?;
    let tokens = a
        .outcome
        .as_ref()
        .map(|o| o.tokens.clone())
        .unwrap_or_default();
    let forced = Schedule {
        prompt: tokens,
        prefill_len: job.schedule.prefill_len,
        decode_steps: 0,
    };
    let b = job.run_schedule(on, &forced, None)?;
    let faults = quant_faults(&flags);
    let mut out = Vec::new();
    for (l, q) in quantized {
        let (through_identity, dequantized) = both_derivations(job, &q, faults)?;
        let (x, y) = (through_identity.data(), dequantized.data());
        let attn = attention_per_head(&a, &b, l, n, v);
        out.push(LayerQuantReport {
            layer: l,
            ty: q.ty,
            w_uk: per_head(x, y, n, p + v, 0, p, lat),
            w_uv: per_head(x, y, n, p + v, p, v, lat),
            attn,
        });
    }
    Ok(out)
}

/// Per-head relative L2 of a layer's attention output over every phase both runs have.
fn attention_per_head(a: &RunRecord, b: &RunRecord, l: usize, heads: usize, v: usize) -> Vec<f64> {
    let name = format!("{}.self_attn.attn_output", layer_prefix(l));
    let (mut xs, mut ys) = (vec![Vec::new(); heads], vec![Vec::new(); heads]);
    for (i, e) in a.events.iter().enumerate() {
        if e.name != name {
            continue;
        }
        // The decode steps of `a` are prefill rows of `b` (b prefilled the whole sequence).
        let Some(j) = b
            .find_for(e, &name)
            .or_else(|| b.find_at(Phase::Prefill, e.rank, &name))
        else {
            continue;
        };
        let (x, y) = (a.outputs[i].data(), b.outputs[j].data());
        let rows_x = x.len() / (heads * v);
        let first = e.positions.0;
        for t in 0..rows_x {
            let ty = if b.events[j].phase == e.phase {
                t
            } else {
                first + t
            };
            if (ty + 1) * heads * v > y.len() {
                continue;
            }
            for h in 0..heads {
                xs[h].extend_from_slice(&x[(t * heads + h) * v..(t * heads + h + 1) * v]);
                ys[h].extend_from_slice(&y[(ty * heads + h) * v..(ty * heads + h + 1) * v]);
            }
        }
    }
    xs.iter().zip(&ys).map(|(x, y)| rel_l2(x, y)).collect()
}

/// What is wrong with a quantized weight as the run's kernels decoded it (`decoded`), if
/// anything: against what it was quantized from (`original`, when the weights still have it)
/// with the error of the reference codec's decoding (`reference`) as the yardstick, or else
/// against the reference decoding itself.
fn decoding_error(
    ty: crate::gguf::GgmlType,
    decoded: &[f32],
    reference: &[f32],
    original: Option<&[f32]>,
) -> Option<String> {
    // NaN / Inf of the kernel's that the reference decoding does not hold (the same NaN in both
    // is the file's, which the NaN/Inf detector reports): a comparison with NaN is false, so it
    // is asked first.
    let from_reference = super::diff::diff(decoded, reference, &[decoded.len()], None);
    let severity = from_reference.severity();
    if severity.is_infinite() {
        return Some(format!(
            "kv_b_proj ({ty}) decodes to NaN/Inf where the reference {ty} decoding does not ({})",
            from_reference.non_finite_summary().unwrap_or_default()
        ));
    }
    let expected = original.map(|o| (rel_l2(reference, o), o));
    match expected {
        Some((expected, original)) if expected.is_finite() => {
            let found = rel_l2(decoded, original);
            (found > 1.5 * expected + 1e-6).then(|| {
                format!(
                    "kv_b_proj ({ty}) decodes {found:.3e} away from the weight it was quantized from; {ty} quantization explains {expected:.3e}"
                )
            })
        }
        _ => (severity > 1e-6).then(|| {
            format!("kv_b_proj ({ty}) decodes {severity:.3e} away from the reference {ty} decoding")
        }),
    }
}

/// The `quant-mismatch` detector: each quantized kv_b_proj as the run's kernels decode it,
/// against what it was quantized from (when the weights still have it: `--quant`) with the
/// error the reference codec makes as the yardstick, or else against the reference codec's
/// decoding itself (a GGUF file).
pub fn quant_findings(job: &Job, run: &RunRecord) -> Result<(Vec<Finding>, Vec<String>)> {
    let faults = quant_faults(&run.flags);
    let (mut findings, mut notes) = (Vec::new(), Vec::new());
    let mut checked = 0;
    for l in job.layers.clone() {
        let name = kv_b_name(l);
        let Some(q) = job.model.weights.quantized(&name)? else {
            continue;
        };
        checked += 1;
        let decoded = job.backend.dequantize(&q, faults)?;
        let reference = q.dequantize(QuantFaults::default())?;
        // Where the finding points: the op that made the weight plain, else the first op that
        // multiplied with it.
        let (index, op) = run
            .events
            .iter()
            .enumerate()
            .find(|(_, e)| {
                e.layer == Some(l) && matches!(e.kind, OpKind::Dequantize | OpKind::Decompress)
            })
            .map(|(i, e)| (i, e.name.clone()))
            .unwrap_or((0, name.clone()));
        let phase = run.events.get(index).map_or(Phase::Prefill, |e| e.phase);
        let original = job.model.weights.original(&name)?;
        let detail = decoding_error(
            q.ty,
            decoded.data(),
            &reference,
            original.as_ref().map(|o| o.data()),
        );
        if let Some(detail) = detail {
            findings.push(Finding {
                rank: None,
                kind: FindingKind::QuantMismatch,
                phase,
                op,
                index,
                detail,
            });
        }
    }
    if checked == 0 {
        notes.push(
            "quantized kv_b_proj: skipped, kv_b_proj is not quantized in this model".to_string(),
        );
    } else {
        notes.push(format!(
            "quantized kv_b_proj: decoded weight checked in {checked} layer(s)"
        ));
    }
    Ok((findings, notes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgmlType;

    /// A kernel that decodes some value as NaN or Inf where the reference codec does not is a
    /// mismatch (a comparison with NaN is false, which once passed it); the same NaN in both
    /// is the file's, which the NaN/Inf detector reports, not a decoding error.
    #[test]
    fn a_decoding_with_nan_where_the_reference_has_none_is_a_mismatch() {
        let reference = [1.0f32, -2.0, 0.5, 4.0];
        let original = [1.01f32, -2.02, 0.49, 4.05];
        let mut nan = reference;
        nan[2] = f32::NAN;
        let mut inf = reference;
        inf[1] = f32::INFINITY;
        for bad in [&nan, &inf] {
            for orig in [None, Some(&original[..])] {
                let d = decoding_error(GgmlType::Q4_K, bad, &reference, orig);
                assert!(d.is_some(), "{bad:?} against {orig:?}");
            }
        }
        for orig in [None, Some(&original[..])] {
            assert_eq!(
                decoding_error(GgmlType::Q4_K, &reference, &reference, orig),
                None
            );
        }
        // NaN alike in the reference decoding and the kernel's: the file's own.
        let d = decoding_error(GgmlType::Q4_K, &nan, &nan, None);
        assert_eq!(d, None);
        let d = decoding_error(GgmlType::Q4_K, &nan, &nan, Some(&original[..]));
        assert_eq!(d, None);
    }
}
