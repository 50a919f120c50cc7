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
//!
//! The attention kernel is called the way production backends call theirs: the wrapper
//! ([`wrapper`]) allocates the output buffer and hands it to the kernel, and the trace records
//! both the buffer the kernel wrote and the one the wrapper returned. Several faults of
//! [`super::faults`] are planted in this file and its modules, each where its real counterpart
//! lives.

mod cache_writes;
mod indexer;
mod kv_b;
mod wrapper;

use cache_writes::{append_expanded, latent_ref, push_rows, write_latent};
use indexer::dsa_selection;
use kv_b::{kv_b_as_used, kv_b_split, KvB};
use wrapper::{run_attention, KernelOutput};

use super::cache::{ExpandedCache, LayerCache, RowSource};
use super::faults::{Fault, Faults, KernelFaults};
use super::forcing::ForcedSelections;
use super::forward::MlaPath;
use super::rope::RopeTable;
use super::sink::{Computed, Sink};
use super::trace::{BufferRef, OpKind, Phase};
use crate::backend::{AttnMask, AttnParams, Backend, MlaDims};
use crate::error::Result;
use crate::model::catalog::layer_prefix;
use crate::model::layout::Layout;
use crate::model::WeightStore;
use crate::ops::{AttnKernels, KvCacheDtype};
use crate::tensor::Tensor;

/// What one layer's ops need to see.
pub struct LayerCtx<'a> {
    pub layout: &'a Layout,
    pub weights: &'a WeightStore,
    pub backend: &'a dyn Backend,
    pub rope: &'a RopeTable,
    pub layer: usize,
    pub phase: Phase,
    /// Absolute positions of the tokens of this chunk.
    pub positions: &'a [usize],
    pub faults: Faults,
    /// The MLA attention backend serves this run (false under --mla-disable).
    pub mla_backend: bool,
    /// Hand kernels poisoned output buffers, so unwritten elements show.
    pub poison: bool,
    /// Decode a quantized kv_b_proj once instead of using it quantized.
    pub force_dequant: bool,
    /// Choices imposed instead of computed (teacher forcing).
    pub forced: &'a ForcedSelections,
    /// The attention kernels a device backend runs.
    pub kernels: AttnKernels,
    /// How the latent cache stores its rows.
    pub kv_cache: KvCacheDtype,
    /// An op for each chosen routed expert before their sum.
    pub expert_ops: bool,
    /// The tensor-parallel rank running the layer.
    pub tp: super::tp::TpRank<'a>,
}

impl LayerCtx<'_> {
    /// Full name of a tensor or op of this layer.
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

    pub fn fault(&self, fault: Fault) -> bool {
        self.faults.active(fault, self.phase)
    }

    /// The linear op `op` of this layer: `x` times the weight `op.weight`, plus `op.bias` where
    /// `biased` and the layout has attention biases. The weight is named after the op, so the
    /// two names cannot drift apart.
    pub fn linear(&self, sink: &mut Sink, op: &str, x: &Tensor, biased: bool) -> Result<Tensor> {
        let name = self.name(op);
        sink.op(Some(self.layer), &name, OpKind::Linear, &[x], |r| {
            let w = r.weight(&format!("{name}.weight"))?;
            let bias = if biased && self.layout.attention_bias {
                Some(r.weight(&format!("{name}.bias"))?)
            } else {
                None
            };
            self.backend.linear(x, &w, bias.as_deref())
        })
    }

    /// The RMSNorm op `op` of this layer over `input`, or over its first `width` columns, with
    /// the weight `op.weight`.
    pub fn rms_norm(
        &self,
        sink: &mut Sink,
        op: &str,
        input: &Tensor,
        width: Option<usize>,
    ) -> Result<Tensor> {
        let (b, name) = (self.backend, self.name(op));
        sink.op(Some(self.layer), &name, OpKind::RmsNorm, &[input], |r| {
            let w = r.weight(&format!("{name}.weight"))?;
            let eps = self.layout.lora_norm_eps;
            match width {
                Some(width) => b.rms_norm(&b.slice_groups(input, 1, 0, width)?, &w, eps),
                None => b.rms_norm(input, &w, eps),
            }
        })
    }
}

/// The DSA selection of one chunk: per query, the kept key positions (sorted); `None` when every
/// query keeps all its causal keys.
pub type Selection = Option<Vec<Vec<usize>>>;

/// What attention reads of one chunk, as the query, compressed-KV and position steps made it.
struct Chunk {
    /// The query of every head, [n, heads·(P+R)], and its rope part after RoPE.
    q: Tensor,
    q_pe: Tensor,
    /// The normalised latent c_kv [n, L] and the shared rope key after RoPE [n, R].
    c_kv: Tensor,
    k_pe: Tensor,
    /// c_kv and k_pe are the rows as the latent cache holds them (an FP8 cache's round trip),
    /// read from the cache rather than from the ops that made them.
    cached: bool,
}

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
    let (q, q_resid) = query(ctx, x, sink)?;
    let (kv_a, c_kv) = compressed_kv(ctx, x, sink)?;
    let (q_pe, k_pe) = positions(ctx, &q, &kv_a, sink)?;
    let mut chunk = Chunk {
        q,
        q_pe,
        c_kv,
        k_pe,
        cached: false,
    };
    // With an FP8 cache every attention reads the rows as the cache holds them.
    if let Some((c_kv, k_pe)) = write_latent(ctx, &chunk, cache, sink)? {
        (chunk.c_kv, chunk.k_pe, chunk.cached) = (c_kv, k_pe, true);
    }
    let selection = dsa_selection(ctx, x, q_resid.as_ref(), cache, shared_selection, sink)?;
    let attn = attend(ctx, &chunk, selection, cache, path, sink)?;
    // Row-parallel: rank 0 alone adds the bias.
    let biased = ctx.tp.adds_row_parallel_bias();
    ctx.linear(sink, "self_attn.o_proj", &attn, biased)
}

/// The query: low-rank (q_a → norm → q_b) or a plain q_proj; with the normalised low-rank
/// residual, which the DSA indexer reads.
fn query(ctx: &LayerCtx, x: &Tensor, sink: &mut Sink) -> Result<(Tensor, Option<Tensor>)> {
    if ctx.layout.q_lora_rank.is_none() {
        return Ok((ctx.linear(sink, "self_attn.q_proj", x, false)?, None));
    }
    let q_a = ctx.linear(sink, "self_attn.q_a_proj", x, true)?;
    let q_resid = ctx.rms_norm(sink, "self_attn.q_a_layernorm", &q_a, None)?;
    let q = ctx.linear(sink, "self_attn.q_b_proj", &q_resid, false)?;
    Ok((q, Some(q_resid)))
}

/// Compressed KV: kv_a = [c_kv | k_pe] before normalisation, and c_kv normalised.
fn compressed_kv(ctx: &LayerCtx, x: &Tensor, sink: &mut Sink) -> Result<(Tensor, Tensor)> {
    let kv_a = ctx.linear(sink, "self_attn.kv_a_proj_with_mqa", x, true)?;
    let latent = ctx.dims().latent;
    let c_kv = ctx.rms_norm(sink, "self_attn.kv_a_layernorm", &kv_a, Some(latent))?;
    Ok((kv_a, c_kv))
}

/// RoPE on q_pe and k_pe. FAULT rope-noninterleaved: the query side uses the other layout.
fn positions(
    ctx: &LayerCtx,
    q: &Tensor,
    kv_a: &Tensor,
    sink: &mut Sink,
) -> Result<(Tensor, Tensor)> {
    let (b, l, dims) = (ctx.backend, Some(ctx.layer), ctx.dims());
    let interleaved = ctx.layout.rope.interleaved;
    let q_interleaved = interleaved ^ ctx.fault(Fault::RopeNoninterleaved);
    let q_pe = sink.op(l, &ctx.name("self_attn.q_rope"), OpKind::Rope, &[q], |_| {
        let q_pe = b.slice_groups(q, dims.heads, dims.nope, dims.rope)?;
        let q_pe = b.rope(&q_pe, dims.heads, ctx.rope, ctx.positions, q_interleaved)?;
        // [tokens, heads, rope] also for one head (a rank's share, under tensor parallelism).
        Ok(q_pe.reshaped(&[ctx.positions.len(), dims.heads, dims.rope]))
    })?;
    let k_pe = sink.op(
        l,
        &ctx.name("self_attn.k_rope"),
        OpKind::Rope,
        &[kv_a],
        |_| {
            let k_pe = b.slice_groups(kv_a, 1, dims.latent, dims.rope)?;
            b.rope(&k_pe, 1, ctx.rope, ctx.positions, interleaved)
        },
    )?;
    Ok((q_pe, k_pe))
}

/// The attention's softmax scale. FAULT yarn-mscale: YaRN's `mscale` taken for `mscale_all_dim`.
fn softmax_scale(ctx: &LayerCtx) -> f64 {
    ctx.layout.softmax_scale_from(ctx.fault(Fault::YarnMscale))
}

/// How this chunk's attention kernel is called: the mask, kv_b_proj as used, and the faults
/// planted in the kernel and its wrapper.
struct KernelCall {
    mask: AttnMask,
    kv_b: KvB,
    kv_b_name: String,
    faults: KernelFaults,
    /// FAULT output-buffer-disconnect: the wrapper hands the kernel a phantom buffer.
    disconnect: bool,
}

impl KernelCall {
    /// The kernel's own arguments for heads of `dims` at this softmax scale.
    fn params(&self, dims: MlaDims, scale: f32) -> AttnParams<'_> {
        AttnParams {
            dims,
            mask: &self.mask,
            scale,
            faults: self.faults,
        }
    }
}

/// Attention on the chosen path, up to the heads' output [n, heads·V] (before o_proj).
fn attend(
    ctx: &LayerCtx,
    chunk: &Chunk,
    selection: Selection,
    cache: &mut LayerCache,
    path: MlaPath,
    sink: &mut Sink,
) -> Result<Tensor> {
    let call = KernelCall {
        mask: AttnMask {
            positions: ctx.positions.to_vec(),
            selected: selection,
        },
        kv_b_name: ctx.name("self_attn.kv_b_proj.weight"),
        kv_b: kv_b_as_used(ctx, cache, sink, path)?,
        faults: KernelFaults {
            lse_base_mismatch: ctx.fault(Fault::LseBaseMismatch),
            skip_padded_rows: ctx.mla_backend && ctx.fault(Fault::SkipPaddedRows),
            exp2_scale: ctx.fault(Fault::Exp2Scale),
            kv_stride_mismatch: ctx.fault(Fault::KvStrideMismatch),
            page_index_overflow: ctx.fault(Fault::PageIndexOverflow),
        },
        disconnect: ctx.mla_backend && ctx.fault(Fault::OutputBufferDisconnect),
    };
    match path {
        MlaPath::Naive => attend_naive(ctx, chunk, &call, cache, sink),
        MlaPath::Absorbed => attend_absorbed(ctx, chunk, &call, cache, sink),
    }
}

/// Naive: decompress the new tokens (and any cached by absorbed steps) into per-head K/V and run
/// multi-head attention over the expanded cache.
fn attend_naive(
    ctx: &LayerCtx,
    chunk: &Chunk,
    call: &KernelCall,
    cache: &mut LayerCache,
    sink: &mut Sink,
) -> Result<Tensor> {
    let (b, l, dims) = (ctx.backend, Some(ctx.layer), ctx.dims());
    let (kv_b, kv_b_name) = (&call.kv_b, &call.kv_b_name);
    let scale = softmax_scale(ctx) as f32;
    let start = ctx.positions[0];
    let latent = latent_ref(cache);
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
        let old_pe = b.slice_groups(&old, 1, dims.latent, dims.rope)?;
        let kv = sink.op_with(
            l,
            &ctx.name("self_attn.expand_cache"),
            OpKind::Decompress,
            &[],
            |r| {
                let c_old = b.slice_groups(&old, 1, 0, dims.latent)?;
                let tensor = kv_b.linear(r, kv_b_name, b, &c_old)?;
                Ok(Computed {
                    tensor,
                    kernel_wrote: None,
                    extra_reads: vec![latent],
                    kernel: None,
                    stats: None,
                })
            },
        )?;
        let reads = vec![BufferRef::of(&kv), latent];
        let backfill = "self_attn.kv_cache_backfill";
        append_expanded(ctx, expanded, &kv, &old_pe, backfill, reads, sink)?;
    }
    let c_kv = &chunk.c_kv;
    // Rows of an FP8 cache are read from the cache, not from the ops that made them.
    let (inputs, cache_reads) = if chunk.cached {
        (&[][..], vec![latent])
    } else {
        (&[c_kv][..], Vec::new())
    };
    let kv = sink.op_with(
        l,
        &ctx.name("self_attn.kv_b_proj"),
        OpKind::Decompress,
        inputs,
        |r| {
            Ok(Computed {
                tensor: kv_b.linear(r, kv_b_name, b, c_kv)?,
                kernel_wrote: None,
                extra_reads: cache_reads,
                kernel: None,
                stats: None,
            })
        },
    )?;
    let k_pe_read = match chunk.cached {
        true => latent,
        false => BufferRef::of(&chunk.k_pe),
    };
    let reads = vec![BufferRef::of(&kv), k_pe_read];
    append_expanded(
        ctx,
        expanded,
        &kv,
        &chunk.k_pe,
        "self_attn.kv_cache",
        reads,
        sink,
    )?;
    let cache_read = BufferRef::cache(expanded.id(), expanded.address(), expanded.bytes());
    let expanded = &*expanded;
    let q_nope = b.slice_groups(&chunk.q, dims.heads, 0, dims.nope)?;
    let kernel = |out: &mut Tensor| {
        let q_full = b.concat_groups(&q_nope, &chunk.q_pe, dims.heads)?;
        let (k, v) = (&expanded.k, &expanded.v);
        let params = call.params(dims, scale);
        let fast =
            |out: &mut Tensor| b.fast_attention_naive(&q_full, k, v, params, out, ctx.kernels);
        let reference = |out: &mut Tensor| b.attention_naive(&q_full, k, v, params, out);
        KernelOutput::run(ctx, out, fast, reference)
    };
    let out_shape = [ctx.positions.len(), dims.heads * dims.v];
    let output = ("attn_output", OpKind::Attention);
    let inputs = [&chunk.q, &chunk.q_pe];
    run_attention(
        ctx,
        sink,
        &inputs,
        cache_read,
        output,
        &out_shape,
        call.disconnect,
        kernel,
    )
}

/// Absorbed: fold W_UK into the query, attend over the latent cache, then apply W_UV.
fn attend_absorbed(
    ctx: &LayerCtx,
    chunk: &Chunk,
    call: &KernelCall,
    cache: &LayerCache,
    sink: &mut Sink,
) -> Result<Tensor> {
    let (b, l, dims, layout) = (ctx.backend, Some(ctx.layer), ctx.dims(), ctx.layout);
    let (kv_b, kv_b_name) = (&call.kv_b, &call.kv_b_name);
    // FAULT softmax-scale-latent: the scale taken from the latent cache's width.
    let scale = if ctx.fault(Fault::SoftmaxScaleLatent) {
        softmax_scale(ctx) * (layout.qk_head_dim() as f64).sqrt()
            / (layout.latent_width() as f64).sqrt()
    } else {
        softmax_scale(ctx)
    } as f32;
    let split = kv_b_split(ctx);
    let q_nope = b.slice_groups(&chunk.q, dims.heads, 0, dims.nope)?;
    let q_lat = sink.op(
        l,
        &ctx.name("self_attn.q_absorbed"),
        OpKind::AbsorbQuery,
        &[&chunk.q],
        |r| {
            let w = kv_b::w_uk_source(ctx, kv_b, r, kv_b_name)?;
            b.absorb_query(&q_nope, &w, dims, split)
        },
    )?;
    let latent = &cache.latent;
    let kernel = |out: &mut Tensor| {
        let (q_pe, params) = (&chunk.q_pe, call.params(dims, scale));
        let fast = |out: &mut Tensor| {
            b.fast_attention_latent(&q_lat, q_pe, latent, params, out, ctx.kernels)
        };
        let reference = |out: &mut Tensor| b.attention_latent(&q_lat, q_pe, latent, params, out);
        KernelOutput::run(ctx, out, fast, reference)
    };
    let out_shape = [ctx.positions.len(), dims.heads, dims.latent];
    let output = ("attn_latent", OpKind::AttentionLatent);
    let inputs = [&q_lat, &chunk.q_pe];
    let cache_read = latent_ref(cache);
    let o_lat = run_attention(
        ctx,
        sink,
        &inputs,
        cache_read,
        output,
        &out_shape,
        call.disconnect,
        kernel,
    )?;
    sink.op(
        l,
        &ctx.name("self_attn.attn_output"),
        OpKind::Attention,
        &[&o_lat],
        |r| {
            let w = kv_b.weight(r, kv_b_name)?;
            b.apply_w_uv(&o_lat, &w, dims, split)
        },
    )
}
