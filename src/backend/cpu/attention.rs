//! CPU attention for both MLA paths and the DSA indexer scores. Softmax in f32 with the running
//! maximum subtracted, as HF's eager attention does.

use super::matmul::{axpy, dot};
use crate::backend::{AttnMask, MlaDims};
use crate::engine::cache::RowSource;
use crate::error::Result;
use crate::tensor::Tensor;
use rayon::prelude::*;

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

/// Per (query, head) result: the output row, written into the probability row as it goes.
/// Runs `f(i, h, out_row, prob_row)` for every (query i, head h) pair, in parallel when worth
/// it, and assembles the output [n, heads, out_width] and the probabilities [heads, n, context].
fn per_query_head<F>(
    n: usize,
    dims: MlaDims,
    out_width: usize,
    context: usize,
    f: F,
) -> Result<(Tensor, Tensor)>
where
    F: Fn(usize, usize, &mut [f32], &mut [f32]) + Sync,
{
    let heads = dims.heads;
    // Head-major output first, so each (h, i) owns one output chunk and one probability row.
    let mut out_hm = Tensor::zeros(&[heads, n, out_width])?;
    let mut probs = Tensor::zeros(&[heads, n, context])?;
    let work = |(r, (o, p)): (usize, (&mut [f32], &mut [f32]))| f(r % n, r / n, o, p);
    let chunks = out_hm
        .data_mut()
        .chunks_mut(out_width)
        .zip(probs.data_mut().chunks_mut(context.max(1)));
    if n * heads * context * out_width < 1 << 15 {
        chunks.enumerate().for_each(work);
    } else {
        let chunks: Vec<_> = chunks.collect();
        chunks.into_par_iter().enumerate().for_each(work);
    }
    let mut out = Tensor::zeros(&[n, heads, out_width])?;
    for h in 0..heads {
        for i in 0..n {
            out.data_mut()[(i * heads + h) * out_width..][..out_width]
                .copy_from_slice(&out_hm.data()[(h * n + i) * out_width..][..out_width]);
        }
    }
    Ok((out, probs))
}

/// Softmax over the listed keys' scores, written into `probs` at those keys.
fn scatter_softmax(keys: &[usize], mut scores: Vec<f32>, probs: &mut [f32]) -> Vec<f32> {
    softmax(&mut scores);
    for (&j, &p) in keys.iter().zip(&scores) {
        probs[j] = p;
    }
    scores
}

pub fn naive(
    q: &Tensor,
    k: &dyn RowSource,
    v: &dyn RowSource,
    dims: MlaDims,
    mask: &AttnMask,
    scale: f32,
) -> Result<(Tensor, Tensor)> {
    let n = mask.positions.len();
    let d = dims.nope + dims.rope;
    let context = k.len();
    let (out, probs) = per_query_head(n, dims, dims.v, context, |i, h, out, probs| {
        let qh = &q.data()[(i * dims.heads + h) * d..][..d];
        let keys: Vec<usize> = mask.keys(i).collect();
        let scores: Vec<f32> = keys
            .iter()
            .map(|&j| dot(qh, &k.row(j)[h * d..(h + 1) * d]) * scale)
            .collect();
        let p = scatter_softmax(&keys, scores, probs);
        for (&j, &pj) in keys.iter().zip(&p) {
            axpy(out, pj, &v.row(j)[h * dims.v..(h + 1) * dims.v]);
        }
    })?;
    Ok((out.reshaped(&[n, dims.heads * dims.v]), probs))
}

pub fn latent(
    q_lat: &Tensor,
    q_pe: &Tensor,
    cache: &dyn RowSource,
    dims: MlaDims,
    mask: &AttnMask,
    scale: f32,
) -> Result<(Tensor, Tensor)> {
    let n = mask.positions.len();
    let (l, r) = (dims.latent, dims.rope);
    let context = cache.len();
    per_query_head(n, dims, l, context, |i, h, out, probs| {
        let ql = &q_lat.data()[(i * dims.heads + h) * l..][..l];
        let qp = &q_pe.data()[(i * dims.heads + h) * r..][..r];
        let keys: Vec<usize> = mask.keys(i).collect();
        let scores: Vec<f32> = keys
            .iter()
            .map(|&j| {
                let row = cache.row(j);
                (dot(ql, &row[..l]) + dot(qp, &row[l..l + r])) * scale
            })
            .collect();
        let p = scatter_softmax(&keys, scores, probs);
        for (&j, &pj) in keys.iter().zip(&p) {
            axpy(out, pj, &cache.row(j)[..l]);
        }
    })
}

pub fn absorb_query(q_nope: &Tensor, kv_b: &Tensor, dims: MlaDims) -> Result<Tensor> {
    let n = q_nope.numel() / (dims.heads * dims.nope);
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
                let row = h * (p + v) + pi;
                axpy(o, qv, &w[row * l..(row + 1) * l]);
            }
        });
    Ok(out)
}

pub fn apply_w_uv(o_lat: &Tensor, kv_b: &Tensor, dims: MlaDims) -> Result<Tensor> {
    let n = o_lat.numel() / (dims.heads * dims.latent);
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
                let row = h * (p + v) + p + vi;
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
    let n = positions.len();
    let heads = weights.cols();
    let d = q.numel() / (n * heads).max(1);
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
