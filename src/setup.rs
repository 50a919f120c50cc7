//! Model loading and run setup, written once for every front end: the commands (`cli`), the
//! debugger (`tui`, through [`crate::service`]) and sessions (which name a model to reload).
//! The types here are plain data; the command line fills them from its options, so clap stays
//! in `cli/` and the layers above this one never depend on it.

use crate::backend::{self, Backend, DeviceChoice};
use crate::debug::Flags;
use crate::engine::generate::Schedule;
use crate::engine::MlaPath;
use crate::error::{Error, Result};
use crate::model::{Layout, Model};
use crate::session::ModelSource;
use std::ops::Range;
use std::path::PathBuf;

/// The layout a run uses when neither a layout nor a checkpoint is named.
pub const DEFAULT_LAYOUT: &str = "glm5-tiny";

/// Memory for keeping fetched weights between steps when nothing says otherwise, in MiB.
pub const DEFAULT_WEIGHT_CACHE_MB: usize = 8192;

/// Where the model comes from: a checkpoint (HF directory or GGUF file), or a layout with
/// synthetic weights.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    pub layout: Option<String>,
    pub model: Option<PathBuf>,
    pub seed: u64,
    pub weight_cache_mb: usize,
    /// Device memory for cached weights, in GB (`None`: from the device's free memory).
    pub device_cache_gb: Option<f64>,
    /// GGUF block type the projection weights are quantized to at load (`q8_0`, `q4_k`, ...).
    pub quant: Option<String>,
}

impl ModelSpec {
    pub fn with_layout(name: &str) -> ModelSpec {
        ModelSpec {
            layout: Some(name.to_string()),
            model: None,
            seed: 0,
            weight_cache_mb: DEFAULT_WEIGHT_CACHE_MB,
            device_cache_gb: None,
            quant: None,
        }
    }

    /// The model a session names; a checkpoint must still be the one the session recorded.
    pub fn of_session(source: &ModelSource) -> Result<ModelSpec> {
        Ok(match source {
            ModelSource::Layout {
                layout,
                seed,
                quant,
            } => {
                Layout::resolve(layout)?;
                ModelSpec {
                    seed: *seed,
                    quant: quant.clone(),
                    ..ModelSpec::with_layout(layout)
                }
            }
            ModelSource::Checkpoint {
                path,
                fingerprint,
                quant,
            } => {
                let now = crate::session::checkpoint_fingerprint(path)?;
                if &now != fingerprint {
                    return Err(Error::invalid(format!(
                        "{}: the checkpoint changed since the session was saved",
                        path.display()
                    )));
                }
                ModelSpec {
                    layout: None,
                    model: Some(path.clone()),
                    seed: 0,
                    weight_cache_mb: DEFAULT_WEIGHT_CACHE_MB,
                    device_cache_gb: None,
                    quant: quant.clone(),
                }
            }
        })
    }

    /// Builds the model: a checkpoint, or a layout (default glm5-tiny) with synthetic weights.
    pub fn load(&self) -> Result<Model> {
        let model = self.load_weights()?;
        if let Some(gb) = self.device_cache_gb {
            model.weights.set_device_budget((gb * 1e9) as usize);
        }
        Ok(model)
    }

    fn load_weights(&self) -> Result<Model> {
        let budget = self.weight_cache_mb.saturating_mul(1 << 20);
        let quant = self.quant_type()?;
        match &self.model {
            Some(path) if crate::model::gguf::is_gguf(path) => {
                if quant.is_some() {
                    return Err(Error::invalid(
                        "--quant applies to synthetic and HF weights; a GGUF file is already quantized",
                    ));
                }
                Model::gguf(path, budget)
            }
            Some(dir) => Model::hf_checkpoint_quantized(dir, quant, budget),
            None => {
                let layout = Layout::resolve(self.layout.as_deref().unwrap_or(DEFAULT_LAYOUT))?;
                Model::synthetic_quantized(layout, self.seed, quant, budget)
            }
        }
    }

    /// The quantization type, if one is named.
    pub fn quant_type(&self) -> Result<Option<crate::gguf::GgmlType>> {
        self.quant
            .as_deref()
            .map(|name| {
                crate::gguf::GgmlType::from_name(name)
                    .ok_or_else(|| Error::invalid(format!("--quant: unknown type '{name}'")))
            })
            .transpose()
    }

    /// Where the model comes from, as a session records it.
    pub fn source(&self) -> Result<ModelSource> {
        Ok(match &self.model {
            Some(dir) => ModelSource::Checkpoint {
                path: dir.clone(),
                fingerprint: crate::session::checkpoint_fingerprint(dir)?,
                quant: self.quant.clone(),
            },
            None => ModelSource::Layout {
                layout: self.layout.clone().unwrap_or_else(|| DEFAULT_LAYOUT.into()),
                seed: self.seed,
                quant: self.quant.clone(),
            },
        })
    }
}

/// Loads the model a session names.
pub fn load_model(source: &ModelSource) -> Result<Model> {
    ModelSpec::of_session(source)?.load()
}

/// The model, the tokens, the layers and the device of a run, as given (text where the
/// model is needed to check it).
#[derive(Debug, Clone, PartialEq)]
pub struct RunSpec {
    pub model: ModelSpec,
    /// Prompt token ids, comma-separated.
    pub tokens: Option<String>,
    /// Prompt text, turned into ids by the tokenizer (instead of `tokens`).
    pub prompt: Option<String>,
    /// The tokenizer file (default: the checkpoint directory's tokenizer.json).
    pub tokenizer: Option<PathBuf>,
    pub prefill: Option<usize>,
    pub decode: Option<usize>,
    /// `A..B`, `A..=B` or `A`.
    pub layers: Option<String>,
    pub device: DeviceChoice,
    /// The most memory the run may need, in GB (default: what the machine has available).
    pub max_memory_gb: Option<f64>,
    /// Bytes already held for the run (a reference dump's values), counted against
    /// `max_memory_gb` beside the run's own estimate.
    pub held_bytes: u128,
}

/// A loaded model with the schedule and layers to run.
pub struct Prepared {
    pub model: Model,
    pub backend: Box<dyn Backend>,
    pub schedule: Schedule,
    pub layers: Range<usize>,
    pub load_seconds: f64,
    /// The tokenizer, when the run has one: prompts in, generated tokens shown as text.
    pub text: Option<crate::model::tokenizer::TextCodec>,
}

impl RunSpec {
    /// A run of a built-in layout with the default schedule, on the CPU.
    pub fn with_layout(name: &str) -> RunSpec {
        RunSpec {
            model: ModelSpec::with_layout(name),
            tokens: None,
            prompt: None,
            tokenizer: None,
            prefill: None,
            decode: None,
            layers: None,
            device: DeviceChoice::Cpu,
            max_memory_gb: None,
            held_bytes: 0,
        }
    }

    /// Loads the model and checks the schedule against it; the device stores values as `flags.dtype`.
    pub fn prepare(&self, flags: &Flags) -> Result<Prepared> {
        let (backend, note) = backend::select(self.device, flags.dtype)?;
        if let Some(note) = note {
            eprintln!("{note}");
        }
        let start = std::time::Instant::now();
        let model = self.model.load()?;
        let load_seconds = start.elapsed().as_secs_f64();
        let layout = &model.layout;
        let layers = match &self.layers {
            Some(text) => parse_layers(text, layout.num_layers)?,
            None => 0..layout.num_layers,
        };
        let checkpoint_dir = self.model.model.as_deref().filter(|p| p.is_dir());
        let text =
            crate::model::tokenizer::TextCodec::find(self.tokenizer.as_deref(), checkpoint_dir)?;
        let tokens = match (&self.tokens, &self.prompt, &text) {
            (Some(_), Some(_), _) => {
                return Err(Error::invalid("give --tokens or --prompt, not both"))
            }
            (Some(t), None, _) => Some(parse_tokens_for(t, layout)?),
            (None, Some(p), Some(codec)) => Some(codec.encode(p, layout.vocab_size)?),
            (None, Some(_), None) => {
                return Err(Error::invalid(
                    "--prompt needs a tokenizer: --tokenizer FILE (an HF tokenizer.json), or --model DIR with a tokenizer.json",
                ))
            }
            (None, None, _) => None,
        };
        if layout.indexer_mode(layers.start) == Some(crate::model::layout::IndexerMode::Shared) {
            // A shared indexer reuses the previous layer's top-k; the first layer run has none.
            eprintln!(
                "note: layer {} shares the DSA top-k of {}, so it attends densely here",
                layers.start,
                if layers.start == 0 {
                    "an earlier layer, and there is none".to_string()
                } else {
                    format!("layer {}, which this run leaves out", layers.start - 1)
                }
            );
        }
        let schedule = schedule_with_defaults(layout, tokens, self.prefill, self.decode);
        schedule.validate()?;
        crate::memory::check_beside(
            &model,
            schedule.prompt.len().saturating_add(schedule.decode_steps),
            &layers,
            self.max_memory_gb,
            self.held_bytes,
        )?;
        Ok(Prepared {
            model,
            backend,
            schedule,
            layers,
            load_seconds,
            text,
        })
    }

    /// Where the model comes from, as a session records it.
    pub fn source(&self) -> Result<ModelSource> {
        self.model.source()
    }

    /// The run against a reference dump: its tokens, prefill and decode count where none are
    /// given; given ones that differ from the dump's are an error naming both.
    pub fn against(&self, dump: &crate::debug::external::ExternalDump) -> Result<RunSpec> {
        if self.prompt.is_some() {
            return Err(Error::invalid(
                "--prompt with --reference: the run takes the reference dump's tokens; leave --prompt out",
            ));
        }
        let schedule = dump.schedule_for(crate::debug::external::ScheduleArgs {
            tokens: self.tokens.as_deref().map(parse_tokens).transpose()?,
            prefill: self.prefill,
            decode: self.decode,
        })?;
        Ok(RunSpec {
            tokens: schedule
                .tokens
                .map(|t| t.iter().map(u32::to_string).collect::<Vec<_>>().join(",")),
            prefill: schedule.prefill,
            decode: schedule.decode,
            held_bytes: self.held_bytes + dump.value_bytes(),
            ..self.clone()
        })
    }
}

/// The debugging flags as a front end gives them, before they are checked against each other
/// and the environment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FlagOptions {
    pub mla_disable: bool,
    pub prefill_path: Option<MlaPath>,
    pub decode_path: Option<MlaPath>,
    /// Fault specs, `NAME[@SCOPE]`, each adding one.
    pub inject: Vec<String>,
    pub dtype: Option<String>,
    pub force_dequant: bool,
    /// `fast` or `reference` (the attention kernels on the GPU).
    pub attn_kernel: Option<String>,
    /// A decode or prefill kernel variant forced instead of the device's first choice.
    pub decode_variant: Option<String>,
    pub prefill_variant: Option<String>,
    /// `bf16` or `fp8_ds_mla` (the latent cache's storage).
    pub kv_cache_dtype: Option<String>,
    /// Tensor-parallel ranks.
    pub tp: Option<String>,
    /// An op for each chosen routed expert.
    pub expert_ops: bool,
}

impl FlagOptions {
    /// The flags for a run on `device`, `VLLM_MLA_DISABLE` included.
    pub fn flags(&self, device: DeviceChoice) -> Result<Flags> {
        self.flags_with_env(device, vllm_mla_disable()?)
    }

    /// The flags for a run on `device`, with MLA disable also on when `env_mla_disable`
    /// (`VLLM_MLA_DISABLE`) says so.
    pub fn flags_with_env(&self, device: DeviceChoice, env_mla_disable: bool) -> Result<Flags> {
        let mut flags = Flags::default();
        if self.mla_disable || env_mla_disable {
            let absorbed = [
                (self.prefill_path, "--prefill-path"),
                (self.decode_path, "--decode-path"),
            ]
            .into_iter()
            .find(|(p, _)| *p == Some(MlaPath::Absorbed));
            if let Some((_, option)) = absorbed {
                let why = if self.mla_disable {
                    "--mla-disable"
                } else {
                    "VLLM_MLA_DISABLE=1"
                };
                return Err(Error::invalid(format!(
                    "{why} makes every path naive: it contradicts {option} absorbed"
                )));
            }
            flags.mla_disable = true;
        }
        if let Some(p) = self.prefill_path {
            flags.prefill_path = p;
        }
        if let Some(p) = self.decode_path {
            flags.decode_path = p;
        }
        for spec in &self.inject {
            flags
                .set("inject", spec)
                .map_err(|e| Error::invalid(format!("--inject: {e}")))?;
        }
        let cuda = device == DeviceChoice::Cuda;
        let default_dtype = if cuda { "bf16" } else { "f32" };
        flags
            .set("dtype", self.dtype.as_deref().unwrap_or(default_dtype))
            .map_err(|e| Error::invalid(format!("--dtype: {e}")))?;
        if cuda {
            flags.device = crate::debug::flags::DeviceFlag::Cuda;
        }
        if self.force_dequant {
            flags.set("force-dequant", "on")?;
        }
        flags.expert_ops = self.expert_ops;
        for (key, value) in [
            ("attn-kernel", &self.attn_kernel),
            ("decode-variant", &self.decode_variant),
            ("prefill-variant", &self.prefill_variant),
            ("kv-cache-dtype", &self.kv_cache_dtype),
            ("tp", &self.tp),
        ] {
            if let Some(v) = value {
                flags
                    .set(key, v)
                    .map_err(|e| Error::invalid(format!("--{key}: {e}")))?;
            }
        }
        Ok(flags)
    }
}

/// What the headless commands print and the debugger logs when `VLLM_MLA_DISABLE` turned MLA
/// disable on.
pub const VLLM_MLA_DISABLE_NOTE: &str = "VLLM_MLA_DISABLE is set: MLA disable is on (naive \
     attention in prefill and decode, around the MLA backend), as vLLM runs it";

/// `VLLM_MLA_DISABLE` read the way vLLM reads it, as an integer: unset or 0 is off, any other
/// integer on; anything else is an error.
pub fn parse_vllm_mla_disable(value: Option<&str>) -> Result<bool> {
    let Some(text) = value else { return Ok(false) };
    text.trim().parse::<i64>().map(|v| v != 0).map_err(|_| {
        Error::invalid(format!(
            "VLLM_MLA_DISABLE='{text}' is not an integer (vLLM reads it as one: 0 is off, 1 on)"
        ))
    })
}

/// `VLLM_MLA_DISABLE` of this process's environment.
pub fn vllm_mla_disable() -> Result<bool> {
    match std::env::var_os("VLLM_MLA_DISABLE") {
        None => Ok(false),
        Some(v) => match v.to_str() {
            Some(text) => parse_vllm_mla_disable(Some(text)),
            None => Err(Error::invalid(
                "VLLM_MLA_DISABLE is not valid text (vLLM reads it as an integer: 0 or 1)",
            )),
        },
    }
}

/// `3,141,59` → token ids.
pub fn parse_tokens(text: &str) -> Result<Vec<u32>> {
    let tokens: Vec<u32> = text
        .split(',')
        .map(|t| {
            let t = t.trim();
            t.parse::<u32>().map_err(|_| {
                Error::invalid(format!(
                    "--tokens: '{t}' is not a token id (expected e.g. 3,141,59)"
                ))
            })
        })
        .collect::<Result<_>>()?;
    if tokens.is_empty() {
        return Err(Error::invalid("--tokens: no token ids given"));
    }
    Ok(tokens)
}

/// `--tokens` text as token ids of `layout`'s vocabulary.
pub fn parse_tokens_for(text: &str, layout: &Layout) -> Result<Vec<u32>> {
    let prompt = parse_tokens(text)?;
    if let Some(t) = prompt.iter().find(|&&t| t as usize >= layout.vocab_size) {
        return Err(Error::invalid(format!(
            "--tokens: token id {t} is out of the vocabulary of {} (vocab_size {})",
            layout.name, layout.vocab_size
        )));
    }
    Ok(prompt)
}

/// `A..B` (half-open, like Rust), `A..=B` (inclusive) or `A` (one layer).
pub fn parse_layers(text: &str, num_layers: usize) -> Result<Range<usize>> {
    let bad = || {
        Error::invalid(format!(
            "--layers: '{text}' is not a layer range (expected A..B, A..=B or A)"
        ))
    };
    let num = |s: &str| s.trim().parse::<usize>().map_err(|_| bad());
    let range = if let Some((a, b)) = text.split_once("..=") {
        num(a)?..num(b)?.checked_add(1).ok_or_else(bad)?
    } else if let Some((a, b)) = text.split_once("..") {
        num(a)?..num(b)?
    } else {
        let a = num(text)?;
        a..a + 1
    };
    if range.start >= range.end || range.end > num_layers {
        return Err(Error::invalid(format!(
            "--layers {text}: the model has layers 0..{num_layers}, and the range must hold at least one"
        )));
    }
    Ok(range)
}

/// A prompt that fits any vocabulary: spread-out ids, deterministic.
pub fn default_prompt(vocab: usize, len: usize) -> Vec<u32> {
    (0..len).map(|i| ((i * 7919 + 1) % vocab) as u32).collect()
}

/// Prompt tokens of the default schedule.
pub const DEFAULT_PROMPT_TOKENS: usize = 12;
/// Greedy decode steps of the default schedule.
pub const DEFAULT_DECODE_STEPS: usize = 4;
/// Prompt tokens the default schedule prefills, at most (the rest go through decode).
pub const DEFAULT_PREFILL: usize = 6;

/// The schedule of a run: what was given, and for the rest the one default every command
/// shares (`run`, `check`, `bisect`, `tui` and the bare `mladb`): a 12-token prompt whose first
/// 6 tokens are prefilled and the rest fed through decode, then 4 greedy decode steps. Where the
/// layout's DSA top-k is small enough to cross (glm5-tiny: 8), the prefill stays below it, so
/// that decode runs dense first and sparse once the context outgrows the top-k; a full-size
/// top-k (2048) is beyond a short prompt. An explicit prompt is prefilled whole by default.
pub fn schedule_with_defaults(
    layout: &Layout,
    tokens: Option<Vec<u32>>,
    prefill: Option<usize>,
    decode: Option<usize>,
) -> Schedule {
    let given = tokens.is_some();
    let prompt = tokens.unwrap_or_else(|| default_prompt(layout.vocab_size, DEFAULT_PROMPT_TOKENS));
    let default_prefill = if given {
        prompt.len()
    } else {
        let below_topk = layout
            .indexer
            .as_ref()
            .map_or(usize::MAX, |ix| ix.topk.saturating_sub(1).max(1));
        DEFAULT_PREFILL.min(below_topk)
    };
    Schedule {
        prefill_len: prefill.unwrap_or(default_prefill),
        prompt,
        decode_steps: decode.unwrap_or(DEFAULT_DECODE_STEPS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_ranges() {
        assert_eq!(parse_layers("0..2", 78).unwrap(), 0..2);
        assert_eq!(parse_layers("0..=2", 78).unwrap(), 0..3);
        assert_eq!(parse_layers("5", 78).unwrap(), 5..6);
        assert!(parse_layers("2..2", 78).is_err());
        assert!(parse_layers("0..79", 78).is_err());
        assert!(parse_layers("x", 78).is_err());
    }

    #[test]
    fn the_default_schedule_crosses_a_small_dsa_topk_during_decode() {
        for name in ["glm5-tiny", "glm5-tiny-wide"] {
            let layout = Layout::resolve(name).unwrap();
            let topk = layout.indexer.as_ref().unwrap().topk;
            let s = schedule_with_defaults(&layout, None, None, None);
            s.validate().unwrap();
            assert!(s.decode_steps > 0, "{name}: decode runs by default");
            // The first decode step attends densely, the last sparsely.
            assert!(s.prefill_len < topk, "{name}: {s:?}");
            assert!(s.prompt.len() + s.decode_steps > topk, "{name}: {s:?}");
        }
        let mut small = Layout::resolve("glm5-tiny").unwrap();
        small.indexer.as_mut().unwrap().topk = 4;
        assert_eq!(
            schedule_with_defaults(&small, None, None, None).prefill_len,
            3
        );
        let plain = Layout::resolve("deepseek-v3-tiny").unwrap();
        let s = schedule_with_defaults(&plain, None, None, None);
        assert_eq!((s.prompt.len(), s.prefill_len, s.decode_steps), (12, 6, 4));
        // What is given is kept; an explicit prompt is prefilled whole.
        let s = schedule_with_defaults(&plain, Some(vec![1, 2, 3]), None, Some(0));
        assert_eq!((s.prefill_len, s.decode_steps), (3, 0));
        let s = schedule_with_defaults(&plain, None, Some(12), None);
        assert_eq!((s.prefill_len, s.decode_steps), (12, 4));
    }

    #[test]
    fn vllm_mla_disable_is_read_as_an_integer() {
        assert!(!parse_vllm_mla_disable(None).unwrap());
        assert!(!parse_vllm_mla_disable(Some("0")).unwrap());
        assert!(parse_vllm_mla_disable(Some("1")).unwrap());
        assert!(parse_vllm_mla_disable(Some(" 2 ")).unwrap());
        for bad in ["", "true", "yes", "1.0", "on"] {
            let e = parse_vllm_mla_disable(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("VLLM_MLA_DISABLE"), "{e}");
        }
        let cpu = DeviceChoice::Cpu;
        let mut options = FlagOptions::default();
        assert!(options.flags_with_env(cpu, true).unwrap().mla_disable);
        assert!(!options.flags_with_env(cpu, false).unwrap().mla_disable);
        options.decode_path = Some(MlaPath::Absorbed);
        let e = options.flags_with_env(cpu, true).unwrap_err().to_string();
        assert!(
            e.contains("VLLM_MLA_DISABLE=1") && e.contains("--decode-path absorbed"),
            "{e}"
        );
        assert!(!options.flags_with_env(cpu, false).unwrap().mla_disable);
    }

    #[test]
    fn token_lists() {
        assert_eq!(parse_tokens("3,141, 59").unwrap(), vec![3, 141, 59]);
        assert!(parse_tokens("3,,4").is_err());
        assert!(parse_tokens("-1").is_err());
    }
}
