//! `mladb import PATH... --out DUMP.safetensors`: another engine's recorded tensors as one dump
//! with mladb's op names and metadata ([`crate::attach::import`]), for `check --reference` and
//! `bisect --reference`. PATH is the hook's frame files (`mladb_hook.attach(model,
//! "file:rank0.frames")`, one per rank, or a directory of them; `attach --save` keeps the same)
//! or an SGLang dumper directory.

use clap::Args;
use std::path::PathBuf;

use super::args::ModelArgs;
use super::dump::{model_text, write_dump};
use super::Out;
use crate::attach::import::{ImportOutcome, Importer};
use crate::attach::record::{frame_files, import_frames};
use crate::attach::sglang_dump;
use crate::attach::wire::Limits;
use crate::error::{Error, Result};
use crate::tensor_file::F32Tensor;

#[derive(Args, Debug, Clone)]
pub struct ImportArgs {
    /// The recordings: hook frame files (or directories of .frames files), one per rank, or
    /// one SGLang dumper directory (DUMPER_DIR, or one experiment in it).
    #[arg(required = true, num_args = 1..)]
    pub paths: Vec<PathBuf>,
    /// The dump to write (safetensors, F32, keys PHASE/OP).
    #[arg(long)]
    pub out: PathBuf,
    /// The model the engine ran: the name map's fused outputs are cut by its widths.
    #[command(flatten)]
    pub model: ModelArgs,
    /// How the engine's module names map to mladb's: hf, vllm, sglang, llamacpp (built in) or
    /// a RON file (default: the map of the engine the recording names).
    #[arg(long)]
    pub name_map: Option<String>,
    /// The largest tensor a frame may carry, in MiB.
    #[arg(long, default_value_t = 1024)]
    pub max_frame_mb: u64,
}

/// Imports; returns whether a wrapper handed on another buffer than its kernel wrote (the one
/// finding an import can make without a reference).
pub fn run(args: &ImportArgs) -> Result<bool> {
    if args.model.layout.is_none() && args.model.model.is_none() {
        return Err(Error::invalid(
            "import needs the engine's model: --model DIR or --layout NAME (fused outputs are cut by its widths)",
        ));
    }
    let spec = args.model.spec();
    let model = spec.load()?;
    let map = args
        .name_map
        .as_deref()
        .map(crate::debug::name_map::NameMap::resolve)
        .transpose()?;
    let mut importer = Importer::new(&model.layout, map);
    let mut sglang = Vec::new();
    for p in args.paths.iter().filter(|p| p.is_dir()) {
        let files = sglang_dump::dumper_files(p)?;
        if !files.is_empty() {
            sglang.push((p, files));
        }
    }
    let source = args
        .paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(" ");
    let mut skipped = 0;
    match sglang.as_mut_slice() {
        [] => {
            let limits = Limits {
                max_payload: args
                    .max_frame_mb
                    .checked_mul(1 << 20)
                    .filter(|&b| b > 0)
                    .ok_or_else(|| Error::invalid("--max-frame-mb is out of range"))?,
                ..Limits::default()
            };
            for file in frame_files(&args.paths)? {
                let dropped = import_frames(&mut importer, &file, limits)?;
                if dropped > 0 {
                    eprintln!(
                        "note: {}: the hook dropped {dropped} tensors (its queue was full): they are not in the dump",
                        file.display()
                    );
                }
            }
        }
        [(dir, files)] if args.paths.len() == 1 => {
            let (ranks, left) = sglang_dump::records(dir, std::mem::take(files))?;
            skipped = left;
            for (rank, records) in ranks {
                let mut cursor = None;
                let name = format!("{} rank {rank}", dir.display());
                for r in records {
                    importer.take(&mut cursor, r, &name)?;
                }
            }
        }
        _ => {
            return Err(Error::invalid(
                "import takes one SGLang dumper directory, or hook frame files: not several directories or both",
            ))
        }
    }
    let mut outcome = importer.finish(&source)?;
    if outcome.meta.model.is_empty() {
        outcome.meta.model = model_text(&spec.source()?);
    }
    if skipped > 0 {
        outcome.notes.push(format!(
            "{skipped} dumper tensors are not module outputs (inputs, hand-placed dumps) and were left out"
        ));
    }
    write(&outcome, args)?;
    report(&outcome, args)?;
    Ok(!outcome.disconnects.is_empty())
}

/// The dump, written as `run --dump` writes its own (F32 tensors, the metadata, atomically).
fn write(outcome: &ImportOutcome, args: &ImportArgs) -> Result<()> {
    let tensors = outcome.tensors.iter().map(|t| F32Tensor {
        name: t.key.clone(),
        shape: &t.shape,
        data: &t.data,
    });
    write_dump(&args.out, &outcome.meta, tensors)
}

fn report(outcome: &ImportOutcome, args: &ImportArgs) -> Result<()> {
    let m = &outcome.meta;
    let decode_steps = m.tokens.len() - m.prefill;
    writeln!(
        Out,
        "mladb import: {} tensors ({}; a prefill of {} tokens and {decode_steps} decode steps{}) -> {}",
        outcome.tensors.len(),
        m.flags,
        m.prefill,
        if m.low_precision() { ", bf16" } else { "" },
        args.out.display()
    )?;
    for n in &outcome.notes {
        writeln!(Out, "note: {n}")?;
    }
    for d in &outcome.disconnects {
        writeln!(Out, "finding: buffer-disconnect: {d}")?;
    }
    writeln!(
        Out,
        "compare with: mladb check {} --reference {}",
        match (&args.model.model, &args.model.layout) {
            (Some(p), _) => format!("--model {}", p.display()),
            (None, Some(l)) => format!("--layout {l}"),
            _ => String::new(),
        },
        args.out.display()
    )?;
    Ok(())
}
