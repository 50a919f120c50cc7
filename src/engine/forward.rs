//! The forward pass driver: embedding, the decoder layers in order, final norm and lm_head, for
//! a prefill chunk or one decode token, against per-layer caches that persist between calls.

use super::attention::{attention_block, LayerCtx, Selection};
use super::cache::LayerCache;
use super::faults::Faults;
use super::forcing::ForcedSelections;
use super::mlp;
use super::rope::RopeTable;
use super::sink::Sink;
use super::sink::{OpCounts, StorageDtype};
use super::tp::{all_gather, all_reduce, PassRanks, RankState, TpRank};
use super::trace::{Observer, OpKind, Phase, Replay};
use crate::backend::{Backend, RankBackends};
use crate::error::{Error, Result};
use crate::model::catalog::{layer_prefix, lm_head_name};
use crate::model::layout::MlpKind;
use crate::model::{shard, Model, WeightStore};
use crate::ops::{AttnKernels, KvCacheDtype};
use crate::tensor::Tensor;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// How attention is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MlaPath {
    /// Decompress the latent cache into per-head K/V, then multi-head attention.
    Naive,
    /// Fold W_UK into the query and attend over the latent cache; apply W_UV after.
    Absorbed,
}

/// The README's word for the path (`naive`, `absorbed`), as headers and logs show it.
impl std::fmt::Display for MlaPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            MlaPath::Naive => "naive",
            MlaPath::Absorbed => "absorbed",
        })
    }
}

/// The path of each phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MlaPaths {
    pub prefill: MlaPath,
    pub decode: MlaPath,
}

/// `prefill naive · decode absorbed`: the words the header, `check` and the README use.
impl std::fmt::Display for MlaPaths {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "prefill {} · decode {}", self.prefill, self.decode)
    }
}

impl MlaPaths {
    /// What production MLA backends do: naive prefill, absorbed decode.
    pub fn production() -> MlaPaths {
        MlaPaths {
            prefill: MlaPath::Naive,
            decode: MlaPath::Absorbed,
        }
    }

    /// MLA disabled (`VLLM_MLA_DISABLE=1`): naive everywhere.
    pub fn disabled() -> MlaPaths {
        MlaPaths {
            prefill: MlaPath::Naive,
            decode: MlaPath::Naive,
        }
    }
}

#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub paths: MlaPaths,
    /// The decoder layers to run; the embedding feeds the first of them directly.
    pub layers: Range<usize>,
    /// MLA disabled: attention is served by the plain backend (paths are then both naive), so
    /// faults of the MLA backend do not act.
    pub mla_disabled: bool,
    pub faults: Faults,
    /// Hand kernels and caches poisoned buffers so that unwritten elements show (the debugger's
    /// buffer forensics); plain runs use zeroed ones.
    pub poison: bool,
    pub storage: StorageDtype,
    /// Decode a quantized kv_b_proj once into a plain weight instead of using it quantized.
    pub force_dequant: bool,
    /// Choices (MoE experts, DSA keys) imposed at given rows instead of computed: teacher
    /// forcing for comparisons (see [`super::forcing`]).
    pub forced: Arc<ForcedSelections>,
    /// The attention kernels a device backend runs (fast or reference, forced variants).
    pub kernels: AttnKernels,
    /// How the latent cache stores its rows: fp8_ds_mla stores each row as the format's round
    /// trip, so that every attention op reads what an FP8 cache holds.
    pub kv_cache: KvCacheDtype,
    /// An op for each chosen routed expert before their sum (see [`super::experts`]).
    pub expert_ops: bool,
    /// Tensor-parallel ranks, run one after another in this process (1: none).
    pub tp: usize,
}

impl EngineOptions {
    /// Every layer, the given paths, no faults, no poisoning, f32.
    pub fn new(model: &Model, paths: MlaPaths) -> EngineOptions {
        EngineOptions {
            paths,
            layers: 0..model.layout.num_layers,
            mla_disabled: false,
            faults: Faults::none(),
            poison: false,
            storage: StorageDtype::F32,
            force_dequant: false,
            forced: Arc::default(),
            kernels: AttnKernels::default(),
            kv_cache: KvCacheDtype::Bf16,
            expert_ops: false,
            tp: 1,
        }
    }

    pub fn all_layers(model: &Model, paths: MlaPaths) -> EngineOptions {
        EngineOptions::new(model, paths)
    }
}

/// Wall time of one layer in one phase.
#[derive(Debug, Clone, Serialize)]
pub struct LayerTiming {
    pub phase: Phase,
    pub layer: usize,
    pub seconds: f64,
    /// Part of `seconds` spent fetching (or generating) weights.
    pub weight_seconds: f64,
    /// Part of `seconds` spent in the all-reduces after attention and the MLP (the CPU's sum,
    /// NCCL's; zero where ranks share one GPU).
    pub collective_seconds: f64,
    /// Part of `seconds` before the closing wait for the device: the host's own time (queuing
    /// kernels, tracing, waits inside the layer). Near `seconds`, the device waits on the host.
    pub host_seconds: f64,
}

/// Rows of lm_head fetched at once when it is too large to cache whole (256 MiB of f32).
const LM_HEAD_CHUNK_BYTES: usize = 256 << 20;

pub struct Engine<'m> {
    model: &'m Model,
    backend: &'m dyn Backend,
    /// Outputs of an earlier run that may stand in for computing (see [`Replay`]).
    replay: Option<&'m dyn Replay>,
    counts: OpCounts,
    options: EngineOptions,
    rope: RopeTable,
    /// The tensor-parallel ranks (one without tensor parallelism), with their caches.
    ranks: Vec<RankState>,
    /// Where the ranks compute and what joins them (`None` without tensor parallelism: the one
    /// rank computes on `backend`).
    plan: Option<RankBackends>,
    /// Tokens processed so far (the position of the next one).
    position: usize,
    decode_steps: usize,
    next_event: usize,
    timings: Vec<LayerTiming>,
}

impl<'m> Engine<'m> {
    pub fn new(
        model: &'m Model,
        backend: &'m dyn Backend,
        options: EngineOptions,
    ) -> Result<Engine<'m>> {
        let layout = &model.layout;
        let r = &options.layers;
        if r.start >= r.end || r.end > layout.num_layers {
            return Err(Error::invalid(format!(
                "layer range {}..{} is empty or outside the model's {} layers",
                r.start, r.end, layout.num_layers
            )));
        }
        options
            .kv_cache
            .check_layout(layout.kv_lora_rank, layout.qk_rope_head_dim)?;
        backend.set_poison_outputs(options.poison);
        shard::check_tp(layout, options.tp)?;
        let plan = backend.rank_backends(options.tp)?;
        let ranks = RankState::all(model, &options)?;
        // Generated weights are made where each rank computes (on a GPU: never on the host).
        model.weights.set_maker(backend.weight_maker());
        bound_device_cache(&model.weights, backend);
        for (r, rank) in ranks.iter().enumerate() {
            let b = rank_backend(plan.as_ref(), backend, r);
            b.set_poison_outputs(options.poison);
            rank.weights(model).set_maker(b.weight_maker());
            bound_device_cache(rank.weights(model), b);
        }
        Ok(Engine {
            model,
            backend,
            replay: None,
            counts: OpCounts::default(),
            rope: RopeTable::new(&layout.rope, layout.qk_rope_head_dim),
            options,
            ranks,
            plan,
            position: 0,
            decode_steps: 0,
            next_event: 0,
            timings: Vec::new(),
        })
    }

    /// Lets ops take their outputs from an earlier run where `replay` allows.
    pub fn with_replay(mut self, replay: &'m dyn Replay) -> Engine<'m> {
        self.replay = Some(replay);
        self
    }

    /// Ops computed and ops replayed so far.
    pub fn counts(&self) -> OpCounts {
        self.counts
    }

    /// Tokens processed so far.
    pub fn position(&self) -> usize {
        self.position
    }

    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// Where the tensor-parallel ranks run and what joins them (`None` without tensor
    /// parallelism).
    pub fn ranks_note(&self) -> Option<&str> {
        self.plan.as_ref().map(|p| p.note.as_str())
    }

    /// Whether the ranks' all-reduces run as one collective (the CPU's, NCCL's), so that their
    /// time is counted.
    pub fn sums_across_devices(&self) -> bool {
        self.plan.as_ref().is_some_and(|p| p.all_reduce.is_some())
    }

    pub fn timings(&self) -> &[LayerTiming] {
        &self.timings
    }

    /// Bytes held by all KV caches.
    pub fn cache_bytes(&self) -> usize {
        let caches = self.ranks.iter().flat_map(|r| r.caches.iter().flatten());
        caches.map(LayerCache::bytes).sum()
    }

    /// The caches of a layer (for inspection; rank 0's under tensor parallelism).
    pub fn layer_cache(&self, layer: usize) -> Option<&LayerCache> {
        self.ranks[0].caches.get(layer).and_then(Option::as_ref)
    }

    /// Prefills `tokens` (which must be the first tokens of the sequence) and returns their
    /// logits [tokens, vocab].
    pub fn prefill(&mut self, tokens: &[u32], observer: &mut dyn Observer) -> Result<Tensor> {
        if self.position != 0 {
            return Err(Error::invalid("prefill must come before any decode step"));
        }
        if tokens.is_empty() {
            return Err(Error::invalid("prefill needs at least one token"));
        }
        self.forward(tokens, Phase::Prefill, self.options.paths.prefill, observer)
    }

    /// Decodes one token against the cache; returns its logits [1, vocab].
    pub fn decode(&mut self, token: u32, observer: &mut dyn Observer) -> Result<Tensor> {
        let phase = Phase::Decode(self.decode_steps);
        let logits = self.forward(&[token], phase, self.options.paths.decode, observer)?;
        self.decode_steps += 1;
        Ok(logits)
    }

    fn forward(
        &mut self,
        tokens: &[u32],
        phase: Phase,
        path: super::MlaPath,
        observer: &mut dyn Observer,
    ) -> Result<Tensor> {
        observer.on_pass_start(phase);
        let model = self.model;
        let layout = &model.layout;
        for &t in tokens {
            if t as usize >= layout.vocab_size {
                return Err(Error::invalid(format!(
                    "token id {t} is out of the vocabulary (vocab_size {})",
                    layout.vocab_size
                )));
            }
        }
        let start = self.position;
        let positions: Vec<usize> = (start..start + tokens.len()).collect();
        let options = &self.options;
        let tp = self.ranks.len();
        // Each rank's layout, weights and caches, borrowed apart, and the backend it computes on.
        let (mut layouts, mut stores, mut caches) = (Vec::new(), Vec::new(), Vec::new());
        for rank in self.ranks.iter_mut() {
            let (layout, store, cache) = rank.parts(model);
            layouts.push(layout);
            stores.push(store);
            caches.push(cache);
        }
        let plan = self.plan.as_ref();
        let backends: Vec<&dyn Backend> = (0..tp)
            .map(|r| rank_backend(plan, self.backend, r))
            .collect();
        let ranks = PassRanks {
            stores: &stores,
            backends: &backends,
            device_sum: plan.and_then(|p| p.all_reduce.as_deref()),
        };
        let mut sink = Sink::new(
            backends[0],
            stores[0],
            observer,
            self.replay,
            options.storage,
            phase,
            (start, start + tokens.len()),
            &mut self.next_event,
            &mut self.counts,
        );
        let tp_rank = |rank: usize| TpRank {
            rank,
            size: tp,
            full: &model.weights,
        };
        let faults = &options.faults;

        let mut parts = Vec::with_capacity(tp);
        for (r, &store) in stores.iter().enumerate() {
            sink.set_rank(tp_rank(r).trace_rank(), store, backends[r]);
            let vocab = shard::vocab_part(layout.vocab_size, tp, r);
            parts.push(
                sink.op(None, "model.embed_tokens", OpKind::Embedding, &[], |_| {
                    embed(store, tokens, vocab, layout.hidden_size)
                })?,
            );
        }
        let mut h = all_reduce(&mut sink, ranks, None, "model.embed_tokens", parts, faults)?;

        let mut shared_selection: Vec<Option<Selection>> = vec![None; tp];
        // A layer's time covers its device work: the device is waited for at its ends, so work
        // queued before the layer or still running after it is not charged to it.
        let settle = || backends.iter().try_for_each(|b| b.synchronize());
        for layer in options.layers.clone() {
            settle()?;
            let begin = Instant::now();
            let fetching = || stores.iter().map(|s| s.fetch_seconds()).sum::<f64>();
            let fetch_before = fetching();
            let summing = || ranks.device_sum.map_or(0.0, |d| d.seconds());
            let summing_before = summing();
            let l = Some(layer);
            let ctx = |r: usize| LayerCtx {
                layout: layouts[r],
                weights: stores[r],
                backend: backends[r],
                rope: &self.rope,
                layer,
                phase,
                positions: &positions,
                faults: options.faults,
                mla_backend: !options.mla_disabled,
                poison: options.poison,
                force_dequant: options.force_dequant,
                kernels: options.kernels,
                kv_cache: options.kv_cache,
                expert_ops: options.expert_ops,
                forced: &options.forced,
                tp: tp_rank(r),
            };
            // Attention: each rank's heads, o_proj's partial sums all-reduced.
            let mut parts = Vec::with_capacity(tp);
            for r in 0..tp {
                let (ctx, b) = (ctx(r), backends[r]);
                sink.set_rank(ctx.tp.trace_rank(), stores[r], b);
                let x = sink.op(
                    l,
                    &ctx.name("input_layernorm"),
                    OpKind::RmsNorm,
                    &[&h[r]],
                    |rd| {
                        let w = rd.weight(&ctx.name("input_layernorm.weight"))?;
                        b.rms_norm(&h[r], &w, layout.rms_norm_eps)
                    },
                )?;
                let cache = caches[r][layer]
                    .as_mut()
                    .expect("caches exist for every layer in range");
                let selection = &mut shared_selection[r];
                parts.push(attention_block(
                    &ctx, &x, cache, path, selection, &mut sink,
                )?);
            }
            let o_proj = format!("{}.self_attn.o_proj", layer_prefix(layer));
            let attn = all_reduce(&mut sink, ranks, l, &o_proj, parts, faults)?;
            // The MLP: each rank's columns or experts, their partial sums all-reduced.
            let (mut h_mid, mut parts) = (Vec::with_capacity(tp), Vec::with_capacity(tp));
            for r in 0..tp {
                let (ctx, b) = (ctx(r), backends[r]);
                sink.set_rank(ctx.tp.trace_rank(), stores[r], b);
                let (h, attn) = (&h[r], &attn[r]);
                let mid = sink.op(
                    l,
                    &ctx.name("attn_residual"),
                    OpKind::Residual,
                    &[h, attn],
                    |_| b.add(h, attn),
                )?;
                let x = sink.op(
                    l,
                    &ctx.name("post_attention_layernorm"),
                    OpKind::RmsNorm,
                    &[&mid],
                    |rd| {
                        let w = rd.weight(&ctx.name("post_attention_layernorm.weight"))?;
                        b.rms_norm(&mid, &w, layout.rms_norm_eps)
                    },
                )?;
                parts.push(match layout.mlp_kind(layer) {
                    MlpKind::Dense => mlp::dense(&ctx, &x, &mut sink)?,
                    MlpKind::Moe => mlp::moe(&ctx, &x, &mut sink)?,
                });
                h_mid.push(mid);
            }
            let mlp_name = format!("{}.mlp", layer_prefix(layer));
            let m = all_reduce(&mut sink, ranks, l, &mlp_name, parts, faults)?;
            for r in 0..tp {
                let b = backends[r];
                sink.set_rank(tp_rank(r).trace_rank(), stores[r], b);
                let (mid, m) = (&h_mid[r], &m[r]);
                h[r] = sink.op(l, &layer_prefix(layer), OpKind::Residual, &[mid, m], |_| {
                    b.add(mid, m)
                })?;
            }
            let host_seconds = begin.elapsed().as_secs_f64();
            settle()?;
            self.timings.push(LayerTiming {
                phase,
                layer,
                host_seconds,
                seconds: begin.elapsed().as_secs_f64(),
                weight_seconds: fetching() - fetch_before,
                collective_seconds: summing() - summing_before,
            });
        }

        // The final norm on every rank; each rank's part of the vocabulary, gathered.
        let mut parts = Vec::with_capacity(tp);
        for (r, &store) in stores.iter().enumerate() {
            let b = backends[r];
            sink.set_rank(tp_rank(r).trace_rank(), store, b);
            let h = &h[r];
            let normed = sink.op(None, "model.norm", OpKind::RmsNorm, &[h], |rd| {
                b.rms_norm(h, &*rd.weight("model.norm.weight")?, layout.rms_norm_eps)
            })?;
            parts.push(sink.op(None, "logits", OpKind::Logits, &[&normed], |_| {
                lm_head(model, store, b, &normed)
            })?);
        }
        let logits = all_gather(&mut sink, ranks, None, "logits", parts)?;
        sink.flush()?;
        self.position += tokens.len();
        Ok(logits.into_iter().next().expect("one rank at least"))
    }
}

/// Device memory left to activations, caches and the experts' scratch when the weight cache's
/// device budget is taken from the free memory: an eighth of the device, at least this.
const DEVICE_RESERVE_MIN: usize = 4 << 30;

/// Bounds the weights `weights` keeps on `backend`'s device when `--device-cache-gb` did not:
/// the device's free memory now, less the reserve. A host backend leaves it unbounded.
fn bound_device_cache(weights: &WeightStore, backend: &dyn Backend) {
    if weights.device_budget() != usize::MAX {
        return;
    }
    if let Some((free, total)) = backend.device_memory() {
        let reserve = (total / 8).max(DEVICE_RESERVE_MIN);
        weights.set_device_budget(free.saturating_sub(reserve));
    }
}

/// The backend rank `r` computes on: its own in `plan`, else `main` (one rank).
fn rank_backend<'a>(
    plan: Option<&'a RankBackends>,
    main: &'a dyn Backend,
    r: usize,
) -> &'a dyn Backend {
    plan.and_then(|p| p.backends.get(r))
        .map_or(main, |b| b.as_ref())
}

/// The embedding rows of `tokens` from the part of the vocabulary `(first, count)` that
/// `weights` holds: a token outside it gives zeros (vocab-parallel; the all-reduce sums the
/// ranks' rows).
fn embed(
    weights: &WeightStore,
    tokens: &[u32],
    (first, count): (usize, usize),
    hidden: usize,
) -> Result<Tensor> {
    let mut rows = vec![0.0f32; tokens.len() * hidden];
    for (&t, row) in tokens.iter().zip(rows.chunks_mut(hidden.max(1))) {
        let t = t as usize;
        if (first..first + count).contains(&t) {
            let values = weights.rows("model.embed_tokens.weight", t - first, 1)?;
            row.copy_from_slice(values.data());
        }
    }
    Ok(Tensor::from_vec(&[tokens.len(), hidden], rows))
}

/// x · lm_headᵀ over the rows of lm_head `weights` holds (the whole vocabulary, or a rank's
/// part), fetching them in row chunks when they are too large to hold whole.
fn lm_head(model: &Model, weights: &WeightStore, b: &dyn Backend, x: &Tensor) -> Result<Tensor> {
    let name = lm_head_name(&model.layout);
    let bytes = weights.size_bytes(name)?;
    if weights.fits_budget(bytes) {
        let w = weights.get(name)?;
        return b.linear(x, &w, None);
    }
    let vocab = weights.shape(name)?[0];
    let n = x.rows();
    let chunk = (LM_HEAD_CHUNK_BYTES / (model.layout.hidden_size * 4)).max(1);
    let mut logits = Tensor::zeros(&[n, vocab])?;
    let mut start = 0;
    while start < vocab {
        let count = chunk.min(vocab - start);
        let w = weights.rows(name, start, count)?;
        let part = b.linear(x, &w, None)?;
        for t in 0..n {
            logits.data_mut()[t * vocab + start..t * vocab + start + count]
                .copy_from_slice(part.row(t));
        }
        start += count;
    }
    Ok(logits)
}
