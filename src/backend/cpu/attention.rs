//! CPU attention for both MLA paths and the DSA indexer scores.
//!
//! Naive attention is a plain causal softmax (f32, running maximum subtracted), as HF's eager
//! attention computes it. Latent (absorbed) attention is computed the way decode kernels such as
//! FlashMLA and vLLM's Triton MLA decode do it: the context is cut into blocks of
//! [`SPLIT_KV_BLOCK`] positions, each block yields a partial output and its log-sum-exp, and the
//! partials are merged with weights exp(lse_block − lse_total). In exact arithmetic both are the
//! same softmax; the split structure is what the `lse-base-mismatch` fault corrupts.
//!
//! Both kernels write into an output buffer the caller hands them and write every element of it
//! (unless the `skip-padded-rows` fault makes them skip some), so poisoned buffers reveal what
//! was left unwritten.

use super::matmul::{axpy, dot};
use crate::backend::{AttnParams, KvbSplit, MlaDims};
use crate::error::Result;
use crate::ops::{KernelFaults, RowSource};
use crate::tensor::Tensor;
use rayon::prelude::*;

/// Context positions per split-KV block of the latent attention kernel.
pub const SPLIT_KV_BLOCK: usize = 8;

/// Softmax of `scores` in place.
fn softmax(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    for s in scores.iter_mut() {
        *s /= sum;
    }
}

/// Runs `f(i, h, out_row, prob_row)` for every (query i, head h) pair, in parallel when worth
/// it, writing the output into `out` [n, heads, out_width] and returning the probabilities
/// [heads, n, context]. `f` returns false for a row it skipped (left unwritten).
fn per_query_head<F>(
    n: usize,
    dims: MlaDims,
    out: &mut Tensor,
    out_width: usize,
    context: usize,
    f: F,
) -> Result<Tensor>
where
    F: Fn(usize, usize, &mut [f32], &mut [f32]) -> bool + Sync,
{
    let heads = dims.heads;
    super::super::checks::attention_out(out, n, dims, out_width)?;
    // Head-major scratch first, so each (h, i) owns one output chunk and one probability row.
    let mut out_hm = vec![0f32; heads * n * out_width];
    let mut written = vec![true; heads * n];
    let mut probs = Tensor::zeros(&[heads, n, context])?;
    type Row<'a> = (usize, ((&'a mut [f32], &'a mut [f32]), &'a mut bool));
    let work = |(r, ((o, p), w)): Row| *w = f(r % n, r / n, o, p);
    let chunks = out_hm
        .chunks_mut(out_width)
        .zip(probs.data_mut().chunks_mut(context.max(1)))
        .zip(written.iter_mut());
    if n * heads * context * out_width < 1 << 15 {
        chunks.enumerate().for_each(work);
    } else {
        let chunks: Vec<_> = chunks.collect();
        chunks.into_par_iter().enumerate().for_each(work);
    }
    let dst = out.data_mut();
    for h in 0..heads {
        for i in 0..n {
            if written[h * n + i] {
                dst[(i * heads + h) * out_width..][..out_width]
                    .copy_from_slice(&out_hm[(h * n + i) * out_width..][..out_width]);
            }
        }
    }
    Ok(probs)
}

/// Whether the skip-padded-rows fault drops this row: the last head of every query.
fn skipped(faults: KernelFaults, h: usize, dims: MlaDims) -> bool {
    faults.skip_padded_rows && h + 1 == dims.heads
}

pub fn naive(
    q: &Tensor,
    k: &dyn RowSource,
    v: &dyn RowSource,
    call: AttnParams<'_>,
    out: &mut Tensor,
) -> Result<Tensor> {
    let (dims, mask, scale, faults) = call.parts();
    let n = super::super::checks::attention_naive(q, k, v, dims, mask)?;
    let d = dims.nope + dims.rope;
    let context = k.len();
    per_query_head(n, dims, out, dims.v, context, |i, h, out, probs| {
        if skipped(faults, h, dims) {
            return false;
        }
        let qh = &q.data()[(i * dims.heads + h) * d..][..d];
        let keys: Vec<usize> = mask.keys(i).collect();
        let mut p: Vec<f32> = keys
            .iter()
            .map(|&j| dot(qh, &k.row(j)[h * d..(h + 1) * d]) * scale)
            .collect();
        softmax(&mut p);
        out.fill(0.0);
        for (&j, &pj) in keys.iter().zip(&p) {
            probs[j] = pj;
            axpy(out, pj, &v.row(j)[h * dims.v..(h + 1) * dims.v]);
        }
        true
    })
}

/// One split-KV block's partial: unnormalised output, its running max and sum.
struct Partial {
    keys: Vec<usize>,
    scores: Vec<f32>,
    max: f32,
    sum: f32,
    acc: Vec<f32>,
}

pub fn latent(
    q_lat: &Tensor,
    q_pe: &Tensor,
    cache: &dyn RowSource,
    call: AttnParams<'_>,
    out: &mut Tensor,
) -> Result<Tensor> {
    let (dims, mask, scale, faults) = call.parts();
    let n = super::super::checks::attention_latent(q_lat, q_pe, cache, dims, mask)?;
    let (l, r) = (dims.latent, dims.rope);
    let context = cache.len();
    per_query_head(n, dims, out, l, context, |i, h, out, probs| {
        if skipped(faults, h, dims) {
            return false;
        }
        let ql = &q_lat.data()[(i * dims.heads + h) * l..][..l];
        let qp = &q_pe.data()[(i * dims.heads + h) * r..][..r];
        // Partials per block of positions.
        let mut partials: Vec<Partial> = Vec::new();
        for j in mask.keys(i) {
            let row = cache.row(j);
            let s = (dot(ql, &row[..l]) + dot(qp, &row[l..l + r])) * scale;
            let block = j / SPLIT_KV_BLOCK;
            if partials
                .last()
                .is_none_or(|p| p.keys[0] / SPLIT_KV_BLOCK != block)
            {
                partials.push(Partial {
                    keys: Vec::new(),
                    scores: Vec::new(),
                    max: f32::NEG_INFINITY,
                    sum: 0.0,
                    acc: vec![0.0; l],
                });
            }
            let p = partials.last_mut().expect("just pushed");
            p.keys.push(j);
            p.scores.push(s);
            p.max = p.max.max(s);
        }
        let mut lse = Vec::with_capacity(partials.len());
        for p in &mut partials {
            for (&j, &s) in p.keys.iter().zip(&p.scores) {
                let e = (s - p.max).exp();
                p.sum += e;
                axpy(&mut p.acc, e, &cache.row(j)[..l]);
            }
            lse.push(if faults.lse_base_mismatch {
                // The bug: this kernel reports log2-sum-exp ...
                p.max * std::f32::consts::LOG2_E + p.sum.log2()
            } else {
                p.max + p.sum.ln()
            });
        }
        // ... and the merge reads it as a natural log.
        let top = lse.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let total = top + lse.iter().map(|x| (x - top).exp()).sum::<f32>().ln();
        out.fill(0.0);
        for (p, &lse_p) in partials.iter().zip(&lse) {
            let w = (lse_p - total).exp() / p.sum;
            axpy(out, w, &p.acc);
            for (&j, &s) in p.keys.iter().zip(&p.scores) {
                probs[j] = (s - p.max).exp() * w;
            }
        }
        true
    })
}

pub fn absorb_query(
    q_nope: &Tensor,
    kv_b: &Tensor,
    dims: MlaDims,
    split: KvbSplit,
) -> Result<Tensor> {
    let n = super::super::checks::absorb_query(q_nope, kv_b, dims, split)?;
    let (p, v, l) = (dims.nope, dims.v, dims.latent);
    let mut out = Tensor::zeros(&[n, dims.heads, l])?;
    let w = kv_b.data();
    out.data_mut()
        .par_chunks_mut(l)
        .enumerate()
        .for_each(|(ih, o)| {
            let h = ih % dims.heads;
            let q = &q_nope.data()[ih * p..(ih + 1) * p];
            // q_lat = Σ_p q[p] · W_UK[h][p][:]
            for (pi, &qv) in q.iter().enumerate() {
                let row = h * (p + v) + split.w_uk_row + pi;
                axpy(o, qv, &w[row * l..(row + 1) * l]);
            }
        });
    Ok(out)
}

pub fn apply_w_uv(o_lat: &Tensor, kv_b: &Tensor, dims: MlaDims, split: KvbSplit) -> Result<Tensor> {
    let n = super::super::checks::apply_w_uv(o_lat, kv_b, dims, split)?;
    let (p, v, l) = (dims.nope, dims.v, dims.latent);
    let mut out = Tensor::zeros(&[n, dims.heads * v])?;
    let w = kv_b.data();
    out.data_mut()
        .par_chunks_mut(v)
        .enumerate()
        .for_each(|(ih, o)| {
            let h = ih % dims.heads;
            let lat = &o_lat.data()[ih * l..(ih + 1) * l];
            for (vi, ov) in o.iter_mut().enumerate() {
                let row = h * (p + v) + split.w_uv_row + vi;
                *ov = dot(lat, &w[row * l..(row + 1) * l]);
            }
        });
    Ok(out)
}

pub fn index_scores(
    q: &Tensor,
    weights: &Tensor,
    keys: &dyn RowSource,
    positions: &[usize],
    scale: f32,
) -> Result<Tensor> {
    let (n, heads, d) = super::super::checks::index_scores(q, weights, keys, positions)?;
    let context = keys.len();
    let mut out = Tensor::zeros(&[n, context])?;
    out.data_mut()
        .par_chunks_mut(context.max(1))
        .enumerate()
        .for_each(|(i, row)| {
            for (j, s) in row.iter_mut().enumerate() {
                if j > positions[i] {
                    *s = f32::NEG_INFINITY;
                    continue;
                }
                let key = keys.row(j);
                let mut total = 0f32;
                for h in 0..heads {
                    let qh = &q.data()[(i * heads + h) * d..][..d];
                    let relu = (dot(qh, key) * scale).max(0.0);
                    total += weights.data()[i * heads + h] * relu;
                }
                *s = total;
            }
        });
    Ok(out)
}
