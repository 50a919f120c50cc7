//! `mladb run`: a headless forward pass that prints the op trace (a table, or JSON lines).

use super::args::{default_prompt, parse_layers, parse_tokens, DeviceArg, ModelArgs};
use super::dump::DumpCollector;
use super::table;
use crate::backend;
use crate::engine::generate::{self, Schedule};
use crate::engine::{Engine, EngineOptions, MlaPath, MlaPaths, Observer, OpEvent};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use clap::{Args, ValueEnum};
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt token ids, comma-separated (default: a 12-token prompt that fits the vocabulary).
    #[arg(long)]
    pub tokens: Option<String>,
    /// Prefill the first K prompt tokens, then feed the rest one by one through decode
    /// (default: the whole prompt).
    #[arg(long)]
    pub prefill: Option<usize>,
    /// Greedy tokens to decode after the prompt.
    #[arg(long, default_value_t = 0)]
    pub decode: usize,
    /// cpu, cuda or auto (auto falls back to the CPU and says why).
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Disable MLA weight absorption: naive attention in prefill and decode.
    #[arg(long)]
    pub mla_disable: bool,
    /// Attention path of the prefill (default naive, as production backends run it).
    #[arg(long, value_enum)]
    pub prefill_path: Option<PathArg>,
    /// Attention path of decode steps (default absorbed).
    #[arg(long, value_enum)]
    pub decode_path: Option<PathArg>,
    /// Run only these decoder layers: A..B (half-open), A..=B or A.
    #[arg(long)]
    pub layers: Option<String>,
    /// Print one JSON object per op event, then a summary object.
    #[arg(long)]
    pub json: bool,
    /// Write every op output as F32 tensors named PHASE/OPNAME to this safetensors file.
    #[arg(long)]
    pub dump: Option<PathBuf>,
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

impl RunArgs {
    /// What a bare `mladb` runs: glm5-tiny, a prompt long enough for sparse attention, 4 decode
    /// steps.
    pub fn default_demo() -> RunArgs {
        RunArgs {
            model: ModelArgs::with_layout("glm5-tiny"),
            tokens: None,
            prefill: None,
            decode: 4,
            device: DeviceArg::Cpu,
            mla_disable: false,
            prefill_path: None,
            decode_path: None,
            layers: None,
            json: false,
            dump: None,
        }
    }

    pub fn paths(&self) -> Result<MlaPaths> {
        if self.mla_disable {
            if self.prefill_path == Some(PathArg::Absorbed)
                || self.decode_path == Some(PathArg::Absorbed)
            {
                return Err(Error::invalid(
                    "--mla-disable makes every path naive: it contradicts an absorbed path",
                ));
            }
            return Ok(MlaPaths::disabled());
        }
        let mut paths = MlaPaths::production();
        if let Some(p) = self.prefill_path {
            paths.prefill = p.into();
        }
        if let Some(p) = self.decode_path {
            paths.decode = p.into();
        }
        Ok(paths)
    }
}

/// Prints each event as it arrives and collects outputs for a dump.
struct RunObserver<'a> {
    json: bool,
    out: &'a mut dyn Write,
    dump: Option<DumpCollector>,
    events: usize,
}

impl Observer for RunObserver<'_> {
    fn on_op(&mut self, event: &OpEvent, output: &Tensor) -> Result<()> {
        self.events += 1;
        let line = if self.json {
            let mut v = serde_json::to_value(event).map_err(|e| Error::invalid(e.to_string()))?;
            v["type"] = json!("op");
            v.to_string()
        } else {
            table::row(event)
        };
        writeln!(self.out, "{line}").map_err(|e| Error::io("stdout", e))?;
        if let Some(d) = &mut self.dump {
            d.add(event, output);
        }
        Ok(())
    }
}

pub fn run(args: &RunArgs) -> Result<()> {
    let stdout = std::io::stdout();
    let mut lock = stdout.lock();
    run_to(args, &mut lock)
}

/// `mladb run` writing to `out` (the tests capture it).
pub fn run_to(args: &RunArgs, out: &mut dyn Write) -> Result<()> {
    let paths = args.paths()?;
    let (backend, note) = backend::select(args.device.into())?;
    if let Some(note) = note {
        eprintln!("{note}");
    }
    let load_start = Instant::now();
    let model = args.model.load()?;
    let load_seconds = load_start.elapsed().as_secs_f64();
    let layout = &model.layout;
    let layers = match &args.layers {
        Some(text) => parse_layers(text, layout.num_layers)?,
        None => 0..layout.num_layers,
    };
    let prompt = match &args.tokens {
        Some(t) => parse_tokens(t)?,
        None => default_prompt(layout.vocab_size, 12),
    };
    let schedule = Schedule {
        prefill_len: args.prefill.unwrap_or(prompt.len()),
        prompt,
        decode_steps: args.decode,
    };
    schedule.validate()?;
    if let Some(t) = schedule
        .prompt
        .iter()
        .find(|&&t| t as usize >= layout.vocab_size)
    {
        return Err(Error::invalid(format!(
            "--tokens: token id {t} is out of the vocabulary of {} (vocab_size {})",
            layout.name, layout.vocab_size
        )));
    }
    let mut engine = Engine::new(
        &model,
        backend.as_ref(),
        EngineOptions {
            layers: layers.clone(),
            ..EngineOptions::new(&model, paths)
        },
    )?;
    if !args.json {
        writeln!(
            out,
            "mladb run: {} ({} layers {}..{} of {}, {:.3e} parameters) from {}, device {}, prefill {:?} / decode {:?}",
            layout.name,
            layers.len(),
            layers.start,
            layers.end,
            layout.num_layers,
            layout.parameter_count() as f64,
            model.weights.describe(),
            backend.name(),
            paths.prefill,
            paths.decode
        )
        .map_err(|e| Error::io("stdout", e))?;
        writeln!(out, "{}", table::header()).map_err(|e| Error::io("stdout", e))?;
    }
    let mut observer = RunObserver {
        json: args.json,
        out,
        dump: args.dump.as_ref().map(|_| DumpCollector::default()),
        events: 0,
    };
    let run_start = Instant::now();
    let outcome = generate::run(&mut engine, &schedule, &mut observer)?;
    let run_seconds = run_start.elapsed().as_secs_f64();
    let events = observer.events;
    if let (Some(path), Some(dump)) = (&args.dump, &observer.dump) {
        dump.write(path)?;
    }
    let out = observer.out;
    let summary = json!({
        "type": "summary",
        "layout": layout.name,
        "source": model.weights.describe(),
        "device": backend.name(),
        "paths": paths,
        "layers": [layers.start, layers.end],
        "prompt": schedule.prompt,
        "prefill": schedule.prefill_len,
        "generated": outcome.generated,
        "next_token": outcome.next_token,
        "next_logit": outcome.next_logit,
        "events": events,
        "kv_cache_bytes": engine.cache_bytes(),
        "load_seconds": load_seconds,
        "run_seconds": run_seconds,
        "dump": args.dump,
    });
    if args.json {
        writeln!(out, "{summary}").map_err(|e| Error::io("stdout", e))?;
    } else {
        writeln!(
            out,
            "\n{events} ops; prompt {:?} (prefill {}), generated {:?}, next token {} (logit {:.4}); KV caches {} bytes; {:.3}s",
            schedule.prompt,
            schedule.prefill_len,
            outcome.generated,
            outcome.next_token,
            outcome.next_logit,
            engine.cache_bytes(),
            run_seconds
        )
        .map_err(|e| Error::io("stdout", e))?;
        if let Some(p) = &args.dump {
            writeln!(out, "dumped {events} tensors to {}", p.display())
                .map_err(|e| Error::io("stdout", e))?;
        }
    }
    Ok(())
}
