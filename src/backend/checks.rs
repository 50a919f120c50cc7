//! Argument checks every backend makes before computing an op, kept in one place so that the
//! CPU and CUDA backends refuse the same inputs with the same `error:` line.

use super::MlaDims;
use crate::error::{Error, Result};
use crate::ops::RopeTable;
use crate::tensor::Tensor;

pub fn same_shape(op: &str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::invalid(format!(
            "{op}: shapes {:?} and {:?} differ",
            a.shape(),
            b.shape()
        )));
    }
    Ok(())
}

/// x [.., k] · wᵀ with w [out, k]: returns `out`.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<usize> {
    let k = x.cols();
    let out = w.shape()[0];
    if w.numel() != out * k {
        return Err(Error::invalid(format!(
            "linear: input has {k} features but the weight is {:?}",
            w.shape()
        )));
    }
    Ok(out)
}

/// x [n, heads, d] with d ≥ the table's rotated width: returns `d`.
pub fn rope(x: &Tensor, heads: usize, table: &RopeTable, n: usize) -> Result<usize> {
    let d = x.numel() / (n * heads).max(1);
    if n * heads * d != x.numel() || 2 * table.inv_freq.len() > d {
        return Err(Error::invalid(format!(
            "rope: tensor {:?} is not {n} tokens × {heads} heads of at least {} values",
            x.shape(),
            2 * table.inv_freq.len()
        )));
    }
    Ok(d)
}

/// Columns start..start+width of each of `groups` equal groups of x's rows: returns the group width.
pub fn slice_groups(x: &Tensor, groups: usize, start: usize, width: usize) -> Result<usize> {
    let gw = x.cols() / groups.max(1);
    if groups * gw != x.cols() || start + width > gw {
        return Err(Error::invalid(format!(
            "slice: cannot take columns {start}..{} of {groups} groups from {:?}",
            start + width,
            x.shape()
        )));
    }
    Ok(gw)
}

pub fn concat_groups(a: &Tensor, b: &Tensor, groups: usize) -> Result<()> {
    let rows = a.rows();
    if rows != b.rows() || groups == 0 || !rows.is_multiple_of(groups) {
        return Err(Error::invalid(format!(
            "concat: {:?} and {:?} are not rows of {groups} groups",
            a.shape(),
            b.shape()
        )));
    }
    Ok(())
}

pub fn gather_rows(x: &Tensor, rows: &[usize]) -> Result<()> {
    match rows.iter().find(|&&r| r >= x.rows()) {
        Some(r) => Err(Error::invalid(format!(
            "gather: row {r} of a {:?} tensor",
            x.shape()
        ))),
        None => Ok(()),
    }
}

pub fn scatter_add_rows(acc: &Tensor, rows: &[usize], y: &Tensor, weights: &[f32]) -> Result<()> {
    if y.cols() != acc.cols() || y.rows() != rows.len() || weights.len() != rows.len() {
        return Err(Error::invalid(format!(
            "scatter_add: {:?} rows into {:?}",
            y.shape(),
            acc.shape()
        )));
    }
    Ok(())
}

/// The output buffer an attention op writes: [n, heads, width].
pub fn attention_out(out: &Tensor, n: usize, dims: MlaDims, width: usize) -> Result<()> {
    let heads = dims.heads;
    if out.numel() != n * heads * width {
        return Err(Error::invalid(format!(
            "attention output buffer {:?} is not {n} × {heads} × {width}",
            out.shape()
        )));
    }
    Ok(())
}

/// DSA top-k: one position per score row, each inside the row.
pub fn index_topk(scores: &Tensor, positions: &[usize]) -> Result<()> {
    if scores.rows() != positions.len() || positions.iter().any(|&p| p >= scores.cols()) {
        return Err(Error::invalid(format!(
            "index top-k: {} positions for scores of shape {:?}",
            positions.len(),
            scores.shape()
        )));
    }
    Ok(())
}

/// x [.., k] · Wᵀ with W quantized [out, k]: returns the output shape.
pub fn linear_quant(x: &Tensor, w: &crate::model::quant::QuantTensor) -> Result<Vec<usize>> {
    let k = x.cols();
    if k != w.cols {
        return Err(Error::invalid(format!(
            "quantized linear: input of {k} features for a {} weight [{}, {}]",
            w.ty, w.rows, w.cols
        )));
    }
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("linear input has a shape") = w.rows;
    crate::tensor::checked_numel(&shape, "quantized linear output")?;
    Ok(shape)
}

/// A norm's weight (and bias) hold one value per column of x: returns (rows, cols).
pub fn norm(
    op: &str,
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
) -> Result<(usize, usize)> {
    let cols = x.cols();
    for (what, t) in std::iter::once(("weight", weight)).chain(bias.map(|b| ("bias", b))) {
        if t.numel() != cols {
            return Err(Error::invalid(format!(
                "{op}: {what} of {} values for rows of {cols} ({:?})",
                t.numel(),
                x.shape()
            )));
        }
    }
    Ok((x.rows(), cols))
}

/// kv_b_proj [heads·(P+V), L], and rows `first..first + count` of each head's block: the W_UK
/// or W_UV that absorb_query / apply_w_uv read.
fn kv_b(op: &str, kv_b: &Tensor, dims: MlaDims, first: usize, count: usize) -> Result<()> {
    let block = dims.nope + dims.v;
    if kv_b.numel() != dims.heads * block * dims.latent || first + count > block {
        return Err(Error::invalid(format!(
            "{op}: kv_b_proj {:?} is not {} heads × {block} rows × {} (rows {first}..{} of each)",
            kv_b.shape(),
            dims.heads,
            dims.latent,
            first + count
        )));
    }
    Ok(())
}

/// x holds whole rows of heads × `width`: returns the row count.
fn per_head_rows(op: &str, x: &Tensor, heads: usize, width: usize) -> Result<usize> {
    let per_row = heads * width;
    if per_row == 0 || !x.numel().is_multiple_of(per_row) {
        return Err(Error::invalid(format!(
            "{op}: {:?} is not rows of {heads} heads × {width}",
            x.shape()
        )));
    }
    Ok(x.numel() / per_row)
}

/// absorb_query: q_nope [n, heads, P] and W_UK inside kv_b: returns n.
pub fn absorb_query(
    q_nope: &Tensor,
    kvb: &Tensor,
    dims: MlaDims,
    split: super::KvbSplit,
) -> Result<usize> {
    kv_b("absorb_query", kvb, dims, split.w_uk_row, dims.nope)?;
    per_head_rows("absorb_query", q_nope, dims.heads, dims.nope)
}

/// apply_w_uv: o_lat [n, heads, L] and W_UV inside kv_b: returns n.
pub fn apply_w_uv(
    o_lat: &Tensor,
    kvb: &Tensor,
    dims: MlaDims,
    split: super::KvbSplit,
) -> Result<usize> {
    kv_b("apply_w_uv", kvb, dims, split.w_uv_row, dims.v)?;
    per_head_rows("apply_w_uv", o_lat, dims.heads, dims.latent)
}

/// assemble_kv: kv [n, heads·(P+V)] and k_pe [n, R]: returns n.
pub fn assemble_kv(kv: &Tensor, k_pe: &Tensor, dims: MlaDims) -> Result<usize> {
    let n = kv.rows();
    if kv.numel() != n * dims.heads * (dims.nope + dims.v) || k_pe.numel() != n * dims.rope {
        return Err(Error::invalid(format!(
            "assemble_kv: kv {:?} and k_pe {:?} are not {n} rows of {} heads × {} and of {}",
            kv.shape(),
            k_pe.shape(),
            dims.heads,
            dims.nope + dims.v,
            dims.rope
        )));
    }
    Ok(n)
}

/// The mask of an attention op: one position per query, selected keys (where given) one list per
/// query.
fn mask(op: &str, mask: &super::AttnMask, n: usize) -> Result<()> {
    if mask.selected.as_ref().is_some_and(|s| s.len() != n) {
        return Err(Error::invalid(format!(
            "{op}: a key selection for other than {n} queries"
        )));
    }
    Ok(())
}

/// Naive attention: q [n, heads, P+R] with n = the mask's queries, K rows of heads·(P+R), V rows
/// of heads·V, as many of each.
pub fn attention_naive(
    q: &Tensor,
    k: &dyn crate::ops::RowSource,
    v: &dyn crate::ops::RowSource,
    dims: MlaDims,
    m: &super::AttnMask,
) -> Result<usize> {
    let n = m.positions.len();
    let d = dims.nope + dims.rope;
    if q.numel() != n * dims.heads * d
        || k.width() != dims.heads * d
        || v.width() != dims.heads * dims.v
        || k.len() != v.len()
    {
        return Err(Error::invalid(format!(
            "attention: q {:?} for {n} queries, K rows of {} and V rows of {} for {} heads of {d} and {}",
            q.shape(),
            k.width(),
            v.width(),
            dims.heads,
            dims.v
        )));
    }
    mask("attention", m, n)?;
    Ok(n)
}

/// Latent attention: q_lat [n, heads, L], q_pe [n, heads, R], cache rows of L + R.
pub fn attention_latent(
    q_lat: &Tensor,
    q_pe: &Tensor,
    cache: &dyn crate::ops::RowSource,
    dims: MlaDims,
    m: &super::AttnMask,
) -> Result<usize> {
    let n = m.positions.len();
    if q_lat.numel() != n * dims.heads * dims.latent
        || q_pe.numel() != n * dims.heads * dims.rope
        || cache.width() != dims.latent + dims.rope
    {
        return Err(Error::invalid(format!(
            "latent attention: q_lat {:?}, q_pe {:?} and cache rows of {} for {n} queries of {} heads",
            q_lat.shape(),
            q_pe.shape(),
            cache.width(),
            dims.heads
        )));
    }
    mask("latent attention", m, n)?;
    Ok(n)
}

/// DSA indexer scores: weights [n, heads], q [n, heads, D] with D the keys' width: returns
/// (n, heads, D).
pub fn index_scores(
    q: &Tensor,
    weights: &Tensor,
    keys: &dyn crate::ops::RowSource,
    positions: &[usize],
) -> Result<(usize, usize, usize)> {
    let n = positions.len();
    let heads = weights.cols();
    let d = keys.width();
    if weights.numel() != n * heads || q.numel() != n * heads * d {
        return Err(Error::invalid(format!(
            "index scores: q {:?} and weights {:?} for {n} queries over keys of {d}",
            q.shape(),
            weights.shape()
        )));
    }
    Ok((n, heads, d))
}

/// MoE routing: logits [n, experts], one bias per expert, experts in equal groups of which the
/// kept ones hold at least top-k experts.
pub fn route(logits: &Tensor, bias: &Tensor, moe: &crate::model::layout::MoeLayout) -> Result<()> {
    let (e, g) = (moe.n_routed_experts, moe.n_group);
    let groups_ok = g > 0
        && e.is_multiple_of(g)
        && moe.topk_group <= g
        && moe.topk_group * (e / g) >= moe.num_experts_per_tok;
    if !groups_ok || logits.cols() != e || bias.numel() != e {
        return Err(Error::invalid(format!(
            "route: logits {:?} and bias {:?} for {e} experts in {g} groups, {} kept, top {}",
            logits.shape(),
            bias.shape(),
            moe.topk_group,
            moe.num_experts_per_tok
        )));
    }
    Ok(())
}
