//! Options shared by the commands that build a model, and their parsers.

use crate::backend::{self, Backend, DeviceChoice};
use crate::debug::Flags;
use crate::engine::generate::Schedule;
use crate::engine::MlaPath;
use crate::error::{Error, Result};
use crate::model::{Layout, Model};
use clap::{Args, ValueEnum};
use std::ops::Range;
use std::path::PathBuf;

/// Where the model comes from.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Built-in layout name (glm5, glm5-tiny, glm5-tiny-wide, deepseek-v3, deepseek-v3-tiny) or a .ron file;
    /// weights are synthetic.
    #[arg(long, conflicts_with = "model")]
    pub layout: Option<String>,
    /// An HF checkpoint directory (config.json + *.safetensors) or a GGUF file (glm-dsa,
    /// deepseek2).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Memory for keeping fetched weights between steps, in MiB.
    #[arg(long, default_value_t = 8192)]
    pub weight_cache_mb: usize,
    /// Quantize the projection weights at load, as a GGUF file would hold them: q8_0, q4_0,
    /// q4_k or q6_k (K-quant rows that are not multiples of 256 fall back to q4_0 / q8_0, as
    /// llama.cpp does).
    #[arg(long)]
    pub quant: Option<String>,
}

impl ModelArgs {
    pub fn with_layout(name: &str) -> ModelArgs {
        ModelArgs {
            layout: Some(name.to_string()),
            model: None,
            seed: 0,
            weight_cache_mb: 8192,
            quant: None,
        }
    }

    /// Builds the model: an HF checkpoint, or a layout (default glm5-tiny) with synthetic weights.
    pub fn load(&self) -> Result<Model> {
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
                let layout = Layout::resolve(self.layout.as_deref().unwrap_or("glm5-tiny"))?;
                Model::synthetic_quantized(layout, self.seed, quant, budget)
            }
        }
    }

    /// The `--quant` type, if given.
    pub fn quant_type(&self) -> Result<Option<crate::gguf::GgmlType>> {
        self.quant
            .as_deref()
            .map(|name| {
                crate::gguf::GgmlType::from_name(name)
                    .ok_or_else(|| Error::invalid(format!("--quant: unknown type '{name}'")))
            })
            .transpose()
    }
}

/// The model, the tokens and the layers of a run: what `run`, `check` and `bisect` share.
#[derive(Args, Debug, Clone)]
pub struct RunSetup {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt token ids, comma-separated (default: a 12-token prompt that fits the vocabulary).
    #[arg(long)]
    pub tokens: Option<String>,
    /// Prefill the first K prompt tokens, then feed the rest one by one through decode.
    /// Default: the whole prompt given with --tokens; of the default prompt, 6 tokens (one less
    /// than the DSA top-k where that is smaller), so that the context grows past the top-k during
    /// decode and decode runs both dense and sparse. A full-size layout's top-k (2048) is beyond
    /// any short prompt: give a longer --tokens to cross it there.
    #[arg(long)]
    pub prefill: Option<usize>,
    /// Greedy tokens to decode after the prompt (default 4; 0 for none). With --reference, the dump's. Decode is where the
    /// absorbed MLA path runs.
    #[arg(long)]
    pub decode: Option<usize>,
    /// Run only these decoder layers: A..B (half-open), A..=B or A.
    #[arg(long)]
    pub layers: Option<String>,
    /// cpu, cuda or auto (auto falls back to the CPU and says why).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Refuse a run whose largest buffers (weights kept, caches, attention over the context)
    /// would need more than this many GB (default: the memory the machine has available).
    #[arg(long)]
    pub max_memory_gb: Option<f64>,
}

/// A loaded model with the schedule and layers to run.
pub struct Prepared {
    pub model: Model,
    pub backend: Box<dyn Backend>,
    pub schedule: Schedule,
    pub layers: Range<usize>,
    pub load_seconds: f64,
}

impl RunSetup {
    /// A run of a built-in layout with the default schedule.
    pub fn with_layout(name: &str) -> RunSetup {
        RunSetup {
            model: ModelArgs::with_layout(name),
            tokens: None,
            prefill: None,
            decode: None,
            layers: None,
            device: DeviceArg::Cpu,
            max_memory_gb: None,
        }
    }

    /// Loads the model and checks the schedule against it; the device stores values as `flags.dtype`.
    pub fn prepare(&self, flags: &Flags) -> Result<Prepared> {
        let (backend, note) = backend::select(self.device.into(), flags.dtype)?;
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
        let tokens = match &self.tokens {
            Some(t) => Some(parse_tokens_for(t, layout)?),
            None => None,
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
        crate::memory::check(
            layout,
            schedule.prompt.len().saturating_add(schedule.decode_steps),
            &layers,
            self.model.weight_cache_mb.saturating_mul(1 << 20) as u64,
            self.max_memory_gb,
        )?;
        Ok(Prepared {
            model,
            backend,
            schedule,
            layers,
            load_seconds,
        })
    }
}

impl RunSetup {
    /// Where the model comes from, as a session records it.
    pub fn source(&self) -> Result<crate::session::ModelSource> {
        use crate::session::ModelSource;
        Ok(match &self.model.model {
            Some(dir) => ModelSource::Checkpoint {
                path: dir.clone(),
                fingerprint: crate::session::checkpoint_fingerprint(dir)?,
                quant: self.model.quant.clone(),
            },
            None => ModelSource::Layout {
                layout: self
                    .model
                    .layout
                    .clone()
                    .unwrap_or_else(|| "glm5-tiny".into()),
                seed: self.model.seed,
                quant: self.model.quant.clone(),
            },
        })
    }
}

/// `--record FILE` and `--record-tensors`, shared by `run` and `check`.
#[derive(Args, Debug, Clone, Default)]
pub struct RecordArgs {
    /// Record the session (model source, tokens, flags, every op's statistics, buffers and a
    /// sample of its values, the outcome) to this RON file, for `mladb replay`.
    #[arg(long)]
    pub record: Option<PathBuf>,
    /// With --record: also write every output in full to a companion safetensors file beside
    /// it (NAME.tensors.safetensors).
    #[arg(long, requires = "record")]
    pub record_tensors: bool,
}

impl RecordArgs {
    /// Refuses, before the run, a `--record` target (or its companion) that cannot be written
    /// or must not be replaced.
    pub fn check_outputs(&self) -> Result<()> {
        if let Some(path) = &self.record {
            crate::fsutil::check_output(path)?;
            if self.record_tensors {
                let name = crate::session::companion_name(path)?;
                crate::fsutil::check_output(&path.with_file_name(name))?;
            }
        }
        Ok(())
    }
}

/// The debugging flags as options.
#[derive(Args, Debug, Clone, Default)]
pub struct FlagArgs {
    /// Disable MLA weight absorption: naive attention in prefill and decode, served around the
    /// MLA backend (what VLLM_MLA_DISABLE=1 does; that variable in the environment turns it on
    /// too: 0 or unset is off, another integer on, anything else an error).
    #[arg(long)]
    pub mla_disable: bool,
    /// Attention path of the prefill (default naive, as production backends run it).
    #[arg(long, value_enum)]
    pub prefill_path: Option<PathArg>,
    /// Attention path of decode steps (default absorbed).
    #[arg(long, value_enum)]
    pub decode_path: Option<PathArg>,
    /// Plant a fault: NAME, NAME@prefill, NAME@decode or NAME@both (repeatable: each adds one).
    /// Names: output-buffer-disconnect, softmax-scale-latent, absorb-wrong-split,
    /// rope-noninterleaved, lse-base-mismatch, skip-padded-rows and kv-cache-off-by-one (these two
    /// default to decode), q4k-scale-unpack. A fault with nothing to act on in the run is
    /// reported as such.
    #[arg(long = "inject")]
    pub inject: Vec<String>,
    /// Storage of values: f32, or bf16 (f32 arithmetic, every op's output stored as bf16).
    /// Default: bf16 on CUDA, f32 on the CPU.
    #[arg(long)]
    pub dtype: Option<String>,
    /// Dequantize kv_b_proj at load instead of through the identity matrix (needs quantized
    /// weights to act on).
    #[arg(long)]
    pub force_dequant: bool,
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

impl FlagArgs {
    /// The flags for a run on `device`, `VLLM_MLA_DISABLE` included.
    pub fn flags(&self, device: DeviceArg) -> Result<Flags> {
        self.flags_with_env(device, vllm_mla_disable()?)
    }

    /// The flags for a run on `device`, with MLA disable also on when `env_mla_disable`
    /// (`VLLM_MLA_DISABLE`) says so.
    pub fn flags_with_env(&self, device: DeviceArg, env_mla_disable: bool) -> Result<Flags> {
        let mut flags = Flags::default();
        if self.mla_disable || env_mla_disable {
            let absorbed = [
                (self.prefill_path, "--prefill-path"),
                (self.decode_path, "--decode-path"),
            ]
            .into_iter()
            .find(|(p, _)| *p == Some(PathArg::Absorbed));
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
            flags.prefill_path = p.into();
        }
        if let Some(p) = self.decode_path {
            flags.decode_path = p.into();
        }
        for spec in &self.inject {
            flags
                .set("inject", spec)
                .map_err(|e| Error::invalid(format!("--inject: {e}")))?;
        }
        let default_dtype = if device == DeviceArg::Cuda {
            "bf16"
        } else {
            "f32"
        };
        flags
            .set("dtype", self.dtype.as_deref().unwrap_or(default_dtype))
            .map_err(|e| Error::invalid(format!("--dtype: {e}")))?;
        if device == DeviceArg::Cuda {
            flags.device = crate::debug::flags::DeviceFlag::Cuda;
        }
        if self.force_dequant {
            flags.set("force-dequant", "on")?;
        }
        Ok(flags)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PathArg {
    Naive,
    Absorbed,
}

impl From<PathArg> for MlaPath {
    fn from(p: PathArg) -> MlaPath {
        match p {
            PathArg::Naive => MlaPath::Naive,
            PathArg::Absorbed => MlaPath::Absorbed,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    Cpu,
    Cuda,
    Auto,
}

impl From<DeviceArg> for DeviceChoice {
    fn from(d: DeviceArg) -> DeviceChoice {
        match d {
            DeviceArg::Cpu => DeviceChoice::Cpu,
            DeviceArg::Cuda => DeviceChoice::Cuda,
            DeviceArg::Auto => DeviceChoice::Auto,
        }
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
    fn the_help_states_the_defaults_the_code_runs() {
        use clap::CommandFactory;
        let mut cli = crate::cli::Cli::command();
        let run = cli.find_subcommand_mut("run").unwrap();
        let help = run.render_long_help().to_string();
        for needle in [
            format!("a {DEFAULT_PROMPT_TOKENS}-token prompt"),
            format!("{DEFAULT_PREFILL} tokens (one less than the DSA top-k"),
            format!("(default {DEFAULT_DECODE_STEPS}; 0 for none)"),
        ] {
            assert!(help.contains(&needle), "'{needle}' in {help}");
        }
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
        let mut args = FlagArgs::default();
        assert!(
            args.flags_with_env(DeviceArg::Cpu, true)
                .unwrap()
                .mla_disable
        );
        assert!(
            !args
                .flags_with_env(DeviceArg::Cpu, false)
                .unwrap()
                .mla_disable
        );
        args.decode_path = Some(PathArg::Absorbed);
        let e = args
            .flags_with_env(DeviceArg::Cpu, true)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("VLLM_MLA_DISABLE=1") && e.contains("--decode-path absorbed"),
            "{e}"
        );
        assert!(
            !args
                .flags_with_env(DeviceArg::Cpu, false)
                .unwrap()
                .mla_disable
        );
    }

    #[test]
    fn token_lists() {
        assert_eq!(parse_tokens("3,141, 59").unwrap(), vec![3, 141, 59]);
        assert!(parse_tokens("3,,4").is_err());
        assert!(parse_tokens("-1").is_err());
    }
}
