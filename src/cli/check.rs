//! `mladb check`: runs the detectors and prints their findings. Exit 0 when there are none, 1
//! when there are, 2 on bad input.

use super::args::{FlagArgs, RecordArgs, RunSetup};
use crate::debug::detect::{check, CheckOptions, CheckReport};
use crate::debug::external::{ExternalDump, NameMap};
use crate::debug::runner::Job;
use crate::error::{Error, Result};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug, Clone)]
pub struct CheckArgs {
    #[command(flatten)]
    pub setup: RunSetup,
    #[command(flatten)]
    pub flags: FlagArgs,
    /// A dump of activations to compare with (safetensors, keys PHASE/NAME): another engine's
    /// (tools/hf_dump.py writes one from transformers) or mladb's own `run --dump`.
    #[arg(long)]
    pub reference: Option<PathBuf>,
    /// How the reference's names map to mladb's: `hf` (built in; also right for mladb's own
    /// dumps) or a RON file of rules.
    #[arg(long, default_value = "hf")]
    pub name_map: String,
    /// Relative L2 tolerance of the comparisons (default 1e-4 for f32, 3e-2 for bf16).
    #[arg(long)]
    pub tolerance: Option<f64>,
    /// One JSON object per finding (then a summary object).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub record: RecordArgs,
}

/// Runs the check; returns whether anything was found.
pub fn run(args: &CheckArgs) -> Result<bool> {
    let flags = args.flags.flags(args.setup.device)?;
    if flags.mla_disable && super::args::vllm_mla_disable()? {
        eprintln!("note: {}", super::args::VLLM_MLA_DISABLE_NOTE);
    }
    if let Some(t) = args.tolerance {
        if !(t.is_finite() && t >= 0.0) {
            return Err(Error::invalid(format!(
                "--tolerance {t} is not a non-negative number"
            )));
        }
    }
    let reference = match &args.reference {
        Some(path) => Some(ExternalDump::load(
            path,
            &NameMap::resolve(&args.name_map)?,
        )?),
        None => None,
    };
    let p = args.setup.prepare(&flags)?;
    let job = Job {
        model: &p.model,
        backend: p.backend.as_ref(),
        schedule: &p.schedule,
        layers: &p.layers,
        poison: true,
    };
    let start = Instant::now();
    let report = check(
        &job,
        flags,
        &CheckOptions {
            tolerance: args.tolerance,
            reference,
        },
    )?;
    let seconds = start.elapsed().as_secs_f64();
    if let Some(path) = &args.record.record {
        use crate::session::recorded::{RecordedCheck, RecordedRun, RunRole};
        let mut session = crate::session::Session::new(args.setup.source()?, &p.schedule);
        session.layers = (p.layers.start, p.layers.end);
        session.describe_model(&p.model);
        session.flags = flags;
        let mut run = RecordedRun::of(&report.run, RunRole::Check, true);
        run.started_at = 1.min(run.ops.len());
        session.runs.push(run);
        session.check = Some(RecordedCheck {
            findings: report.findings.clone(),
            notes: report.notes.clone(),
            tolerance: report.tolerance,
        });
        if args.record.record_tensors {
            session.save_with_tensors(path, std::slice::from_ref(&report.run.outputs))?;
        } else {
            session.save(path)?;
        }
    }
    if args.json {
        print_json(&report, seconds);
    } else {
        print_text(&report, &p.model.layout.name, seconds);
    }
    Ok(!report.findings.is_empty())
}

fn print_json(report: &CheckReport, seconds: f64) {
    for f in &report.findings {
        let mut v = serde_json::to_value(f).expect("a finding serialises");
        v["type"] = json!("finding");
        println!("{v}");
    }
    println!(
        "{}",
        json!({
            "type": "summary",
            "findings": report.findings.len(),
            "notes": report.notes,
            "tolerance": report.tolerance,
            "ops": report.run.len(),
            "ops_executed": report.ops_executed,
            "seconds": seconds,
        })
    );
}

fn print_text(report: &CheckReport, layout: &str, seconds: f64) {
    println!(
        "mladb check: {layout}, {} ops, flags: {}; tolerance {:.0e}",
        report.run.len(),
        report.run.flags,
        report.tolerance
    );
    for n in &report.notes {
        println!("  note: {n}");
    }
    if report.findings.is_empty() {
        println!(
            "no findings ({} ops computed in {seconds:.2}s)",
            report.ops_executed
        );
        return;
    }
    println!("{:<26} {:<9} {:<48} detail", "finding", "phase", "op");
    for f in &report.findings {
        println!(
            "{:<26} {:<9} {:<48} {}",
            f.kind.to_string(),
            f.phase.to_string(),
            f.op,
            f.detail
        );
    }
    println!(
        "{} finding(s) ({} ops computed in {seconds:.2}s)",
        report.findings.len(),
        report.ops_executed
    );
}

#[derive(Args, Debug, Clone)]
pub struct BisectArgs {
    #[command(flatten)]
    pub setup: RunSetup,
    /// Flags of run A, the run examined: comma-separated FLAG or FLAG=VALUE (mla-disable,
    /// prefill-path=, decode-path=, dtype=, inject=NAME[@phase]). Empty: the defaults.
    #[arg(long, default_value = "")]
    pub a: String,
    /// Flags of run B, the reference run (fed A's tokens).
    #[arg(long, conflicts_with = "reference")]
    pub b: Option<String>,
    /// Bisect run A against a dump instead of run B.
    #[arg(long)]
    pub reference: Option<PathBuf>,
    /// Name map of the reference dump: `hf` or a RON file.
    #[arg(long, default_value = "hf")]
    pub name_map: String,
    /// Relative L2 tolerance (default 1e-4).
    #[arg(long, default_value_t = 1e-4)]
    pub tolerance: f64,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Runs bisect; returns whether an op diverged.
pub fn bisect(args: &BisectArgs) -> Result<bool> {
    use crate::debug::bisect::{bisect_dump, bisect_runs};
    use crate::debug::Flags;
    use crate::engine::generate::Schedule;
    let flags_a = Flags::parse(&args.a).map_err(|e| Error::invalid(format!("--a: {e}")))?;
    let flags_b = match (&args.b, &args.reference) {
        (Some(b), None) => Some(Flags::parse(b).map_err(|e| Error::invalid(format!("--b: {e}")))?),
        (None, Some(_)) => None,
        _ => return Err(Error::invalid("bisect needs --b FLAGS or --reference DUMP")),
    };
    if !(args.tolerance.is_finite() && args.tolerance >= 0.0) {
        return Err(Error::invalid(format!(
            "--tolerance {} is not a non-negative number",
            args.tolerance
        )));
    }
    let reference = match &args.reference {
        Some(path) => Some(ExternalDump::load(
            path,
            &NameMap::resolve(&args.name_map)?,
        )?),
        None => None,
    };
    if super::args::vllm_mla_disable()? {
        eprintln!("note: VLLM_MLA_DISABLE is ignored by bisect: --a and --b give each run's flags");
    }
    let p = args.setup.prepare(&flags_a)?;
    let heads = p.model.layout.num_heads;
    let job = Job {
        model: &p.model,
        backend: p.backend.as_ref(),
        schedule: &p.schedule,
        layers: &p.layers,
        poison: true,
    };
    let a = job.run(flags_a, None)?;
    let kv_b = crate::debug::idle::KvBStorage::of(&p.model, &p.layers)?;
    for line in crate::debug::idle::idle_lines(&flags_a, &kv_b, &a.events) {
        eprintln!("note: run A: {line}");
    }
    let (result, against) = match (flags_b, &reference) {
        (Some(fb), _) => {
            // B gets A's tokens, so the two differ only in their flags.
            let forced = Schedule {
                prompt: a
                    .outcome
                    .as_ref()
                    .map(|o| o.tokens.clone())
                    .unwrap_or_default(),
                prefill_len: p.schedule.prefill_len,
                decode_steps: 0,
            };
            let b = job.run_schedule(fb, &forced, None)?;
            (
                bisect_runs(&a, &b, heads, args.tolerance),
                format!("run B ({fb})"),
            )
        }
        (None, Some(dump)) => (
            bisect_dump(&a, dump, heads, args.tolerance),
            "the reference dump".to_string(),
        ),
        (None, None) => unreachable!("checked above"),
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&result).expect("a bisection serialises")
        );
        return Ok(result.first.is_some());
    }
    println!(
        "mladb bisect: run A ({flags_a}) against {against}; tolerance {:.0e}",
        args.tolerance
    );
    match &result.first {
        None => println!(
            "no op differs beyond tolerance ({} ops compared)",
            result.compared
        ),
        Some(first) => {
            if let Some(good) = &result.last_good {
                let figures = good.diff.as_ref().map(|d| d.summary()).unwrap_or_default();
                println!(
                    "last agreeing op:  #{} {} {}: {figures}",
                    good.index, good.phase, good.name
                );
            }
            let figures = first.diff.as_ref().map(|d| d.summary()).unwrap_or_default();
            println!(
                "first divergent:   #{} {} {}: {figures}",
                first.index, first.phase, first.name
            );
            println!(
                "{} of {} compared ops differ beyond tolerance",
                result.divergent, result.compared
            );
        }
    }
    Ok(result.first.is_some())
}
