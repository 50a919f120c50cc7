//! `mladb check`: runs the detectors and prints their findings. Exit 0 when there are none, 1
//! when there are, 2 on bad input.

use super::args::{FlagArgs, RecordArgs, RunSetup};
use super::Out;
use crate::debug::detect::{check, CheckOptions, CheckReport};
use crate::debug::external::ExternalDump;
use crate::debug::runner::Job;
use crate::error::{Error, Result};
use crate::setup::RunSpec;
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
    /// (tools/hf_dump.py writes one from transformers) or mladb's own `run --dump`. The run
    /// takes the dump's tokens, prefill and decode count where they are not given.
    #[arg(long)]
    pub reference: Option<PathBuf>,
    /// How the reference's names map to mladb's: `hf` (built in) or a RON file of rules
    /// (default: none for mladb's own dumps, `hf` for others).
    #[arg(long)]
    pub name_map: Option<String>,
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
    args.record.check_outputs()?;
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
    let reference = load_reference(
        args.reference.as_deref(),
        args.name_map.as_deref(),
        args.setup.max_memory_gb,
    )?;
    let setup = setup_against(&args.setup, reference.as_ref())?;
    let p = setup.prepare(&flags)?;
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
        let mut session = crate::session::Session::new(setup.source()?, &p.schedule);
        session.layers = (p.layers.start, p.layers.end);
        session.describe_model(&p.model);
        session.flags = flags;
        let mut run = RecordedRun::of(&report.run, RunRole::Check, true);
        run.started_at = 1.min(run.ops.len());
        session.runs.push(run);
        let mut outputs = vec![report.run.outputs.clone()];
        for (aux, outs) in comparison_runs(&job, &report, flags)? {
            session.runs.push(aux);
            outputs.push(outs);
        }
        session.check = Some(RecordedCheck {
            findings: report.findings.clone(),
            notes: report
                .notes
                .iter()
                .cloned()
                .chain(report.selection_notes.iter().map(|n| n.to_string()))
                .collect(),
            tolerance: report.tolerances.floor_range().1,
        });
        if args.record.record_tensors {
            session.save_with_tensors(path, &outputs)?;
        } else {
            session.save(path)?;
        }
    }
    if args.json {
        print_json(&report, seconds)?;
    } else {
        print_text(&report, &p.model.layout.name, seconds)?;
    }
    Ok(!report.findings.is_empty())
}

/// The comparison runs behind check's absorbed-vs-naive and prefill-vs-decode verdicts, made
/// again as check made them (the same inputs give the same runs, forced choices included), so
/// that a replay's Compare pane shows them: each as a recorded run with its outputs.
fn comparison_runs(
    job: &Job,
    report: &CheckReport,
    flags: crate::debug::Flags,
) -> Result<
    Vec<(
        crate::session::recorded::RecordedRun,
        Vec<std::sync::Arc<crate::tensor::Tensor>>,
    )>,
> {
    use crate::debug::paired::{compare_paired, Pairing};
    use crate::engine::generate::Schedule;
    use crate::engine::trace::Phase;
    use crate::engine::MlaPath;
    use crate::service::AuxKind;
    use crate::session::recorded::{RecordedRun, RecordedSchedule, RunRole};
    let run = &report.run;
    let Some(outcome) = &run.outcome else {
        return Ok(Vec::new());
    };
    let tokens = outcome.tokens.clone();
    let forced = Schedule {
        prompt: tokens.clone(),
        prefill_len: job.schedule.prefill_len,
        decode_steps: 0,
    };
    let whole = Schedule {
        prefill_len: tokens.len(),
        prompt: tokens,
        decode_steps: 0,
    };
    let flip = |p| match p {
        MlaPath::Naive => MlaPath::Absorbed,
        MlaPath::Absorbed => MlaPath::Naive,
    };
    let mut wanted = Vec::new();
    if !flags.mla_disable {
        let mut other = flags;
        other.prefill_path = flip(flags.prefill_path);
        other.decode_path = flip(flags.decode_path);
        wanted.push((AuxKind::OtherPath, other, forced, Pairing::SameSchedule));
    }
    if run.phases().iter().any(|p| matches!(p, Phase::Decode(_))) {
        wanted.push((AuxKind::WholePrefill, flags, whole, Pairing::DecodeRows));
    }
    let mut out = Vec::new();
    for (kind, flags_b, schedule, pairing) in wanted {
        let paired = compare_paired(job, run, flags_b, &schedule, pairing, &report.tolerances)?;
        let role = RunRole::Aux {
            of: 0,
            kind: kind.name().to_string(),
        };
        let mut recorded = RecordedRun::of(&paired.other, role, true);
        recorded.schedule = Some(RecordedSchedule::of(&schedule));
        out.push((recorded, paired.other.outputs));
    }
    Ok(out)
}

fn print_json(report: &CheckReport, seconds: f64) -> Result<()> {
    for f in &report.findings {
        let mut v = serde_json::to_value(f).expect("a finding serialises");
        v["type"] = json!("finding");
        writeln!(Out, "{v}")?;
    }
    for n in &report.selection_notes {
        let mut v = serde_json::to_value(n).expect("a note serialises");
        v["type"] = json!("note");
        writeln!(Out, "{v}")?;
    }
    let tolerances: serde_json::Map<String, serde_json::Value> = crate::debug::tolerance::ALL_KINDS
        .iter()
        .map(|&k| {
            let (floor, gain) = report.tolerances.row(k);
            (k.name(), json!({"floor": floor, "gain": gain}))
        })
        .collect();
    writeln!(
        Out,
        "{}",
        json!({
            "type": "summary",
            "findings": report.findings.len(),
            "notes": report.notes,
            "selection_notes": report.selection_notes.len(),
            "tolerances": tolerances,
            "headroom": report.headroom,
            "ops": report.run.len(),
            "ops_executed": report.ops_executed,
            "seconds": seconds,
            "reference": report.reference.as_ref().map(|r| json!({
                "compared": r.comparisons.len(),
                "ops": r.ops,
                "not_compared": r.not_compared,
            })),
        })
    )?;
    Ok(())
}

/// Selection notes printed in text before the rest are left to `--json`.
const NOTES_SHOWN: usize = 12;

fn print_text(report: &CheckReport, layout: &str, seconds: f64) -> Result<()> {
    writeln!(
        Out,
        "mladb check: {layout}, {} ops, flags: {}; {}",
        report.run.len(),
        report.run.flags,
        report.tolerances.describe()
    )?;
    for n in &report.notes {
        writeln!(Out, "  note: {n}")?;
    }
    for n in report.selection_notes.iter().take(NOTES_SHOWN) {
        writeln!(Out, "  note: {n}")?;
    }
    if report.selection_notes.len() > NOTES_SHOWN {
        writeln!(
            Out,
            "  note: … {} more selection notes (--json lists them all)",
            report.selection_notes.len() - NOTES_SHOWN
        )?;
    }
    if report.findings.is_empty() {
        writeln!(
            Out,
            "no findings ({} ops computed in {seconds:.2}s)",
            report.ops_executed
        )?;
        return Ok(());
    }
    writeln!(Out, "{:<26} {:<9} {:<48} detail", "finding", "phase", "op")?;
    for f in &report.findings {
        writeln!(
            Out,
            "{:<26} {:<9} {:<48} {}",
            f.kind.to_string(),
            f.phase.to_string(),
            f.op_text(),
            f.detail
        )?;
    }
    writeln!(
        Out,
        "{} finding(s) ({} ops computed in {seconds:.2}s)",
        report.findings.len(),
        report.ops_executed
    )
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
    /// Name map of the reference dump: `hf` or a RON file (default: none for mladb's own
    /// dumps, `hf` for others).
    #[arg(long)]
    pub name_map: Option<String>,
    /// One relative L2 tolerance for every op (default: the table of run A's dtype, as check).
    #[arg(long)]
    pub tolerance: Option<f64>,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Runs bisect; returns whether an op diverged.
pub fn bisect(args: &BisectArgs) -> Result<bool> {
    use crate::debug::bisect::{bisect_dump, bisect_paired};
    use crate::debug::Flags;
    use crate::engine::generate::Schedule;
    let flags_a = Flags::parse(&args.a).map_err(|e| Error::invalid(format!("--a: {e}")))?;
    let flags_b = match (&args.b, &args.reference) {
        (Some(b), None) => Some(Flags::parse(b).map_err(|e| Error::invalid(format!("--b: {e}")))?),
        (None, Some(_)) => None,
        _ => return Err(Error::invalid("bisect needs --b FLAGS or --reference DUMP")),
    };
    if let Some(t) = args.tolerance.filter(|t| !(t.is_finite() && *t >= 0.0)) {
        return Err(Error::invalid(format!(
            "--tolerance {t} is not a non-negative number"
        )));
    }
    // A bf16 run on either side holds bf16's rounding: judged by that table.
    let dtype_b = flags_b.map_or(flags_a.dtype, |b| b.dtype);
    let tolerances = args.tolerance.map_or(
        crate::debug::tolerance::Tolerances::table_for(flags_a.dtype, dtype_b),
        crate::debug::tolerance::Tolerances::Uniform,
    );
    let reference = load_reference(
        args.reference.as_deref(),
        args.name_map.as_deref(),
        args.setup.max_memory_gb,
    )?;
    let setup = setup_against(&args.setup, reference.as_ref())?;
    let p = setup.prepare(&flags_a)?;
    if super::args::vllm_mla_disable()? {
        eprintln!("note: VLLM_MLA_DISABLE is ignored by bisect: --a and --b give each run's flags");
    }
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
            use crate::debug::paired::Pairing;
            // Ranks against one rank, or each op against the same op (of the same rank).
            let pairing = match (flags_a.tp, fb.tp) {
                (a, b) if a == b => Pairing::SameSchedule,
                (tp, 1) => Pairing::Ranks { tp },
                (a, b) => {
                    return Err(Error::invalid(format!(
                        "bisect compares a run of tp {a} with one of tp {b}: give the \
                         tensor-parallel run as --a and tp=1 as --b, or the same tp to both"
                    )))
                }
            };
            let paired =
                crate::debug::paired::compare_paired(&job, &a, fb, &forced, pairing, &tolerances)?;
            (bisect_paired(&a, paired), format!("run B ({fb})"))
        }
        (None, Some(dump)) => (
            bisect_dump(&job, &a, dump, &dump.tolerances(tolerances))?,
            "the reference dump".to_string(),
        ),
        (None, None) => unreachable!("checked above"),
    };
    let diverged = result.first.is_some() || result.first_choice.is_some();
    if args.json {
        writeln!(
            Out,
            "{}",
            serde_json::to_string(&result).expect("a bisection serialises")
        )?;
        return Ok(diverged);
    }
    writeln!(
        Out,
        "mladb bisect: run A ({flags_a}) against {against}; {}",
        tolerances.describe()
    )?;
    for n in &result.notes {
        writeln!(Out, "  note: {n}")?;
    }
    for f in &result.flips {
        writeln!(
            Out,
            "note: selection-flip {} {}: {}; run B was forced to A's choice",
            f.phase,
            f.op,
            f.describe()
        )?;
    }
    if let Some(choice) = &result.first_choice {
        writeln!(
            Out,
            "first divergent:   #{} {} {}: chooses differently beyond noise: {}",
            choice.index,
            choice.phase,
            choice.op,
            choice.describe()
        )?;
        return Ok(true);
    }
    // Under tensor parallelism, the rank that ran the op.
    let name = |index: usize, name: &str| match a.events.get(index).and_then(|e| e.rank) {
        Some(r) => format!("{name} (rank {r})"),
        None => name.to_string(),
    };
    match &result.first {
        None => writeln!(
            Out,
            "no op differs beyond its tolerance ({})",
            result.coverage()
        )?,
        Some(first) => {
            if let Some(good) = &result.last_good {
                let figures = good.diff.as_ref().map(|d| d.summary()).unwrap_or_default();
                writeln!(
                    Out,
                    "last agreeing op:  #{} {} {}: {figures}",
                    good.index,
                    good.phase,
                    name(good.index, &good.name)
                )?;
            }
            let figures = first.diff.as_ref().map(|d| d.summary()).unwrap_or_default();
            writeln!(
                Out,
                "first divergent:   #{} {} {}: {figures} ({})",
                first.index,
                first.phase,
                name(first.index, &first.name),
                first.tolerance_text()
            )?;
            writeln!(
                Out,
                "{} of {} compared ops differ beyond what their inputs explain ({})",
                result.divergent,
                result.compared,
                result.coverage()
            )?;
        }
    }
    Ok(diverged)
}

/// The `--reference` dump, if one is given (see [`ExternalDump::load_reference`]).
fn load_reference(
    path: Option<&std::path::Path>,
    map: Option<&str>,
    max_memory_gb: Option<f64>,
) -> Result<Option<ExternalDump>> {
    path.map(|p| ExternalDump::load_reference(p, map, max_memory_gb))
        .transpose()
}

/// The run's setup against a reference dump (see [`RunSpec::against`]).
fn setup_against(setup: &RunSetup, dump: Option<&ExternalDump>) -> Result<RunSpec> {
    match dump {
        Some(d) => setup.spec().against(d),
        None => Ok(setup.spec()),
    }
}
