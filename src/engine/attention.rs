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
//! The attention kernel is called the way production backends call theirs: the wrapper here
//! allocates the output buffer and hands it to the kernel, and the trace records both the buffer
//! the kernel wrote and the one the wrapper returned. Several faults of [`super::faults`] are
//! planted in this file, each where its real counterpart lives.

use super::cache::{ExpandedCache, LayerCache, RowCache, RowSource};
use super::faults::{Fault, Faults, KernelFaults};
use super::forcing::ForcedSelections;
use super::forward::MlaPath;
use super::rope::RopeTable;
use super::sink::{Computed, Reads, Sink};
use super::trace::{BufferRef, OpKind, Phase};
use crate::backend::{AttnMask, Backend, KvbSplit, MlaDims};
use crate::error::{Error, Result};
use crate::model::catalog::layer_prefix;
use crate::model::layout::{IndexerMode, Layout};
use crate::model::quant::{QuantFaults, QuantTensor};
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
    let bias =
        |r: &mut super::sink::Reads, suffix: &str| -> Result<Option<std::sync::Arc<Tensor>>> {
            if layout.attention_bias {
                r.weight(&ctx.name(suffix)).map(Some)
            } else {
                Ok(None)
            }
        };

    // Query: low-rank (q_a → norm → q_b) or a plain q_proj.
    let (q, q_resid) = match layout.q_lora_rank {
        Some(_) => {
            let q_a = sink.op(
                l,
                &ctx.name("self_attn.q_a_proj"),
                OpKind::Linear,
                &[x],
                |r| {
                    let w = r.weight(&ctx.name("self_attn.q_a_proj.weight"))?;
                    b.linear(x, &w, bias(r, "self_attn.q_a_proj.bias")?.as_deref())
                },
            )?;
            let q_resid = sink.op(
                l,
                &ctx.name("self_attn.q_a_layernorm"),
                OpKind::RmsNorm,
                &[&q_a],
                |r| {
                    let w = r.weight(&ctx.name("self_attn.q_a_layernorm.weight"))?;
                    b.rms_norm(&q_a, &w, layout.lora_norm_eps)
                },
            )?;
            let q = sink.op(
                l,
                &ctx.name("self_attn.q_b_proj"),
                OpKind::Linear,
                &[&q_resid],
                |r| {
                    let w = r.weight(&ctx.name("self_attn.q_b_proj.weight"))?;
                    b.linear(&q_resid, &w, None)
                },
            )?;
            (q, Some(q_resid))
        }
        None => {
            let q = sink.op(
                l,
                &ctx.name("self_attn.q_proj"),
                OpKind::Linear,
                &[x],
                |r| {
                    let w = r.weight(&ctx.name("self_attn.q_proj.weight"))?;
                    b.linear(x, &w, None)
                },
            )?;
            (q, None)
        }
    };

    // Compressed KV: c_kv (normalised) and the shared rope key.
    let kv_a = sink.op(
        l,
        &ctx.name("self_attn.kv_a_proj_with_mqa"),
        OpKind::Linear,
        &[x],
        |r| {
            let w = r.weight(&ctx.name("self_attn.kv_a_proj_with_mqa.weight"))?;
            b.linear(
                x,
                &w,
                bias(r, "self_attn.kv_a_proj_with_mqa.bias")?.as_deref(),
            )
        },
    )?;
    let c_kv = sink.op(
        l,
        &ctx.name("self_attn.kv_a_layernorm"),
        OpKind::RmsNorm,
        &[&kv_a],
        |r| {
            let w = r.weight(&ctx.name("self_attn.kv_a_layernorm.weight"))?;
            b.rms_norm(
                &b.slice_groups(&kv_a, 1, 0, dims.latent)?,
                &w,
                layout.lora_norm_eps,
            )
        },
    )?;

    // RoPE on q_pe and k_pe. FAULT rope-noninterleaved: the query side uses the other layout.
    let interleaved = layout.rope.interleaved;
    let q_interleaved = interleaved ^ ctx.fault(Fault::RopeNoninterleaved);
    let q_pe = sink.op(
        l,
        &ctx.name("self_attn.q_rope"),
        OpKind::Rope,
        &[&q],
        |_| {
            let q_pe = b.slice_groups(&q, dims.heads, dims.nope, dims.rope)?;
            b.rope(&q_pe, dims.heads, ctx.rope, ctx.positions, q_interleaved)
        },
    )?;
    let k_pe = sink.op(
        l,
        &ctx.name("self_attn.k_rope"),
        OpKind::Rope,
        &[&kv_a],
        |_| {
            let k_pe = b.slice_groups(&kv_a, 1, dims.latent, dims.rope)?;
            b.rope(&k_pe, 1, ctx.rope, ctx.positions, interleaved)
        },
    )?;
    let q_nope = b.slice_groups(&q, dims.heads, 0, dims.nope)?;

    // The latent cache gets c_kv | k_pe of every new token. FAULT kv-cache-off-by-one: decode
    // maps each token to the slot before its own.
    let written = b.concat_groups(&c_kv, &k_pe, 1)?;
    let written = written.reshaped(&[n, dims.latent + dims.rope]);
    for (t, &pos) in ctx.positions.iter().enumerate() {
        let slot = if ctx.fault(Fault::KvCacheOffByOne) {
            pos.saturating_sub(1)
        } else {
            pos
        };
        cache.latent.push_at(written.row(t), slot)?;
    }
    let reads = vec![BufferRef::of(&c_kv), BufferRef::of(&k_pe)];
    sink.report(
        l,
        &ctx.name("self_attn.latent_cache"),
        OpKind::CacheWrite,
        &written,
        latent_ref(cache),
        reads,
    )?;

    let selection = dsa_selection(ctx, x, q_resid.as_ref(), cache, shared_selection, sink)?;
    let mask = AttnMask {
        positions: ctx.positions.to_vec(),
        selected: selection,
    };
    let kv_b_name = ctx.name("self_attn.kv_b_proj.weight");
    let kv_b = kv_b_as_used(ctx, cache, sink, path)?;
    let kernel_faults = KernelFaults {
        lse_base_mismatch: ctx.fault(Fault::LseBaseMismatch),
        skip_padded_rows: ctx.mla_backend && ctx.fault(Fault::SkipPaddedRows),
    };
    // FAULT output-buffer-disconnect: the wrapper hands the kernel a phantom buffer.
    let disconnect = ctx.mla_backend && ctx.fault(Fault::OutputBufferDisconnect);

    let attn = match path {
        MlaPath::Naive => {
            let scale = layout.softmax_scale() as f32;
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
                        let tensor = kv_b.linear(r, &kv_b_name, b, &c_old)?;
                        Ok(Computed {
                            tensor,
                            kernel_wrote: None,
                            extra_reads: vec![latent],
                        })
                    },
                )?;
                let reads = vec![BufferRef::of(&kv), latent];
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
            let kv = sink.op(
                l,
                &ctx.name("self_attn.kv_b_proj"),
                OpKind::Decompress,
                &[&c_kv],
                |r| kv_b.linear(r, &kv_b_name, b, &c_kv),
            )?;
            let reads = vec![BufferRef::of(&kv), BufferRef::of(&k_pe)];
            append_expanded(ctx, expanded, &kv, &k_pe, "self_attn.kv_cache", reads, sink)?;
            let cache_read = BufferRef::cache(expanded.id(), expanded.address(), expanded.bytes());
            let expanded = &*expanded;
            let kernel = |out: &mut Tensor| {
                let q_full = b.concat_groups(&q_nope, &q_pe, dims.heads)?;
                b.attention_naive(
                    &q_full,
                    &expanded.k,
                    &expanded.v,
                    dims,
                    &mask,
                    scale,
                    out,
                    kernel_faults,
                )
            };
            let out_shape = [n, dims.heads * dims.v];
            run_attention(
                ctx,
                sink,
                &[&q, &q_pe],
                cache_read,
                "attn_output",
                OpKind::Attention,
                &out_shape,
                disconnect,
                kernel,
            )?
        }
        MlaPath::Absorbed => {
            // FAULT softmax-scale-latent: the scale taken from the latent cache's width.
            let scale = if ctx.fault(Fault::SoftmaxScaleLatent) {
                layout.softmax_scale() * (layout.qk_head_dim() as f64).sqrt()
                    / (layout.latent_width() as f64).sqrt()
            } else {
                layout.softmax_scale()
            } as f32;
            let split = kv_b_split(ctx);
            let q_lat = sink.op(
                l,
                &ctx.name("self_attn.q_absorbed"),
                OpKind::AbsorbQuery,
                &[&q],
                |r| {
                    let w = kv_b.weight(r, &kv_b_name)?;
                    b.absorb_query(&q_nope, &w, dims, split)
                },
            )?;
            let cache_read = latent_ref(cache);
            let latent = &cache.latent;
            let kernel = |out: &mut Tensor| {
                b.attention_latent(
                    &q_lat,
                    &q_pe,
                    latent,
                    dims,
                    &mask,
                    scale,
                    out,
                    kernel_faults,
                )
            };
            let out_shape = [n, dims.heads, dims.latent];
            let o_lat = run_attention(
                ctx,
                sink,
                &[&q_lat, &q_pe],
                cache_read,
                "attn_latent",
                OpKind::AttentionLatent,
                &out_shape,
                disconnect,
                kernel,
            )?;
            sink.op(
                l,
                &ctx.name("self_attn.attn_output"),
                OpKind::Attention,
                &[&o_lat],
                |r| {
                    let w = kv_b.weight(r, &kv_b_name)?;
                    b.apply_w_uv(&o_lat, &w, dims, split)
                },
            )?
        }
    };

    sink.op(
        l,
        &ctx.name("self_attn.o_proj"),
        OpKind::Linear,
        &[&attn],
        |r| {
            let w = r.weight(&ctx.name("self_attn.o_proj.weight"))?;
            b.linear(&attn, &w, bias(r, "self_attn.o_proj.bias")?.as_deref())
        },
    )
}

/// kv_b_proj as the run uses it.
enum KvB {
    /// Plain weights: read from the weight store.
    Store,
    /// Quantized blocks, multiplied with directly (dequantized block by block).
    Quant(Arc<QuantTensor>, QuantFaults),
    /// A quantized kv_b_proj made plain once per run.
    Plain(Arc<Tensor>),
}

impl KvB {
    /// x·kv_bᵀ: decompresses latent rows into per-head keys and values.
    fn linear(&self, r: &mut Reads, name: &str, b: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        match self {
            KvB::Store => b.linear(x, &*r.weight(name)?, None),
            KvB::Quant(q, faults) => b.linear_quant(x, q, *faults),
            KvB::Plain(w) => b.linear(x, w, None),
        }
    }

    /// The plain weight, for the absorbed path's W_UK and W_UV.
    fn weight(&self, r: &mut Reads, name: &str) -> Result<Arc<Tensor>> {
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
fn kv_b_as_used(
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
fn kv_b_split(ctx: &LayerCtx) -> KvbSplit {
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

/// The attention wrapper: allocates the output buffer, hands it to the kernel and returns it,
/// reporting the kernel's two results (probabilities, then `output_op`). Under the disconnect
/// fault the kernel is handed a phantom buffer instead and the returned one stays unwritten.
#[allow(clippy::too_many_arguments)]
fn run_attention(
    ctx: &LayerCtx,
    sink: &mut Sink,
    inputs: &[&Tensor],
    cache_read: BufferRef,
    output_op: &str,
    output_kind: OpKind,
    out_shape: &[usize],
    disconnect: bool,
    kernel: impl Fn(&mut Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let b = ctx.backend;
    let l = Some(ctx.layer);
    let call = || -> Result<(Tensor, Tensor, BufferRef)> {
        let mut out = b.alloc(out_shape, ctx.poison)?;
        if disconnect {
            let mut phantom = b.alloc(out_shape, ctx.poison)?;
            let probs = kernel(&mut phantom)?;
            let wrote = BufferRef::of(&phantom);
            return Ok((probs, out, wrote));
        }
        let probs = kernel(&mut out)?;
        let wrote = BufferRef::of(&out);
        Ok((probs, out, wrote))
    };
    // One kernel call yields both events; the second takes its result from the first.
    let mut pending: Option<(Tensor, BufferRef)> = None;
    sink.op_with(
        l,
        &ctx.name("self_attn.attn_probs"),
        OpKind::AttentionProbs,
        inputs,
        |_| {
            let (probs, out, wrote) = call()?;
            pending = Some((out, wrote));
            Ok(Computed {
                tensor: probs,
                kernel_wrote: None,
                extra_reads: vec![cache_read],
            })
        },
    )?;
    let name = ctx.name(&format!("self_attn.{output_op}"));
    sink.op_with(l, &name, output_kind, inputs, |_| {
        let (out, wrote) = match pending.take() {
            Some(p) => p,
            None => call().map(|(_, out, wrote)| (out, wrote))?,
        };
        Ok(Computed {
            tensor: out,
            kernel_wrote: Some(wrote),
            extra_reads: vec![cache_read],
        })
    })
}

fn latent_ref(cache: &LayerCache) -> BufferRef {
    BufferRef::cache(
        cache.latent.id(),
        cache.latent.address(),
        cache.latent.bytes(),
    )
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
    sink.report(
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
    let q = sink.op(
        l,
        &ctx.name("self_attn.indexer.q_rope"),
        OpKind::Rope,
        &[&q_proj],
        |_| {
            b.rope(
                &q_proj,
                ix.n_heads,
                ctx.rope,
                ctx.positions,
                ix.rope_interleaved,
            )
        },
    )?;
    let k = sink.op(
        l,
        &ctx.name("self_attn.indexer.k_rope"),
        OpKind::Rope,
        &[&k_normed],
        |_| b.rope(&k_normed, 1, ctx.rope, ctx.positions, ix.rope_interleaved),
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
            })
        },
    )?;

    // Top-k among each query's causal keys; a query with no more than topk of them keeps all.
    let context = keys.len();
    let k_keep = ix.topk.min(context);
    let mut kept = b.index_topk(&scores, ctx.positions, ix.topk)?;
    let topk_name = ctx.name("self_attn.indexer.topk");
    ctx.forced.apply(ctx.phase, &topk_name, &mut kept, |row| {
        ctx.positions[row] + 1
    })?;
    for chosen in &mut kept {
        chosen.sort_unstable();
    }
    let sparse = ctx.positions.iter().any(|&p| p + 1 > ix.topk);
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
