//! The DSA indexer of GLM-5: which keys each query attends to.

use super::{push_rows, LayerCtx, Selection};
use crate::engine::cache::{LayerCache, RowCache, RowSource};
use crate::engine::faults::Fault;
use crate::engine::sink::{Computed, Sink};
use crate::engine::trace::{BufferRef, OpKind};
use crate::error::{Error, Result};
use crate::model::layout::IndexerMode;
use crate::tensor::Tensor;

/// The DSA indexer (GLM-5): q = wq_b(q_resid) [n, H, D]; k = LayerNorm(wk(x)) [n, D]; RoPE on the
/// first qk_rope dims of both; w = weights_proj(x)·H^-0.5; score[t, j] = Σ_h w[t,h]·ReLU(q[t,h]·k[j]
/// ·D^-0.5) over causal j; keep the top index_topk keys per query.
pub(super) fn dsa_selection(
    ctx: &LayerCtx,
    x: &Tensor,
    q_resid: Option<&Tensor>,
    cache: &mut LayerCache,
    shared_selection: &mut Option<Selection>,
    sink: &mut Sink,
) -> Result<Selection> {
    let (Some(ix), Some(mode)) = (&ctx.layout.indexer, ctx.layout.indexer_mode(ctx.layer)) else {
        return Ok(None);
    };
    if mode == IndexerMode::Shared {
        // Reuse the previous layer's selection. A layer range that starts on a shared layer has
        // none; it then attends densely.
        return Ok(shared_selection.clone().unwrap_or(None));
    }
    let q_resid = q_resid.ok_or_else(|| Error::invalid("the DSA indexer needs q_lora_rank"))?;
    let (b, l) = (ctx.backend, Some(ctx.layer));
    let q_proj = sink.op(
        l,
        &ctx.name("self_attn.indexer.wq_b"),
        OpKind::Linear,
        &[q_resid],
        |r| {
            let w = r.weight(&ctx.name("self_attn.indexer.wq_b.weight"))?;
            b.linear(q_resid, &w, None)
        },
    )?;
    let k_proj = sink.op(
        l,
        &ctx.name("self_attn.indexer.wk"),
        OpKind::Linear,
        &[x],
        |r| {
            let w = r.weight(&ctx.name("self_attn.indexer.wk.weight"))?;
            b.linear(x, &w, None)
        },
    )?;
    let k_normed = sink.op(
        l,
        &ctx.name("self_attn.indexer.k_norm"),
        OpKind::LayerNorm,
        &[&k_proj],
        |r| {
            let w = r.weight(&ctx.name("self_attn.indexer.k_norm.weight"))?;
            let bias = r.weight(&ctx.name("self_attn.indexer.k_norm.bias"))?;
            b.layer_norm(&k_proj, &w, &bias, 1e-6)
        },
    )?;
    // FAULT indexer-rope-layout: the indexer's RoPE in the other layout than its checkpoint's.
    let interleaved = ix.rope_interleaved ^ ctx.fault(Fault::IndexerRopeLayout);
    let q = sink.op(
        l,
        &ctx.name("self_attn.indexer.q_rope"),
        OpKind::Rope,
        &[&q_proj],
        |_| b.rope(&q_proj, ix.n_heads, ctx.rope, ctx.positions, interleaved),
    )?;
    let k = sink.op(
        l,
        &ctx.name("self_attn.indexer.k_rope"),
        OpKind::Rope,
        &[&k_normed],
        |_| b.rope(&k_normed, 1, ctx.rope, ctx.positions, interleaved),
    )?;
    let keys = cache
        .index_keys
        .get_or_insert_with(|| RowCache::new(ix.head_dim));
    push_rows(keys, &k)?;
    let keys_ref = BufferRef::cache(keys.id(), keys.address(), keys.bytes());
    sink.report(
        l,
        &ctx.name("self_attn.indexer.key_cache"),
        OpKind::CacheWrite,
        &k,
        keys_ref,
        vec![BufferRef::of(&k)],
    )?;
    let head_weights = sink.op(
        l,
        &ctx.name("self_attn.indexer.weights_proj"),
        OpKind::Linear,
        &[x],
        |r| {
            let w = r.weight(&ctx.name("self_attn.indexer.weights_proj.weight"))?;
            b.linear(x, &w, None)
        },
    )?;
    let keys = &*keys;
    let scores = sink.op_with(
        l,
        &ctx.name("self_attn.indexer.scores"),
        OpKind::IndexScores,
        &[&q, &head_weights],
        |_| {
            let scaled = b.scale(&head_weights, (ix.n_heads as f32).powf(-0.5))?;
            let tensor = b.index_scores(
                &q,
                &scaled,
                keys,
                ctx.positions,
                (ix.head_dim as f32).powf(-0.5),
            )?;
            Ok(Computed {
                tensor,
                kernel_wrote: None,
                extra_reads: vec![keys_ref],
                kernel: None,
                stats: None,
            })
        },
    )?;

    // Top-k among each query's causal keys; a query with no more than topk of them keeps all.
    let context = keys.len();
    let k_keep = ix.topk.min(context);
    let sparse = ctx.positions.iter().any(|&p| p + 1 > ix.topk);
    // Where every query has no more causal keys than top-k, each keeps them all: no need to
    // bring the scores' choice back from the device (a wait in the middle of the layer).
    let mut kept = match sparse {
        true => b.index_topk(&scores, ctx.positions, ix.topk)?,
        false => ctx.positions.iter().map(|&p| (0..=p).collect()).collect(),
    };
    let topk_name = ctx.name("self_attn.indexer.topk");
    ctx.forced.apply(ctx.phase, &topk_name, &mut kept, |row| {
        ctx.positions[row] + 1
    })?;
    for chosen in &mut kept {
        chosen.sort_unstable();
    }
    sink.op(l, &topk_name, OpKind::IndexTopK, &[&scores], |_| {
        let mut listing = Vec::with_capacity(kept.len() * k_keep);
        for chosen in &kept {
            listing.extend(chosen.iter().map(|&j| j as f32));
            listing.extend(std::iter::repeat_n(-1.0, k_keep - chosen.len()));
        }
        Ok(Tensor::from_index_values(&[kept.len(), k_keep], listing))
    })?;
    let selection = if sparse { Some(kept) } else { None };
    *shared_selection = Some(selection.clone());
    Ok(selection)
}
