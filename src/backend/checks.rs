//! Argument checks every backend makes before computing an op, kept in one place so that the
//! CPU and CUDA backends refuse the same inputs with the same `error:` line.

use super::MlaDims;
use crate::engine::rope::RopeTable;
use crate::error::{Error, Result};
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
