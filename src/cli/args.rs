//! The options shared by the commands that build a model, as clap parses them. Each converts
//! into the plain types of [`crate::setup`], which loads the model and prepares the run for
//! every front end alike.

use crate::backend::DeviceChoice;
use crate::debug::Flags;
use crate::engine::MlaPath;
use crate::error::Result;
use crate::model::Model;
use crate::setup::{FlagOptions, ModelSpec, RunSpec};
use clap::{Args, ValueEnum};
use std::path::PathBuf;

pub use crate::setup::{
    default_prompt, parse_layers, parse_tokens, parse_tokens_for, parse_vllm_mla_disable,
    schedule_with_defaults, vllm_mla_disable, Prepared, DEFAULT_DECODE_STEPS, DEFAULT_PREFILL,
    DEFAULT_PROMPT_TOKENS, VLLM_MLA_DISABLE_NOTE,
};

/// Where the model comes from.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Built-in layout name (glm5, glm5-tiny, glm5-tiny-wide, glm5-rank8, deepseek-v3, deepseek-v3-tiny, deepseek-v3-rank16) or a .ron file;
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
    #[arg(long, default_value_t = crate::setup::DEFAULT_WEIGHT_CACHE_MB)]
    pub weight_cache_mb: usize,
    /// Device memory for keeping weights between steps on a GPU run, in GB (default: the
    /// device's free memory less an eighth of its total, at least 4 GiB, for activations and
    /// caches). Weights made on the GPU are bounded by this alone.
    #[arg(long, value_parser = parse_gb)]
    pub device_cache_gb: Option<f64>,
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
            weight_cache_mb: crate::setup::DEFAULT_WEIGHT_CACHE_MB,
            device_cache_gb: None,
            quant: None,
        }
    }

    /// The options as [`crate::setup`] takes them.
    pub fn spec(&self) -> ModelSpec {
        ModelSpec {
            layout: self.layout.clone(),
            model: self.model.clone(),
            seed: self.seed,
            weight_cache_mb: self.weight_cache_mb,
            device_cache_gb: self.device_cache_gb,
            quant: self.quant.clone(),
        }
    }

    /// Builds the model: an HF checkpoint, or a layout (default glm5-tiny) with synthetic weights.
    pub fn load(&self) -> Result<Model> {
        self.spec().load()
    }

    /// The `--quant` type, if given.
    pub fn quant_type(&self) -> Result<Option<crate::gguf::GgmlType>> {
        self.spec().quant_type()
    }
}

/// The model, the tokens and the layers of a run: what `run`, `check` and `bisect` share.
#[derive(Args, Debug, Clone)]
pub struct RunSetup {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt token ids, comma-separated (default: a 12-token prompt that fits the vocabulary).
    #[arg(long, conflicts_with = "prompt")]
    pub tokens: Option<String>,
    /// Prompt text, turned into token ids by the tokenizer (--tokenizer, or the checkpoint's
    /// tokenizer.json); generated tokens are then shown as text too.
    #[arg(long)]
    pub prompt: Option<String>,
    /// An HF tokenizer.json (default: the --model directory's, when it has one).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
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

impl RunSetup {
    /// A run of a built-in layout with the default schedule.
    pub fn with_layout(name: &str) -> RunSetup {
        RunSetup {
            model: ModelArgs::with_layout(name),
            tokens: None,
            prompt: None,
            tokenizer: None,
            prefill: None,
            decode: None,
            layers: None,
            device: DeviceArg::Cpu,
            max_memory_gb: None,
        }
    }

    /// The options as [`crate::setup`] takes them.
    pub fn spec(&self) -> RunSpec {
        RunSpec {
            model: self.model.spec(),
            tokens: self.tokens.clone(),
            prompt: self.prompt.clone(),
            tokenizer: self.tokenizer.clone(),
            prefill: self.prefill,
            decode: self.decode,
            layers: self.layers.clone(),
            device: self.device.into(),
            max_memory_gb: self.max_memory_gb,
            held_bytes: 0,
        }
    }

    /// Loads the model and checks the schedule against it; the device stores values as `flags.dtype`.
    pub fn prepare(&self, flags: &Flags) -> Result<Prepared> {
        self.spec().prepare(flags)
    }

    /// Where the model comes from, as a session records it.
    pub fn source(&self) -> Result<crate::session::ModelSource> {
        self.spec().source()
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
    /// default to decode); in the fast GPU kernels alone, exp2-scale, kv-stride-mismatch and
    /// page-index-overflow; seen only against a --reference, indexer-rope-layout and
    /// yarn-mscale; q4k-scale-unpack (with --quant q4_k or a Q4_K file); fp8-scale-default and
    /// fp8-amax-padded-rows (with --kv-cache-dtype fp8_ds_mla); tp-head-offset,
    /// tp-missing-allreduce, tp-double-reduce and tp-absorb-unsliced (with --tp 2 or more). A
    /// fault with nothing to act on in the run is reported as such.
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
    /// The attention kernels on the GPU: fast (the tensor-core MLA decode over the paged latent
    /// cache and the flash prefill, as production runs them; the default) or reference (simple
    /// kernels that also write the probabilities). The CPU has the reference alone.
    #[arg(long)]
    pub attn_kernel: Option<String>,
    /// Force a decode kernel variant (wgmma, kt3, ks3, ks2, kt16, t32, t16; h8 over an fp8_ds_mla
    /// cache or a sparse selection, h16 over an fp8_ds_mla cache) instead of the first the
    /// device runs.
    #[arg(long)]
    pub decode_variant: Option<String>,
    /// Force a prefill kernel variant (wgmma, k128t64, r128t64, k64t32, r64t64, r128t32,
    /// r64t32) instead of the first the device runs.
    #[arg(long)]
    pub prefill_variant: Option<String>,
    /// How the latent cache stores each token: bf16 (the default) or fp8_ds_mla (656 bytes:
    /// the 512 latent values as E4M3 in four tiles of 128 with one f32 scale each, then the 64
    /// RoPE values in bf16), as production serves GLM-5. Needs kv_lora_rank 512 and
    /// qk_rope_head_dim 64 (glm5, glm5-rank8).
    #[arg(long)]
    pub kv_cache_dtype: Option<String>,
    /// Tensor parallelism over N ranks, sharded as vLLM shards MLA models (heads of q_b_proj,
    /// kv_b_proj and o_proj; experts; the MLP's columns; the vocabulary), run one rank after
    /// another in this process with exact collectives. The trace shows every rank's ops and
    /// the collectives; `check` compares each rank with the run on one rank (tp-mismatch).
    #[arg(long)]
    pub tp: Option<String>,
    /// An op for each chosen routed expert in the trace (`mlp.experts.E`: the down projection
    /// of the tokens routed to it, before their routing weights), before their weighted sum.
    #[arg(long)]
    pub expert_ops: bool,
}

impl FlagArgs {
    /// The options as [`crate::setup`] takes them.
    pub fn options(&self) -> FlagOptions {
        FlagOptions {
            mla_disable: self.mla_disable,
            prefill_path: self.prefill_path.map(MlaPath::from),
            decode_path: self.decode_path.map(MlaPath::from),
            inject: self.inject.clone(),
            dtype: self.dtype.clone(),
            force_dequant: self.force_dequant,
            attn_kernel: self.attn_kernel.clone(),
            decode_variant: self.decode_variant.clone(),
            prefill_variant: self.prefill_variant.clone(),
            kv_cache_dtype: self.kv_cache_dtype.clone(),
            expert_ops: self.expert_ops,
            tp: self.tp.clone(),
        }
    }

    /// The flags for a run on `device`, `VLLM_MLA_DISABLE` included.
    pub fn flags(&self, device: DeviceArg) -> Result<Flags> {
        self.options().flags(device.into())
    }

    /// The flags for a run on `device`, with MLA disable also on when `env_mla_disable`
    /// (`VLLM_MLA_DISABLE`) says so.
    pub fn flags_with_env(&self, device: DeviceArg, env_mla_disable: bool) -> Result<Flags> {
        self.options()
            .flags_with_env(device.into(), env_mla_disable)
    }
}

/// The options of `mladb tui` (and of the bare `mladb`), as clap parses them;
/// [`crate::tui::TuiArgs`] is what the debugger takes.
#[derive(Args, Debug, Clone)]
pub struct TuiArgs {
    #[command(flatten)]
    pub setup: RunSetup,
    #[command(flatten)]
    pub flags: FlagArgs,
    /// Key bindings to override, as RON (default: $MLADB_KEYS or ~/.config/mladb/keys.ron).
    #[arg(long)]
    pub keys: Option<PathBuf>,
    /// A reference dump (tools/hf_dump.py, `mladb import`, `run --dump`) every run is compared
    /// with: a column in the tree and a section in the Compare pane. The run takes its tokens.
    #[arg(long)]
    pub reference: Option<PathBuf>,
    /// How the reference's names map to mladb's: hf, vllm, sglang, llamacpp or a RON file
    /// (default: none for mladb's own dumps and imports, hf for others).
    #[arg(long, requires = "reference")]
    pub name_map: Option<String>,
}

impl TuiArgs {
    /// The options as the debugger takes them.
    pub fn options(&self) -> crate::tui::TuiArgs {
        crate::tui::TuiArgs {
            setup: self.setup.spec(),
            flags: self.flags.options(),
            keys: self.keys.clone(),
            reference: self.reference.clone(),
            name_map: self.name_map.clone(),
        }
    }

    /// Loads everything the debugger needs; errors here end the program before the screen changes.
    pub fn spec(&self) -> Result<crate::service::HostSpec> {
        self.options().spec()
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
            DeviceArg::Auto => DeviceChoice::Auto.resolved(),
        }
    }
}

/// A size in GB: a finite number, zero or more, at most 1 PB.
fn parse_gb(text: &str) -> std::result::Result<f64, String> {
    match text.parse::<f64>() {
        Ok(gb) if gb.is_finite() && (0.0..=1e6).contains(&gb) => Ok(gb),
        _ => Err(format!(
            "'{text}' is not a size in GB (a number from 0 to 1000000)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn the_options_reach_the_setup_unchanged() {
        let mut args = FlagArgs {
            decode_path: Some(PathArg::Absorbed),
            ..FlagArgs::default()
        };
        let e = args
            .flags_with_env(DeviceArg::Cpu, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--decode-path absorbed"), "{e}");
        args.decode_path = None;
        args.inject = vec!["softmax-scale-latent@decode".into()];
        let flags = args.flags_with_env(DeviceArg::Cuda, false).unwrap();
        assert_eq!(flags.device, crate::debug::flags::DeviceFlag::Cuda);
        assert_eq!(flags.faults.to_string(), "softmax-scale-latent@decode");
        let setup = RunSetup::with_layout("glm5-tiny");
        assert_eq!(setup.spec(), RunSpec::with_layout("glm5-tiny"));
    }

    #[test]
    fn a_device_cache_size_is_a_finite_number_of_gb() {
        assert_eq!(parse_gb("80"), Ok(80.0));
        assert_eq!(parse_gb("0.5"), Ok(0.5));
        for bad in ["-1", "nan", "inf", "1e9", "lots", ""] {
            assert!(parse_gb(bad).is_err(), "{bad}");
        }
    }
}
