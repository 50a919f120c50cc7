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
