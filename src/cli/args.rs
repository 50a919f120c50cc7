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
    /// Prefill the first K prompt tokens, then feed the rest one by one through decode
    /// (default: the whole prompt).
    #[arg(long)]
    pub prefill: Option<usize>,
    /// Greedy tokens to decode after the prompt (default 0; with --reference, the dump's).
    #[arg(long)]
    pub decode: Option<usize>,
    /// Run only these decoder layers: A..B (half-open), A..=B or A.
    #[arg(long)]
    pub layers: Option<String>,
    /// cpu, cuda or auto (auto falls back to the CPU and says why).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
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
    pub fn with_layout(name: &str, decode: usize) -> RunSetup {
        RunSetup {
            model: ModelArgs::with_layout(name),
            tokens: None,
            prefill: None,
            decode: Some(decode),
            layers: None,
            device: DeviceArg::Cpu,
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
        if flags.force_dequant && !model.has_quantized_kv_b() {
            eprintln!("note: {}", crate::debug::flags::FORCE_DEQUANT_IDLE);
        }
        let layout = &model.layout;
        let layers = match &self.layers {
            Some(text) => parse_layers(text, layout.num_layers)?,
            None => 0..layout.num_layers,
        };
        let prompt = match &self.tokens {
            Some(t) => parse_tokens(t)?,
            None => default_prompt(layout.vocab_size, 12),
        };
        if let Some(t) = prompt.iter().find(|&&t| t as usize >= layout.vocab_size) {
            return Err(Error::invalid(format!(
                "--tokens: token id {t} is out of the vocabulary of {} (vocab_size {})",
                layout.name, layout.vocab_size
            )));
        }
        let schedule = Schedule {
            prefill_len: self.prefill.unwrap_or(prompt.len()),
            prompt,
            decode_steps: self.decode.unwrap_or(0),
        };
        schedule.validate()?;
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

/// The debugging flags as options.
#[derive(Args, Debug, Clone, Default)]
pub struct FlagArgs {
    /// Disable MLA weight absorption: naive attention in prefill and decode, served around the
    /// MLA backend (what VLLM_MLA_DISABLE=1 does).
    #[arg(long)]
    pub mla_disable: bool,
    /// Attention path of the prefill (default naive, as production backends run it).
    #[arg(long, value_enum)]
    pub prefill_path: Option<PathArg>,
    /// Attention path of decode steps (default absorbed).
    #[arg(long, value_enum)]
    pub decode_path: Option<PathArg>,
    /// Plant a fault: NAME or NAME@prefill / NAME@decode (repeatable). Names:
    /// output-buffer-disconnect, softmax-scale-latent, absorb-wrong-split, rope-noninterleaved,
    /// lse-base-mismatch, skip-padded-rows, kv-cache-off-by-one.
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

impl FlagArgs {
    /// The flags for a run on `device`.
    pub fn flags(&self, device: DeviceArg) -> Result<Flags> {
        let mut flags = Flags::default();
        if self.mla_disable {
            if self.prefill_path == Some(PathArg::Absorbed)
                || self.decode_path == Some(PathArg::Absorbed)
            {
                return Err(Error::invalid(
                    "--mla-disable makes every path naive: it contradicts an absorbed path",
                ));
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
    fn token_lists() {
        assert_eq!(parse_tokens("3,141, 59").unwrap(), vec![3, 141, 59]);
        assert!(parse_tokens("3,,4").is_err());
        assert!(parse_tokens("-1").is_err());
    }
}
