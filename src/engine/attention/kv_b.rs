//! kv_b_proj as attention uses it: plain, quantized, or made plain once per run.

use super::LayerCtx;
use crate::backend::{Backend, KvbSplit};
use crate::engine::cache::LayerCache;
use crate::engine::faults::Fault;
use crate::engine::forward::MlaPath;
use crate::engine::sink::{Reads, Sink};
use crate::engine::trace::OpKind;
use crate::error::{Error, Result};
use crate::model::quant::{QuantFaults, QuantTensor};
use crate::tensor::Tensor;
use std::sync::Arc;

/// kv_b_proj as the run uses it.
pub(super) enum KvB {
    /// Plain weights: read from the weight store.
    Store,
    /// Quantized blocks, multiplied with directly (dequantized block by block).
    Quant(Arc<QuantTensor>, QuantFaults),
    /// A quantized kv_b_proj made plain once per run.
    Plain(Arc<Tensor>),
}

impl KvB {
    /// x·kv_bᵀ: decompresses latent rows into per-head keys and values.
    pub(super) fn linear(
        &self,
        r: &mut Reads,
        name: &str,
        b: &dyn Backend,
        x: &Tensor,
    ) -> Result<Tensor> {
        match self {
            KvB::Store => b.linear(x, &*r.weight(name)?, None),
            KvB::Quant(q, faults) => b.linear_quant(x, q, *faults),
            KvB::Plain(w) => b.linear(x, w, None),
        }
    }

    /// The plain weight, for the absorbed path's W_UK and W_UV.
    pub(super) fn weight(&self, r: &mut Reads, name: &str) -> Result<Arc<Tensor>> {
        match self {
            KvB::Store => r.weight(name),
            KvB::Plain(w) => Ok(w.clone()),
            KvB::Quant(..) => Err(Error::invalid(format!(
                "{name}: the absorbed path needs W_UK / W_UV as a plain weight"
            ))),
        }
    }
}

/// How this layer's kv_b_proj enters attention. Plain weights come from the store. A quantized
/// kv_b_proj is, with force-dequantize, decoded once per run (`kv_b_dequant`); without it the
/// naive path multiplies with the blocks, and the absorbed path obtains W_UK / W_UV the way
/// vLLM does for a quantized layer: an identity matrix pushed through the quantized linear,
/// transposed (`kv_b_identity`). FAULT q4k-scale-unpack acts in the block decoding of all three.
pub(super) fn kv_b_as_used(
    ctx: &LayerCtx,
    cache: &mut LayerCache,
    sink: &mut Sink,
    path: MlaPath,
) -> Result<KvB> {
    // FAULT tp-head-offset: the next rank's heads (read plain from the full weight).
    if ctx.fault(Fault::TpHeadOffset) && ctx.tp.size > 1 {
        let neighbour = (ctx.tp.rank + 1) % ctx.tp.size;
        return Ok(KvB::Plain(Arc::new(heads_of_rank(ctx, neighbour)?)));
    }
    let Some(q) = ctx
        .weights
        .quantized(&ctx.name("self_attn.kv_b_proj.weight"))?
    else {
        return Ok(KvB::Store);
    };
    let faults = QuantFaults {
        q4k_scale_unpack: ctx.fault(Fault::Q4kScaleUnpack),
    };
    if !ctx.force_dequant && path == MlaPath::Naive {
        return Ok(KvB::Quant(q, faults));
    }
    if let Some(w) = &cache.kv_b_plain {
        return Ok(KvB::Plain(w.clone()));
    }
    let (b, l) = (ctx.backend, Some(ctx.layer));
    let w = if ctx.force_dequant {
        sink.op(
            l,
            &ctx.name("self_attn.kv_b_dequant"),
            OpKind::Dequantize,
            &[],
            |_| b.dequantize(&q, faults),
        )?
    } else {
        sink.op(
            l,
            &ctx.name("self_attn.kv_b_identity"),
            OpKind::Dequantize,
            &[],
            |_| crate::backend::weight_through_identity(b, &q, faults),
        )?
    };
    let w = Arc::new(w);
    cache.kv_b_plain = Some(w.clone());
    Ok(KvB::Plain(w))
}

/// The rows of the full kv_b_proj that rank `rank` holds (its heads), decoded.
fn heads_of_rank(ctx: &LayerCtx, rank: usize) -> Result<Tensor> {
    let name = ctx.name("self_attn.kv_b_proj.weight");
    let rows = ctx.tp.full.shape(&name)?[0] / ctx.tp.size;
    ctx.tp.full.rows(&name, rank * rows, rows)
}

/// The kv_b_proj the absorbed path folds into the query (W_UK's rows of it).
/// FAULT tp-absorb-unsliced: the full weight read from its start, so that the rank's heads meet
/// the first heads of the model (rank 0's) on every rank.
pub(super) fn w_uk_source(
    ctx: &LayerCtx,
    kv_b: &KvB,
    r: &mut Reads,
    name: &str,
) -> Result<Arc<Tensor>> {
    if ctx.fault(Fault::TpAbsorbUnsliced) && ctx.tp.size > 1 {
        return Ok(Arc::new(heads_of_rank(ctx, 0)?));
    }
    kv_b.weight(r, name)
}

/// Where W_UK and W_UV sit in kv_b_proj. FAULT absorb-wrong-split: read as if each head's block
/// were [W_UV; W_UK].
pub(super) fn kv_b_split(ctx: &LayerCtx) -> KvbSplit {
    let dims = ctx.dims();
    if ctx.fault(Fault::AbsorbWrongSplit) {
        KvbSplit {
            w_uk_row: dims.v,
            w_uv_row: 0,
        }
    } else {
        KvbSplit::correct(dims)
    }
}
