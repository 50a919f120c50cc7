//! The forward pass driver: embedding, the decoder layers in order, final norm and lm_head, for
//! a prefill chunk or one decode token, against per-layer caches that persist between calls.

use super::attention::{attention_block, LayerCtx, Selection};
use super::cache::{LatentCache, LayerCache};
use super::faults::Faults;
use super::forcing::ForcedSelections;
use super::mlp;
use super::rope::RopeTable;
use super::sink::Sink;
use super::sink::{OpCounts, StorageDtype};
use super::trace::{Observer, OpKind, Phase, Replay};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::model::catalog::{layer_prefix, lm_head_name};
use crate::model::layout::MlpKind;
use crate::model::Model;
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

/// The path of each phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MlaPaths {
    pub prefill: MlaPath,
    pub decode: MlaPath,
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
    /// One entry per layer of the model; `None` outside the layer range.
    caches: Vec<Option<LayerCache>>,
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
        let caches = (0..layout.num_layers)
            .map(|l| {
                r.contains(&l).then(|| LayerCache {
                    latent: LatentCache::with_dtype(
                        layout.latent_width(),
                        options.poison,
                        options.kv_cache,
                    ),
                    expanded: None,
                    index_keys: None,
                    kv_b_plain: None,
                })
            })
            .collect();
        Ok(Engine {
            model,
            backend,
            replay: None,
            counts: OpCounts::default(),
            rope: RopeTable::new(&layout.rope, layout.qk_rope_head_dim),
            options,
            caches,
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

    pub fn timings(&self) -> &[LayerTiming] {
        &self.timings
    }

    /// Bytes held by all KV caches.
    pub fn cache_bytes(&self) -> usize {
        self.caches.iter().flatten().map(LayerCache::bytes).sum()
    }

    /// The caches of a layer (for inspection).
    pub fn layer_cache(&self, layer: usize) -> Option<&LayerCache> {
        self.caches.get(layer).and_then(Option::as_ref)
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
        let model = self.model;
        let layout = &model.layout;
        let b = self.backend;
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
        let mut sink = Sink::new(
            b,
            &model.weights,
            observer,
            self.replay,
            options.storage,
            phase,
            (start, start + tokens.len()),
            &mut self.next_event,
            &mut self.counts,
        );

        let mut h = sink.op(None, "model.embed_tokens", OpKind::Embedding, &[], |_| {
            let mut rows = Vec::with_capacity(tokens.len() * layout.hidden_size);
            for &t in tokens {
                rows.extend_from_slice(
                    model
                        .weights
                        .rows("model.embed_tokens.weight", t as usize, 1)?
                        .data(),
                );
            }
            Ok(Tensor::from_vec(&[tokens.len(), layout.hidden_size], rows))
        })?;

        let mut shared_selection: Option<Selection> = None;
        for layer in options.layers.clone() {
            let begin = Instant::now();
            let fetch_before = model.weights.fetch_seconds();
            let ctx = LayerCtx {
                layout,
                weights: &model.weights,
                backend: b,
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
                forced: &options.forced,
            };
            let cache = self.caches[layer]
                .as_mut()
                .expect("caches exist for every layer in range");
            let l = Some(layer);
            let x = sink.op(
                l,
                &ctx.name("input_layernorm"),
                OpKind::RmsNorm,
                &[&h],
                |r| {
                    b.rms_norm(
                        &h,
                        &*r.weight(&ctx.name("input_layernorm.weight"))?,
                        layout.rms_norm_eps,
                    )
                },
            )?;
            let attn = attention_block(&ctx, &x, cache, path, &mut shared_selection, &mut sink)?;
            let h_mid = sink.op(
                l,
                &ctx.name("attn_residual"),
                OpKind::Residual,
                &[&h, &attn],
                |_| b.add(&h, &attn),
            )?;
            let x = sink.op(
                l,
                &ctx.name("post_attention_layernorm"),
                OpKind::RmsNorm,
                &[&h_mid],
                |r| {
                    let w = r.weight(&ctx.name("post_attention_layernorm.weight"))?;
                    b.rms_norm(&h_mid, &w, layout.rms_norm_eps)
                },
            )?;
            let m = match layout.mlp_kind(layer) {
                MlpKind::Dense => mlp::dense(&ctx, &x, &mut sink)?,
                MlpKind::Moe => mlp::moe(&ctx, &x, &mut sink)?,
            };
            h = sink.op(
                l,
                &layer_prefix(layer),
                OpKind::Residual,
                &[&h_mid, &m],
                |_| b.add(&h_mid, &m),
            )?;
            self.timings.push(LayerTiming {
                phase,
                layer,
                seconds: begin.elapsed().as_secs_f64(),
                weight_seconds: model.weights.fetch_seconds() - fetch_before,
            });
        }

        let normed = sink.op(None, "model.norm", OpKind::RmsNorm, &[&h], |r| {
            b.rms_norm(&h, &*r.weight("model.norm.weight")?, layout.rms_norm_eps)
        })?;
        let logits = sink.op(None, "logits", OpKind::Logits, &[&normed], |_| {
            lm_head(model, b, &normed)
        })?;
        sink.flush()?;
        self.position += tokens.len();
        Ok(logits)
    }
}

/// x · lm_headᵀ, fetching the head in row chunks when it is too large to hold whole.
fn lm_head(model: &Model, b: &dyn Backend, x: &Tensor) -> Result<Tensor> {
    let name = lm_head_name(&model.layout);
    let bytes = model.weights.size_bytes(name)?;
    if model.weights.fits_budget(bytes) {
        let w = model.weights.get(name)?;
        return b.linear(x, &w, None);
    }
    let vocab = model.layout.vocab_size;
    let n = x.rows();
    let chunk = (LM_HEAD_CHUNK_BYTES / (model.layout.hidden_size * 4)).max(1);
    let mut logits = Tensor::zeros(&[n, vocab])?;
    let mut start = 0;
    while start < vocab {
        let count = chunk.min(vocab - start);
        let w = model.weights.rows(name, start, count)?;
        let part = b.linear(x, &w, None)?;
        for t in 0..n {
            logits.data_mut()[t * vocab + start..t * vocab + start + count]
                .copy_from_slice(part.row(t));
        }
        start += count;
    }
    Ok(logits)
}
