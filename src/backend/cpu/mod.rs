//! The CPU reference backend: f32 throughout, parallel over rows with rayon.

pub mod attention;
pub mod matmul;
mod ranks;

use super::checks::{self, same_shape};
use super::{AttnParams, Backend, KvbSplit, MlaDims, Routing};
use crate::error::Result;
use crate::model::layout::MoeLayout;
use crate::ops::{RopeTable, RowSource};
use crate::stats::TensorStats;
use crate::tensor::Tensor;

pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn rank_backends(&self, size: usize) -> Result<Option<super::RankBackends>> {
        Ok(ranks::rank_backends(size))
    }

    fn alloc(&self, shape: &[usize], poison: bool) -> Result<Tensor> {
        Tensor::alloc(shape, poison)
    }

    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let k = x.cols();
        let out = checks::linear(x, w)?;
        let n = x.rows();
        let mut shape = x.shape().to_vec();
        *shape.last_mut().expect("linear input has a shape") = out;
        crate::tensor::checked_numel(&shape, "linear output")?;
        let mut y = matmul::matmul_t(x.data(), n, k, w.data(), out);
        if let Some(b) = bias {
            for row in y.chunks_mut(out) {
                for (v, bv) in row.iter_mut().zip(b.data()) {
                    *v += bv;
                }
            }
        }
        Ok(Tensor::from_vec(&shape, y))
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
        let (_, c) = checks::norm("rms_norm", x, weight, None)?;
        let mut out = Tensor::zeros(x.shape())?;
        for (o, row) in out.data_mut().chunks_mut(c).zip(x.data().chunks(c)) {
            let mean_sq = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / c as f64;
            let inv = (1.0 / (mean_sq + eps).sqrt()) as f32;
            for ((ov, v), w) in o.iter_mut().zip(row).zip(weight.data()) {
                *ov = w * (v * inv);
            }
        }
        Ok(out)
    }

    fn layer_norm(&self, x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
        let (_, c) = checks::norm("layer_norm", x, weight, Some(bias))?;
        let mut out = Tensor::zeros(x.shape())?;
        for (o, row) in out.data_mut().chunks_mut(c).zip(x.data().chunks(c)) {
            let mean64 = row.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
            let var = row
                .iter()
                .map(|&v| (v as f64 - mean64).powi(2))
                .sum::<f64>()
                / c as f64;
            let (mean, inv) = (mean64 as f32, (1.0 / (var + eps).sqrt()) as f32);
            for (((ov, v), w), b) in o.iter_mut().zip(row).zip(weight.data()).zip(bias.data()) {
                *ov = (v - mean) * inv * w + b;
            }
        }
        Ok(out)
    }

    fn rope(
        &self,
        x: &Tensor,
        heads: usize,
        table: &RopeTable,
        positions: &[usize],
        interleaved: bool,
    ) -> Result<Tensor> {
        let n = positions.len();
        let d = checks::rope(x, heads, table, n)?;
        let mut out = x.clone();
        for (t, token) in out.data_mut().chunks_mut(heads * d).enumerate() {
            for head in token.chunks_mut(d) {
                table.rotate(head, positions[t], interleaved);
            }
        }
        Ok(out)
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        same_shape("silu_mul", gate, up)?;
        let data = gate
            .data()
            .iter()
            .zip(up.data())
            .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        Ok(Tensor::from_vec(gate.shape(), data))
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        same_shape("add", a, b)?;
        let data = a.data().iter().zip(b.data()).map(|(x, y)| x + y).collect();
        Ok(Tensor::from_vec(a.shape(), data))
    }

    fn slice_groups(
        &self,
        x: &Tensor,
        groups: usize,
        start: usize,
        width: usize,
    ) -> Result<Tensor> {
        let n = x.rows();
        let gw = checks::slice_groups(x, groups, start, width)?;
        let mut out = Vec::with_capacity(n * groups * width);
        for row in x.data().chunks(x.cols()) {
            for g in row.chunks(gw) {
                out.extend_from_slice(&g[start..start + width]);
            }
        }
        let shape = if groups == 1 {
            vec![n, width]
        } else {
            vec![n, groups, width]
        };
        Ok(Tensor::from_vec(&shape, out))
    }

    fn concat_groups(&self, a: &Tensor, b: &Tensor, groups: usize) -> Result<Tensor> {
        let (wa, wb) = (a.cols(), b.cols());
        let rows = a.rows();
        checks::concat_groups(a, b, groups)?;
        let n = rows / groups;
        let mut out = Vec::with_capacity(a.numel() + b.numel());
        for (ga, gb) in a.data().chunks(wa).zip(b.data().chunks(wb)) {
            out.extend_from_slice(ga);
            out.extend_from_slice(gb);
        }
        Ok(Tensor::from_vec(&[n, groups, wa + wb], out))
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        Ok(Tensor::from_vec(
            x.shape(),
            x.data().iter().map(|v| v * s).collect(),
        ))
    }

    fn gather_rows(&self, x: &Tensor, rows: &[usize]) -> Result<Tensor> {
        checks::gather_rows(x, rows)?;
        let c = x.cols();
        let mut out = Vec::with_capacity(rows.len() * c);
        for &r in rows {
            out.extend_from_slice(x.row(r));
        }
        Ok(Tensor::from_vec(&[rows.len(), c], out))
    }

    fn scatter_add_rows(
        &self,
        acc: &mut Tensor,
        rows: &[usize],
        y: &Tensor,
        weights: &[f32],
    ) -> Result<()> {
        let c = acc.cols();
        checks::scatter_add_rows(acc, rows, y, weights)?;
        for (i, (&r, &w)) in rows.iter().zip(weights).enumerate() {
            let src = &y.data()[i * c..(i + 1) * c];
            matmul::axpy(&mut acc.data_mut()[r * c..(r + 1) * c], w, src);
        }
        Ok(())
    }

    fn route(&self, logits: &Tensor, bias: &Tensor, moe: &MoeLayout) -> Result<Routing> {
        checks::route(logits, bias, moe)?;
        Ok(crate::ops::moe::route(logits, bias.data(), moe))
    }

    fn absorb_query(
        &self,
        q_nope: &Tensor,
        kv_b: &Tensor,
        dims: MlaDims,
        split: KvbSplit,
    ) -> Result<Tensor> {
        attention::absorb_query(q_nope, kv_b, dims, split)
    }

    fn apply_w_uv(
        &self,
        o_lat: &Tensor,
        kv_b: &Tensor,
        dims: MlaDims,
        split: KvbSplit,
    ) -> Result<Tensor> {
        attention::apply_w_uv(o_lat, kv_b, dims, split)
    }

    fn assemble_kv(&self, kv: &Tensor, k_pe: &Tensor, dims: MlaDims) -> Result<(Tensor, Tensor)> {
        let n = checks::assemble_kv(kv, k_pe, dims)?;
        let (p, r, v) = (dims.nope, dims.rope, dims.v);
        let mut k = Vec::with_capacity(n * dims.heads * (p + r));
        let mut vals = Vec::with_capacity(n * dims.heads * v);
        for t in 0..n {
            let row = kv.row(t);
            let pe = k_pe.row(t);
            for h in 0..dims.heads {
                let head = &row[h * (p + v)..(h + 1) * (p + v)];
                k.extend_from_slice(&head[..p]);
                k.extend_from_slice(pe);
                vals.extend_from_slice(&head[p..]);
            }
        }
        Ok((
            Tensor::from_vec(&[n, dims.heads * (p + r)], k),
            Tensor::from_vec(&[n, dims.heads * v], vals),
        ))
    }

    fn attention_naive(
        &self,
        q: &Tensor,
        k: &dyn RowSource,
        v: &dyn RowSource,
        call: AttnParams<'_>,
        out: &mut Tensor,
    ) -> Result<Tensor> {
        attention::naive(q, k, v, call, out)
    }

    fn attention_latent(
        &self,
        q_lat: &Tensor,
        q_pe: &Tensor,
        cache: &dyn RowSource,
        call: AttnParams<'_>,
        out: &mut Tensor,
    ) -> Result<Tensor> {
        attention::latent(q_lat, q_pe, cache, call, out)
    }

    fn index_scores(
        &self,
        q: &Tensor,
        weights: &Tensor,
        keys: &dyn RowSource,
        positions: &[usize],
        scale: f32,
    ) -> Result<Tensor> {
        attention::index_scores(q, weights, keys, positions, scale)
    }

    fn stats(&self, t: &Tensor) -> TensorStats {
        TensorStats::of(t.data())
    }
}
