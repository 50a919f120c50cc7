//! `mladb layout`: list the built-in layouts, describe one (or print it as RON), convert an HF
//! config.json, write a layout's synthetic weights as an HF checkpoint, or verify such a
//! checkpoint.

use super::Out;
use crate::error::Result;
use crate::model::export::{self, Counts, ExportDtype, ExportOptions};
use crate::model::hf_config::layout_from_config_file;
use crate::model::Layout;
use clap::{Args, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct LayoutArgs {
    #[command(subcommand)]
    pub action: LayoutAction,
}

#[derive(Subcommand, Debug, Clone)]
pub enum LayoutAction {
    /// List the built-in layouts.
    List,
    /// Describe a layout (built-in name or .ron file): sizes, attention, MoE, indexer, RoPE,
    /// norms.
    Show {
        layout: String,
        /// Print it as RON instead, a layout file that `--layout FILE` reads back as the same
        /// layout.
        #[arg(long)]
        ron: bool,
    },
    /// Convert an HF config.json (glm_moe_dsa or deepseek_v3) to a layout and print it as RON.
    Import { config: PathBuf },
    /// Write a layout's synthetic weights as an HF checkpoint directory (config.json, sharded
    /// safetensors, model.safetensors.index.json) with the model's real tensor names, in bf16
    /// or in block-scaled FP8 as the official FP8 checkpoints store it. Every tensor keeps its
    /// full-size shape; --layers, --first-dense, --experts and --vocab only make the model
    /// shorter. The directory appears whole or not at all.
    Export(ExportArgs),
    /// Check that an exported checkpoint, read through the loader, holds bit for bit the
    /// synthetic weights it was made from; any difference is an error naming the tensor.
    Verify {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The seed of the synthetic weights (default: the one the export recorded).
        #[arg(long)]
        seed: Option<u64>,
    },
}

/// A repeated option takes its last value, so that a script's preset can be overridden.
#[derive(Args, Debug, Clone)]
#[command(args_override_self = true)]
pub struct ExportArgs {
    /// Built-in layout name (glm5, deepseek-v3, ...) or a .ron file.
    #[arg(long)]
    pub layout: String,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep the first N decoder layers.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Make the first K layers dense and the rest MoE (default: the layout's plan).
    #[arg(long)]
    pub first_dense: Option<usize>,
    /// Keep E routed experts per MoE layer (at least the experts a token picks).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Keep the first V vocabulary entries (embedding and LM head rows).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Storage: bf16, or fp8 (E4M3 projections with f32 scales per 128×128 block; norms,
    /// router, indexer weights_proj, embeddings and LM head in bf16, the router bias in f32).
    #[arg(long, value_enum)]
    pub dtype: DtypeArg,
    /// About this many MiB per shard (a tensor larger than that has one of its own).
    #[arg(long, default_value_t = 4096)]
    pub shard_mb: u64,
    /// The directory to create (an existing one must be empty).
    pub out: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    Bf16,
    Fp8,
}

pub fn layout(args: &LayoutArgs) -> Result<()> {
    match &args.action {
        LayoutAction::List => {
            for name in Layout::builtin_names() {
                let l = Layout::resolve(name)?;
                writeln!(
                    Out,
                    "{name:<18} {:<11} {:>3} layers, hidden {:>5}, {:.3e} parameters",
                    super::layout_show::family_name(l.family),
                    l.num_layers,
                    l.hidden_size,
                    l.parameter_count() as f64
                )?;
            }
        }
        LayoutAction::Show { layout, ron } => {
            let l = Layout::resolve(layout)?;
            if *ron {
                writeln!(Out, "{}", l.to_ron())?
            } else {
                writeln!(Out, "{}", super::layout_show::summary(&l))?
            }
        }
        LayoutAction::Import { config } => {
            writeln!(Out, "{}", layout_from_config_file(config)?.to_ron())?
        }
        LayoutAction::Export(a) => export_checkpoint(a)?,
        LayoutAction::Verify { dir, seed } => {
            let v = export::verify(dir, *seed)?;
            writeln!(
                Out,
                "{}: {} tensors, {} values: the synthetic weights of seed {} stored as {} ({:.1}s)",
                dir.display(),
                v.tensors,
                v.values,
                v.seed,
                describe(v.dtype),
                v.seconds
            )?;
        }
    }
    Ok(())
}

fn describe(dtype: ExportDtype) -> String {
    match dtype {
        ExportDtype::Bf16 => "bf16".into(),
        ExportDtype::Fp8 { block } => format!("fp8, blocks of {}×{}", block[0], block[1]),
    }
}

fn export_checkpoint(a: &ExportArgs) -> Result<()> {
    let base = Layout::resolve(&a.layout)?;
    let counts = Counts {
        layers: a.layers,
        first_dense: a.first_dense,
        experts: a.experts,
        vocab: a.vocab,
    };
    let layout = export::shrink(&base, &counts)?;
    let dtype = match a.dtype {
        DtypeArg::Bf16 => ExportDtype::Bf16,
        DtypeArg::Fp8 => ExportDtype::FP8,
    };
    let options = ExportOptions {
        seed: a.seed,
        dtype,
        shard_bytes: a.shard_mb.saturating_mul(1 << 20),
    };
    let done = export::export(&layout, options, &a.out)?;
    let dense = (0..layout.num_layers)
        .filter(|&l| layout.mlp_kind(l) == crate::model::MlpKind::Dense)
        .count();
    let experts = layout
        .moe
        .as_ref()
        .map(|m| format!(", {} routed experts", m.n_routed_experts))
        .unwrap_or_default();
    writeln!(
        Out,
        "wrote {}: {} ({} layer{}, {dense} dense{experts}, vocabulary {}), seed {}, {}: {} tensors ({} FP8), {:.3e} parameters, {} in {} ({:.1}s)",
        a.out.display(),
        layout.name,
        layout.num_layers,
        if layout.num_layers == 1 { "" } else { "s" },
        layout.vocab_size,
        a.seed,
        describe(dtype),
        done.tensors,
        done.fp8_tensors,
        done.parameters as f64,
        crate::input::bytes(done.total_bytes),
        match done.shards {
            1 => "1 shard".to_string(),
            n => format!("{n} shards"),
        },
        done.seconds
    )?;
    Ok(())
}
