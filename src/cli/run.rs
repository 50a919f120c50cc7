//! `mladb run`: a headless forward pass that prints the op trace (a table, or JSON lines).

use super::args::{FlagArgs, RecordArgs, RunSetup};
use super::dump::DumpCollector;
use super::table;
use crate::debug::external::DumpMeta;
use crate::debug::idle::{idle_flags, KvBStorage};
use crate::debug::quant::{kv_b_report, LayerQuantReport};
use crate::debug::runner::Job;
use crate::engine::generate;
use crate::engine::{Engine, Observer, OpEvent};
use crate::error::{Error, Result};
use crate::model::tokenizer::shown;
use crate::session::recorded::{
    sample_of, RecordedOp, RecordedOutcome, RecordedRun, RunRole, TokenText,
};
use crate::session::Session;
use crate::tensor::Tensor;
use clap::Args;
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    #[command(flatten)]
    pub setup: RunSetup,
    #[command(flatten)]
    pub flags: FlagArgs,
    /// Print one JSON object per op event, then a summary object.
    #[arg(long)]
    pub json: bool,
    /// Write every op output as F32 tensors named PHASE/OPNAME to this safetensors file.
    #[arg(long)]
    pub dump: Option<PathBuf>,
    #[command(flatten)]
    pub record: RecordArgs,
}

impl RunArgs {
    /// What a bare `mladb` runs: glm5-tiny with the default schedule.
    pub fn default_demo() -> RunArgs {
        RunArgs {
            setup: RunSetup::with_layout("glm5-tiny"),
            flags: FlagArgs::default(),
            json: false,
            dump: None,
            record: RecordArgs::default(),
        }
    }
}

/// Prints each event as it arrives and collects outputs for a dump.
struct RunObserver<'a> {
    json: bool,
    out: &'a mut dyn Write,
    dump: Option<DumpCollector>,
    events: usize,
    /// Every event, for the report of flags that had nothing to act on.
    trace: Vec<OpEvent>,
    /// `--record`: every op with a sample of its values (and the outputs, with
    /// `--record-tensors`).
    record: Option<Vec<RecordedOp>>,
    record_outputs: Option<Vec<Arc<Tensor>>>,
}

impl Observer for RunObserver<'_> {
    fn on_op(&mut self, event: &OpEvent, output: &Tensor) -> Result<()> {
        self.events += 1;
        self.trace.push(event.clone());
        let line = if self.json {
            let mut v = serde_json::to_value(event).map_err(|e| Error::invalid(e.to_string()))?;
            v["type"] = json!("op");
            v.to_string()
        } else {
            match &event.kernel {
                // Attention on the GPU: which kernels ran it, on the line below.
                Some(k) => format!("{}\n{:>16}↳ {k}", table::row(event), ""),
                None => table::row(event),
            }
        };
        writeln!(self.out, "{line}").map_err(Error::stdout)?;
        if let Some(d) = &mut self.dump {
            d.add(event, output);
        }
        if let Some(r) = &mut self.record {
            r.push(RecordedOp {
                event: event.clone(),
                sample: sample_of(output.data()),
            });
        }
        if let Some(r) = &mut self.record_outputs {
            r.push(Arc::new(output.clone()));
        }
        Ok(())
    }

    /// Lines may come a few hundred ops late unless the outputs are read (`--dump`, `--record`).
    fn takes_late_events(&self) -> bool {
        self.dump.is_none() && self.record.is_none() && self.record_outputs.is_none()
    }
}

pub fn run(args: &RunArgs) -> Result<()> {
    let stdout = std::io::stdout();
    let mut lock = stdout.lock();
    run_to(args, &mut lock)
}

/// `mladb run` writing to `out`.
pub fn run_to(args: &RunArgs, out: &mut dyn Write) -> Result<()> {
    if let Some(path) = &args.dump {
        crate::fsutil::check_output(path)?;
    }
    args.record.check_outputs()?;
    let flags = args.flags.flags(args.setup.device)?;
    if flags.mla_disable && super::args::vllm_mla_disable()? {
        eprintln!("note: {}", super::args::VLLM_MLA_DISABLE_NOTE);
    }
    let p = args.setup.prepare(&flags)?;
    let (model, schedule, layers) = (&p.model, &p.schedule, &p.layers);
    let layout = &model.layout;
    let options = flags.engine_options(layers.clone(), false)?;
    let mut engine = Engine::new(model, p.backend.as_ref(), options)?;
    let io = Error::stdout;
    if !args.json {
        writeln!(
            out,
            "mladb run: {} ({} layers {}..{} of {}, {:.3e} parameters) from {}, device {}\nflags: {flags}",
            layout.name,
            layers.len(),
            layers.start,
            layers.end,
            layout.num_layers,
            layout.parameter_count() as f64,
            model.weights.describe(),
            p.backend.name(),
        )
        .map_err(io)?;
        if let Some(note) = engine.ranks_note() {
            writeln!(out, "tensor parallel: {note}").map_err(io)?;
        }
        writeln!(out, "{}", table::header()).map_err(io)?;
    }
    let mut observer = RunObserver {
        json: args.json,
        out,
        dump: args.dump.as_ref().map(|_| DumpCollector::default()),
        events: 0,
        trace: Vec::new(),
        record: args.record.record.as_ref().map(|_| Vec::new()),
        record_outputs: args.record.record_tensors.then(Vec::new),
    };
    let run_start = Instant::now();
    let outcome = generate::run(&mut engine, schedule, &mut observer)?;
    let run_seconds = run_start.elapsed().as_secs_f64();
    let events = observer.events;
    let text = p
        .text
        .as_ref()
        .map(|codec| TokenText::of(codec, &schedule.prompt, &outcome.generated));
    let kv_b = KvBStorage::of(model, layers)?;
    let idle = idle_flags(&flags, &kv_b, &observer.trace, true);
    if let (Some(path), Some(dump)) = (&args.dump, &observer.dump) {
        let model_text = super::dump::model_text(&args.setup.source()?);
        let meta = DumpMeta::of_mladb(schedule, &outcome.generated, model_text, &flags);
        dump.write(path, &meta)?;
    }
    if let (Some(path), Some(ops)) = (&args.record.record, observer.record.take()) {
        let mut session = Session::new(args.setup.source()?, schedule);
        session.layers = (layers.start, layers.end);
        session.describe_model(model);
        session.flags = flags;
        session.runs.push(RecordedRun {
            role: RunRole::Main,
            flags,
            poison: false,
            schedule: None,
            first_affected: None,
            started_at: 1.min(ops.len()),
            compared_with: None,
            outcome: Some(RecordedOutcome {
                text: text.clone(),
                ..RecordedOutcome::from(&outcome)
            }),
            error: None,
            forced: Vec::new(),
            ops,
        });
        match observer.record_outputs.take() {
            Some(outputs) => session.save_with_tensors(path, &[outputs])?,
            None => session.save(path)?,
        }
    }
    let out = observer.out;
    if args.json {
        let summary = json!({
            "type": "summary",
            "layout": layout.name,
            "source": model.weights.describe(),
            "device": p.backend.name(),
            "flags": flags,
            "layers": [layers.start, layers.end],
            "prompt": schedule.prompt,
            "prefill": schedule.prefill_len,
            "generated": outcome.generated_or_none(),
            "generated_non_finite": outcome.non_finite,
            "next_token": (!outcome.next_non_finite).then_some(outcome.next_token),
            "next_logit": outcome.next_logit,
            "prompt_text": text.as_ref().map(|t| &t.prompt),
            "generated_text": text.as_ref().map(|t| &t.generated),
            "events": events,
            "kv_cache_bytes": engine.cache_bytes(),
            "load_seconds": p.load_seconds,
            "run_seconds": run_seconds,
            "dump": args.dump,
            "idle": idle
                .iter()
                .map(|i| json!({ "flag": i.subject.to_string(), "why": i.why }))
                .collect::<Vec<_>>(),
        });
        writeln!(out, "{summary}").map_err(io)?;
    } else {
        writeln!(
            out,
            "\n{events} ops; prompt {:?} (prefill {}), generated {}, next token {}{}; KV caches {} bytes; {:.3}s",
            schedule.prompt,
            schedule.prefill_len,
            outcome.generated_text(),
            outcome.next_text(),
            if outcome.next_non_finite {
                String::new()
            } else {
                format!(" (logit {:.4})", outcome.next_logit)
            },
            engine.cache_bytes(),
            run_seconds
        )
        .map_err(io)?;
        if let Some(t) = &text {
            writeln!(
                out,
                "text: {} -> {}",
                shown(&t.prompt),
                t.generated
                    .iter()
                    .map(|g| shown(g))
                    .collect::<Vec<_>>()
                    .join(" ")
            )
            .map_err(io)?;
        }
        if let Some(p) = &args.dump {
            writeln!(out, "dumped {events} tensors to {}", p.display()).map_err(io)?;
        }
        for i in &idle {
            eprintln!("note: {i}");
        }
    }
    if model.has_quantized_kv_b() {
        let job = Job {
            model,
            backend: p.backend.as_ref(),
            schedule,
            layers,
            poison: false,
        };
        let report = kv_b_report(&job, flags)?;
        write_kv_b_report(out, &report, args.json).map_err(io)?;
    }
    Ok(())
}

/// Max, mean and the worst head of per-head figures.
fn summary(v: &[f64]) -> (f64, f64, usize) {
    let (mut worst, mut at) = (0.0, 0);
    for (h, &x) in v.iter().enumerate() {
        if x > worst || x.is_nan() {
            (worst, at) = (x, h);
        }
    }
    (worst, v.iter().sum::<f64>() / v.len().max(1) as f64, at)
}

/// The quantized kv_b_proj section: per layer, how far W_UK / W_UV through the identity matrix
/// are from force-dequantized ones, and how far the attention outputs of the two routes are.
fn write_kv_b_report(
    out: &mut dyn Write,
    report: &[LayerQuantReport],
    json: bool,
) -> std::io::Result<()> {
    if json {
        for r in report {
            let line = json!({
                "type": "kv_b_quant",
                "layer": r.layer,
                "ggml_type": r.ty.name(),
                "w_uk_rel_l2_per_head": r.w_uk,
                "w_uv_rel_l2_per_head": r.w_uv,
                "attn_output_rel_l2_per_head": r.attn,
            });
            writeln!(out, "{line}")?;
        }
        return Ok(());
    }
    writeln!(
        out,
        "
quantized kv_b_proj: W_UK / W_UV through the identity matrix vs force-dequantized, and attn_output with each (relative L2 per head: max, mean, worst head)"
    )?;
    writeln!(
        out,
        "{:>5}  {:<6}  {:<30}  {:<30}  {:<30}",
        "layer", "type", "W_UK", "W_UV", "attn_output"
    )?;
    for r in report {
        let cell = |v: &[f64]| {
            let (max, mean, at) = summary(v);
            format!("{max:.2e} {mean:.2e} h{at}")
        };
        writeln!(
            out,
            "{:>5}  {:<6}  {:<30}  {:<30}  {:<30}",
            r.layer,
            r.ty.name(),
            cell(&r.w_uk),
            cell(&r.w_uv),
            cell(&r.attn)
        )?;
    }
    Ok(())
}
