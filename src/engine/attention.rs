//! MLA attention of one layer, both paths, with the DSA indexer.
//!
//! kv_b_proj [N·(P+V), L] viewed as [N, P+V, L]: rows 0..P of each head are W_UK, rows P..P+V W_UV.
//! * Naive (prefill in production, everything with MLA disabled): k_nope = W_UK·c_kv and
//!   v = W_UV·c_kv per head, K = [k_nope | k_pe]; multi-head attention with head dim P+R over the
//!   expanded cache.
//! * Absorbed (decode in production): q_lat = W_UKᵀ·q_nope (length L); score = q_lat·c_kv +
//!   q_pe·k_pe; o_lat = Σ p·c_kv; o = W_UV·o_lat. Multi-query attention with one KV head of width
//!   L+R over the latent cache, whose "V" is its own first L columns.
//!
//! Both use the scale (P+R)^-0.5 (times mscale² under YaRN) and are the same function in exact
//! arithmetic.

use super::cache::{ExpandedCache, LayerCache, RowCache, RowSource};
use super::forward::MlaPath;
use super::moe::top_k_indices;
use super::rope::RopeTable;
use super::sink::Sink;
use super::trace::{BufferRef, OpKind};
use crate::backend::{AttnMask, Backend, MlaDims};
use crate::error::Result;
use crate::model::catalog::layer_prefix;
use crate::model::layout::{IndexerMode, Layout};
use crate::model::WeightStore;
use crate::tensor::Tensor;
use std::sync::Arc;

/// What one layer's ops need to see.
pub struct LayerCtx<'a> {
    pub layout: &'a Layout,
    pub weights: &'a WeightStore,
    pub backend: &'a dyn Backend,
    pub rope: &'a RopeTable,
    pub layer: usize,
    /// Absolute positions of the tokens of this chunk.
    pub positions: &'a [usize],
}

impl LayerCtx<'_> {
    pub fn weight(&self, suffix: &str) -> Result<Arc<Tensor>> {
        self.weights
            .get(&format!("{}.{suffix}", layer_prefix(self.layer)))
    }

    fn optional_bias(&self, suffix: &str) -> Result<Option<Arc<Tensor>>> {
        if self.layout.attention_bias {
            self.weight(suffix).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn name(&self, suffix: &str) -> String {
        format!("{}.{suffix}", layer_prefix(self.layer))
    }

    pub fn dims(&self) -> MlaDims {
        MlaDims {
            heads: self.layout.num_heads,
            nope: self.layout.qk_nope_head_dim,
            rope: self.layout.qk_rope_head_dim,
            v: self.layout.v_head_dim,
            latent: self.layout.kv_lora_rank,
        }
    }
}

/// The DSA selection of one chunk: per query, the kept key positions (sorted); `None` when every
/// query keeps all its causal keys.
pub type Selection = Option<Vec<Vec<usize>>>;

/// Runs the attention block on normalised input `x` [n, hidden]. `shared_selection` carries the
/// previous layer's DSA selection to layers that reuse it, and is updated by full indexer layers.
pub fn attention_block(
    ctx: &LayerCtx,
    x: &Tensor,
    cache: &mut LayerCache,
    path: MlaPath,
    shared_selection: &mut Option<Selection>,
    sink: &mut Sink,
) -> Result<Tensor> {
    let (b, layout, l) = (ctx.backend, ctx.layout, Some(ctx.layer));
    let dims = ctx.dims();
    let n = ctx.positions.len();

    // Query: low-rank (q_a → norm → q_b) or a plain q_proj.
    let (q, q_resid) = match layout.q_lora_rank {
        Some(_) => {
            let w = ctx.weight("self_attn.q_a_proj.weight")?;
            let bias = ctx.optional_bias("self_attn.q_a_proj.bias")?;
            let q_a = b.linear(x, &w, bias.as_deref())?;
            sink.emit(
                l,
                &ctx.name("self_attn.q_a_proj"),
                OpKind::Linear,
                &q_a,
                &[x],
                &[&w],
            )?;
            let w = ctx.weight("self_attn.q_a_layernorm.weight")?;
            let q_resid = b.rms_norm(&q_a, &w, layout.lora_norm_eps)?;
            sink.emit(
                l,
                &ctx.name("self_attn.q_a_layernorm"),
                OpKind::RmsNorm,
                &q_resid,
                &[&q_a],
                &[&w],
            )?;
            let w = ctx.weight("self_attn.q_b_proj.weight")?;
            let q = b.linear(&q_resid, &w, None)?;
            sink.emit(
                l,
                &ctx.name("self_attn.q_b_proj"),
                OpKind::Linear,
                &q,
                &[&q_resid],
                &[&w],
            )?;
            (q, Some(q_resid))
        }
        None => {
            let w = ctx.weight("self_attn.q_proj.weight")?;
            let q = b.linear(x, &w, None)?;
            sink.emit(
                l,
                &ctx.name("self_attn.q_proj"),
                OpKind::Linear,
                &q,
                &[x],
                &[&w],
            )?;
            (q, None)
        }
    };

    // Compressed KV: c_kv (normalised) and the shared rope key.
    let w = ctx.weight("self_attn.kv_a_proj_with_mqa.weight")?;
    let bias = ctx.optional_bias("self_attn.kv_a_proj_with_mqa.bias")?;
    let kv_a = b.linear(x, &w, bias.as_deref())?;
    sink.emit(
        l,
        &ctx.name("self_attn.kv_a_proj_with_mqa"),
        OpKind::Linear,
        &kv_a,
        &[x],
        &[&w],
    )?;
    let c_kv_raw = b.slice_groups(&kv_a, 1, 0, dims.latent)?;
    let k_pe_raw = b.slice_groups(&kv_a, 1, dims.latent, dims.rope)?;
    let w = ctx.weight("self_attn.kv_a_layernorm.weight")?;
    let c_kv = b.rms_norm(&c_kv_raw, &w, layout.lora_norm_eps)?;
    sink.emit(
        l,
        &ctx.name("self_attn.kv_a_layernorm"),
        OpKind::RmsNorm,
        &c_kv,
        &[&kv_a],
        &[&w],
    )?;

    let q_nope = b.slice_groups(&q, dims.heads, 0, dims.nope)?;
    let q_pe_raw = b.slice_groups(&q, dims.heads, dims.nope, dims.rope)?;
    let interleaved = layout.rope.interleaved;
    let q_pe = b.rope(&q_pe_raw, dims.heads, ctx.rope, ctx.positions, interleaved)?;
    sink.emit(
        l,
        &ctx.name("self_attn.q_rope"),
        OpKind::Rope,
        &q_pe,
        &[&q],
        &[],
    )?;
    let k_pe = b.rope(&k_pe_raw, 1, ctx.rope, ctx.positions, interleaved)?;
    sink.emit(
        l,
        &ctx.name("self_attn.k_rope"),
        OpKind::Rope,
        &k_pe,
        &[&kv_a],
        &[],
    )?;

    // The latent cache gets c_kv | k_pe of every new token.
    let written = b.concat_groups(&c_kv, &k_pe, 1)?;
    for t in 0..n {
        cache.latent.push(written.row(t))?;
    }
    let cache_ref = cache_ref_of(cache);
    sink.emit_as(
        l,
        &ctx.name("self_attn.latent_cache"),
        OpKind::CacheWrite,
        &written.reshaped(&[n, dims.latent + dims.rope]),
        cache_ref,
        vec![BufferRef::of(&c_kv), BufferRef::of(&k_pe)],
    )?;

    let selection = dsa_selection(ctx, x, q_resid.as_ref(), cache, shared_selection, sink)?;
    let mask = AttnMask {
        positions: ctx.positions.to_vec(),
        selected: selection,
    };
    let scale = layout.softmax_scale() as f32;
    let kv_b = ctx.weight("self_attn.kv_b_proj.weight")?;

    let attn = match path {
        MlaPath::Naive => {
            let start = ctx.positions[0];
            let latent_ref = cache_ref_of(cache);
            let expanded = cache.expanded.get_or_insert_with(|| {
                ExpandedCache::new(dims.heads * (dims.nope + dims.rope), dims.heads * dims.v)
            });
            // Tokens cached by an absorbed step are decompressed now (a path switch mid-run).
            if expanded.len() < start {
                let missing: Vec<usize> = (expanded.len()..start).collect();
                let rows: Vec<f32> = missing
                    .iter()
                    .flat_map(|&t| cache.latent.row(t).to_vec())
                    .collect();
                let old = Tensor::from_vec(&[missing.len(), dims.latent + dims.rope], rows);
                let old_c = b.slice_groups(&old, 1, 0, dims.latent)?;
                let old_pe = b.slice_groups(&old, 1, dims.latent, dims.rope)?;
                let kv = b.linear(&old_c, &kv_b, None)?;
                let reads = vec![latent_ref, BufferRef::weight(&kv_b)];
                sink.emit_as(
                    l,
                    &ctx.name("self_attn.expand_cache"),
                    OpKind::Decompress,
                    &kv,
                    BufferRef::of(&kv),
                    reads,
                )?;
                let reads = vec![BufferRef::of(&kv), latent_ref];
                append_expanded(
                    ctx,
                    expanded,
                    &kv,
                    &old_pe,
                    "self_attn.kv_cache_backfill",
                    reads,
                    sink,
                )?;
            }
            let kv = b.linear(&c_kv, &kv_b, None)?;
            sink.emit(
                l,
                &ctx.name("self_attn.kv_b_proj"),
                OpKind::Decompress,
                &kv,
                &[&c_kv],
                &[&kv_b],
            )?;
            let reads = vec![BufferRef::of(&kv), BufferRef::of(&k_pe)];
            append_expanded(ctx, expanded, &kv, &k_pe, "self_attn.kv_cache", reads, sink)?;
            let q_full = b.concat_groups(&q_nope, &q_pe, dims.heads)?;
            let (out, probs) =
                b.attention_naive(&q_full, &expanded.k, &expanded.v, dims, &mask, scale)?;
            let reads = vec![
                BufferRef::of(&q),
                BufferRef::of(&q_pe),
                BufferRef::cache(expanded.id(), expanded.address(), expanded.bytes()),
            ];
            report_attention(
                ctx,
                sink,
                &probs,
                "attn_output",
                OpKind::Attention,
                &out,
                reads,
            )?;
            out
        }
        MlaPath::Absorbed => {
            let q_lat = b.absorb_query(&q_nope, &kv_b, dims)?;
            sink.emit(
                l,
                &ctx.name("self_attn.q_absorbed"),
                OpKind::AbsorbQuery,
                &q_lat,
                &[&q],
                &[&kv_b],
            )?;
            let (o_lat, probs) =
                b.attention_latent(&q_lat, &q_pe, &cache.latent, dims, &mask, scale)?;
            let reads = vec![
                BufferRef::of(&q_lat),
                BufferRef::of(&q_pe),
                cache_ref_of(cache),
            ];
            report_attention(
                ctx,
                sink,
                &probs,
                "attn_latent",
                OpKind::AttentionLatent,
                &o_lat,
                reads,
            )?;
            let out = b.apply_w_uv(&o_lat, &kv_b, dims)?;
            sink.emit(
                l,
                &ctx.name("self_attn.attn_output"),
                OpKind::Attention,
                &out,
                &[&o_lat],
                &[&kv_b],
            )?;
            out
        }
    };

    let w = ctx.weight("self_attn.o_proj.weight")?;
    let bias = ctx.optional_bias("self_attn.o_proj.bias")?;
    let out = b.linear(&attn, &w, bias.as_deref())?;
    sink.emit(
        l,
        &ctx.name("self_attn.o_proj"),
        OpKind::Linear,
        &out,
        &[&attn],
        &[&w],
    )?;
    Ok(out)
}

fn cache_ref_of(cache: &LayerCache) -> BufferRef {
    BufferRef::cache(
        cache.latent.id(),
        cache.latent.address(),
        cache.latent.bytes(),
    )
}

/// Reports an attention kernel's two results, the probabilities and its output, both reading
/// `reads`.
fn report_attention(
    ctx: &LayerCtx,
    sink: &mut Sink,
    probs: &Tensor,
    output_op: &str,
    output_kind: OpKind,
    output: &Tensor,
    reads: Vec<BufferRef>,
) -> Result<()> {
    let l = Some(ctx.layer);
    let probs_ref = BufferRef::of(probs);
    sink.emit_as(
        l,
        &ctx.name("self_attn.attn_probs"),
        OpKind::AttentionProbs,
        probs,
        probs_ref,
        reads.clone(),
    )?;
    let name = ctx.name(&format!("self_attn.{output_op}"));
    sink.emit_as(l, &name, output_kind, output, BufferRef::of(output), reads)
}

/// Appends decompressed tokens to the expanded cache: kv [n, heads·(P+V)] from kv_b_proj and
/// their roped k_pe [n, R] become per-head K (k_nope | k_pe) and V rows. Reported as a cache
/// write of the rows K | V.
fn append_expanded(
    ctx: &LayerCtx,
    expanded: &mut ExpandedCache,
    kv: &Tensor,
    k_pe: &Tensor,
    op: &str,
    reads: Vec<BufferRef>,
    sink: &mut Sink,
) -> Result<()> {
    let b = ctx.backend;
    let (k_rows, v_rows) = b.assemble_kv(kv, k_pe, ctx.dims())?;
    push_rows(&mut expanded.k, &k_rows)?;
    push_rows(&mut expanded.v, &v_rows)?;
    let written = b.concat_groups(&k_rows, &v_rows, 1)?;
    let written = written.reshaped(&[k_rows.rows(), k_rows.cols() + v_rows.cols()]);
    let buffer = BufferRef::cache(expanded.id(), expanded.address(), expanded.bytes());
    sink.emit_as(
        Some(ctx.layer),
        &ctx.name(op),
        OpKind::CacheWrite,
        &written,
        buffer,
        reads,
    )
}

fn push_rows(cache: &mut RowCache, rows: &Tensor) -> Result<()> {
    for t in 0..rows.rows() {
        cache.push(rows.row(t))?;
    }
    Ok(())
}

/// The DSA indexer (GLM-5): q = wq_b(q_resid) [n, H, D]; k = LayerNorm(wk(x)) [n, D]; RoPE on the
/// first qk_rope dims of both; w = weights_proj(x)·H^-0.5; score[t, j] = Σ_h w[t,h]·ReLU(q[t,h]·k[j]
/// ·D^-0.5) over causal j; keep the top index_topk keys per query.
fn dsa_selection(
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
    let q_resid = q_resid.expect("layout validation requires q_lora_rank with an indexer");
    let (b, l) = (ctx.backend, Some(ctx.layer));
    let w = ctx.weight("self_attn.indexer.wq_b.weight")?;
    let q_proj = b.linear(q_resid, &w, None)?;
    sink.emit(
        l,
        &ctx.name("self_attn.indexer.wq_b"),
        OpKind::Linear,
        &q_proj,
        &[q_resid],
        &[&w],
    )?;
    let w = ctx.weight("self_attn.indexer.wk.weight")?;
    let k_proj = b.linear(x, &w, None)?;
    sink.emit(
        l,
        &ctx.name("self_attn.indexer.wk"),
        OpKind::Linear,
        &k_proj,
        &[x],
        &[&w],
    )?;
    let (nw, nb) = (
        ctx.weight("self_attn.indexer.k_norm.weight")?,
        ctx.weight("self_attn.indexer.k_norm.bias")?,
    );
    let k_normed = b.layer_norm(&k_proj, &nw, &nb, 1e-6)?;
    sink.emit(
        l,
        &ctx.name("self_attn.indexer.k_norm"),
        OpKind::LayerNorm,
        &k_normed,
        &[&k_proj],
        &[&nw, &nb],
    )?;
    let q = b.rope(
        &q_proj,
        ix.n_heads,
        ctx.rope,
        ctx.positions,
        ix.rope_interleaved,
    )?;
    sink.emit(
        l,
        &ctx.name("self_attn.indexer.q_rope"),
        OpKind::Rope,
        &q,
        &[&q_proj],
        &[],
    )?;
    let k = b.rope(&k_normed, 1, ctx.rope, ctx.positions, ix.rope_interleaved)?;
    sink.emit(
        l,
        &ctx.name("self_attn.indexer.k_rope"),
        OpKind::Rope,
        &k,
        &[&k_normed],
        &[],
    )?;
    let keys = cache
        .index_keys
        .get_or_insert_with(|| RowCache::new(ix.head_dim));
    push_rows(keys, &k)?;
    let buffer = BufferRef::cache(keys.id(), keys.address(), keys.bytes());
    sink.emit_as(
        l,
        &ctx.name("self_attn.indexer.key_cache"),
        OpKind::CacheWrite,
        &k,
        buffer,
        vec![BufferRef::of(&k)],
    )?;
    let w = ctx.weight("self_attn.indexer.weights_proj.weight")?;
    let head_weights = b.linear(x, &w, None)?;
    sink.emit(
        l,
        &ctx.name("self_attn.indexer.weights_proj"),
        OpKind::Linear,
        &head_weights,
        &[x],
        &[&w],
    )?;
    let scaled_weights = b.scale(&head_weights, (ix.n_heads as f32).powf(-0.5))?;
    let scores = b.index_scores(
        &q,
        &scaled_weights,
        keys,
        ctx.positions,
        (ix.head_dim as f32).powf(-0.5),
    )?;
    let reads = vec![
        BufferRef::of(&q),
        BufferRef::of(&head_weights),
        BufferRef::cache(keys.id(), keys.address(), keys.bytes()),
    ];
    sink.emit_as(
        l,
        &ctx.name("self_attn.indexer.scores"),
        OpKind::IndexScores,
        &scores,
        BufferRef::of(&scores),
        reads,
    )?;

    // Top-k among each query's causal keys; a query with no more than topk of them keeps all.
    let context = keys.len();
    let k_keep = ix.topk.min(context);
    let mut kept: Vec<Vec<usize>> = Vec::with_capacity(ctx.positions.len());
    let mut sparse = false;
    let mut listing = Vec::with_capacity(ctx.positions.len() * k_keep);
    for (i, &p) in ctx.positions.iter().enumerate() {
        let row = &scores.row(i)[..=p];
        let mut chosen = if row.len() > ix.topk {
            sparse = true;
            top_k_indices(row, ix.topk)
        } else {
            (0..row.len()).collect()
        };
        chosen.sort_unstable();
        listing.extend(chosen.iter().map(|&j| j as f32));
        listing.extend(std::iter::repeat_n(-1.0, k_keep - chosen.len()));
        kept.push(chosen);
    }
    let topk = Tensor::from_index_values(&[ctx.positions.len(), k_keep], listing);
    sink.emit(
        l,
        &ctx.name("self_attn.indexer.topk"),
        OpKind::IndexTopK,
        &topk,
        &[&scores],
        &[],
    )?;
    let selection = if sparse { Some(kept) } else { None };
    *shared_selection = Some(selection.clone());
    Ok(selection)
}
