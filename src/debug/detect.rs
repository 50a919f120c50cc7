//! `check`: runs the detectors over a run and reports what they find.
//!
//! * per op of the run: NaN/Inf, all-zero outputs, elements left unwritten in poisoned buffers,
//!   buffer disconnects (a kernel wrote one buffer, the next op read another);
//! * against re-runs of the same schedule: absorbed vs naive (every phase run on the other MLA
//!   path), prefill vs decode (each decoded token against its row in a whole-sequence prefill);
//! * against a reference dump, when one is given;
//! * quantized vs dequantized kv_b_proj, once weights can be quantized (until then, a note).
//!
//! Mismatch and NaN detectors report the first op of each phase (where a fault shows first) and
//! count the rest; unwritten elements and disconnects are reported at every op that has them.

use super::compare::{compare_runs, first_divergence, prefill_vs_decode, OpComparison};
use super::external::ExternalDump;
use super::flags::Flags;
use super::forensics::{disconnects, orphan_reads};
use super::record::RunRecord;
use super::runner::Job;
use crate::engine::generate::Schedule;
use crate::engine::trace::{OpKind, Phase};
use crate::engine::{MlaPath, StorageDtype};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FindingKind {
    NanInf,
    AllZero,
    Unwritten,
    BufferDisconnect,
    AbsorbedNaiveMismatch,
    PrefillDecodeMismatch,
    QuantMismatch,
    ReferenceMismatch,
}

impl fmt::Display for FindingKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = serde_json::to_value(self).expect("a kind serialises");
        write!(f, "{}", s.as_str().unwrap_or("?"))
    }
}

/// One thing a detector found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    pub kind: FindingKind,
    pub phase: Phase,
    pub op: String,
    /// Index of the op in the checked run.
    pub index: usize,
    pub detail: String,
}

/// What `check` compares against and how strictly.
pub struct CheckOptions {
    /// Relative L2 tolerance of the comparisons; `None` picks one for the dtype (1e-4 for f32,
    /// 3e-2 for bf16).
    pub tolerance: Option<f64>,
    pub reference: Option<ExternalDump>,
}

pub struct CheckReport {
    pub findings: Vec<Finding>,
    /// Detectors that could not run, and why.
    pub notes: Vec<String>,
    pub tolerance: f64,
    /// The checked run.
    pub run: RunRecord,
    /// Ops computed over all the runs the check made.
    pub ops_executed: usize,
}

pub fn default_tolerance(dtype: StorageDtype) -> f64 {
    match dtype {
        StorageDtype::F32 => 1e-4,
        StorageDtype::Bf16 => 3e-2,
    }
}

pub fn check(job: &Job, flags: Flags, options: &CheckOptions) -> Result<CheckReport> {
    let tolerance = options.tolerance.unwrap_or(default_tolerance(flags.dtype));
    let heads = job.model.layout.num_heads;
    let run = job.run(flags, None)?;
    let mut ops = run.counts.executed;
    // Comparison runs are fed the checked run's tokens, generated ones included, so that they
    // differ only in what is being compared.
    let tokens = run
        .outcome
        .as_ref()
        .map(|o| o.tokens.clone())
        .unwrap_or_default();
    let forced = Schedule {
        prompt: tokens.clone(),
        prefill_len: job.schedule.prefill_len,
        decode_steps: 0,
    };
    let mut findings = per_op_findings(&run);
    let mut notes = Vec::new();
    notes.extend(super::idle::check_notes(job, &run)?);

    // Absorbed vs naive: every phase again on the other path.
    if flags.mla_disable {
        notes.push(
            "absorbed vs naive: skipped, MLA is disabled (no absorbed path runs)".to_string(),
        );
    } else {
        let other = |p| match p {
            MlaPath::Naive => MlaPath::Absorbed,
            MlaPath::Absorbed => MlaPath::Naive,
        };
        let mut flipped = flags;
        flipped.prefill_path = other(flags.prefill_path);
        flipped.decode_path = other(flags.decode_path);
        let flipped_run = job.run_schedule(flipped, &forced, None)?;
        ops += flipped_run.counts.executed;
        let describe =
            |phase: Phase| format!("{:?} vs {:?}", flags.path_of(phase), flipped.path_of(phase));
        findings.extend(first_per_phase(
            &compare_runs(&run, &flipped_run, heads),
            tolerance,
            FindingKind::AbsorbedNaiveMismatch,
            describe,
        ));
    }

    // Prefill vs decode: the whole sequence prefilled at once.
    if run.phases().iter().any(|p| matches!(p, Phase::Decode(_))) {
        let whole_schedule = Schedule {
            prefill_len: tokens.len(),
            prompt: tokens,
            decode_steps: 0,
        };
        let whole = job.run_schedule(flags, &whole_schedule, None)?;
        ops += whole.counts.executed;
        findings.extend(first_per_phase(
            &prefill_vs_decode(&run, &whole, heads),
            tolerance,
            FindingKind::PrefillDecodeMismatch,
            |_| {
                "decoded against the cache vs the same token in a whole-sequence prefill"
                    .to_string()
            },
        ));
    } else {
        notes.push("prefill vs decode: skipped, the run has no decode steps".to_string());
    }

    // A quantized kv_b_proj: its decoding against what it was quantized from, then the run
    // again with the other kv_b_proj route (force-dequantize flipped), op by op.
    let (quant_found, quant_notes) = super::quant::quant_findings(job, &run)?;
    findings.extend(quant_found);
    notes.extend(quant_notes);
    if job.model.has_quantized_kv_b() {
        let mut flipped = flags;
        flipped.force_dequant = !flags.force_dequant;
        let other = job.run_schedule(flipped, &forced, None)?;
        ops += other.counts.executed;
        let route = |on: bool| {
            if on {
                "force-dequantized"
            } else {
                "quantized (identity)"
            }
        };
        findings.extend(first_per_phase(
            &compare_runs(&run, &other, heads),
            tolerance,
            FindingKind::QuantMismatch,
            |_| {
                format!(
                    "kv_b_proj {} vs {}",
                    route(flags.force_dequant),
                    route(flipped.force_dequant)
                )
            },
        ));
    }

    if let Some(reference) = &options.reference {
        let compared = reference.compare(&run, heads);
        if compared.is_empty() {
            return Err(Error::invalid(
                "the reference dump holds no op of this run (check the phases, names and name map)",
            ));
        }
        notes.push(format!("reference: compared {} ops", compared.len()));
        findings.extend(first_per_phase(
            &compared,
            tolerance,
            FindingKind::ReferenceMismatch,
            |_| "vs the reference dump".to_string(),
        ));
    }

    findings.sort_by_key(|f| (f.index, f.kind as u8));
    Ok(CheckReport {
        findings: fold_repeats(findings),
        notes,
        tolerance,
        run,
        ops_executed: ops,
    })
}

/// One finding per kind and op: the same op found again in later phases is listed in the
/// first finding's detail instead of repeating it.
fn fold_repeats(findings: Vec<Finding>) -> Vec<Finding> {
    let mut out: Vec<Finding> = Vec::new();
    let mut again: Vec<Vec<Phase>> = Vec::new();
    for f in findings {
        match out.iter().position(|g| g.kind == f.kind && g.op == f.op) {
            Some(i) => again[i].push(f.phase),
            None => {
                out.push(f);
                again.push(Vec::new());
            }
        }
    }
    for (f, phases) in out.iter_mut().zip(again) {
        if !phases.is_empty() {
            let list: Vec<String> = phases.iter().map(Phase::to_string).collect();
            f.detail
                .push_str(&format!(" [also in {}]", list.join(", ")));
        }
    }
    out
}

/// Findings that one run shows by itself.
pub fn per_op_findings(run: &RunRecord) -> Vec<Finding> {
    let mut findings = Vec::new();
    let mut nan_seen: Vec<(Phase, usize)> = Vec::new();
    let mut zero_seen: Vec<(Phase, usize)> = Vec::new();
    for (i, e) in run.events.iter().enumerate() {
        let s = &e.stats;
        let f = |kind, detail: String| Finding {
            kind,
            phase: e.phase,
            op: e.name.clone(),
            index: i,
            detail,
        };
        if s.unwritten > 0 {
            findings.push(f(
                FindingKind::Unwritten,
                format!(
                    "{} of {} elements were never written (poison still in place)",
                    s.unwritten, s.count
                ),
            ));
        }
        // Masked indexer scores are −∞ by design; poison is reported as unwritten above.
        let bad = s.nan - s.unwritten
            + s.pos_inf
            + if e.kind == OpKind::IndexScores {
                0
            } else {
                s.neg_inf
            };
        if bad > 0 {
            note_first(&mut nan_seen, &mut findings, e.phase, || {
                f(
                    FindingKind::NanInf,
                    format!(
                        "{} NaN, {} +Inf, {} -Inf of {} elements",
                        s.nan - s.unwritten,
                        s.pos_inf,
                        s.neg_inf,
                        s.count
                    ),
                )
            });
        }
        if s.all_zero() {
            note_first(&mut zero_seen, &mut findings, e.phase, || {
                f(
                    FindingKind::AllZero,
                    format!("all {} elements are zero", s.count),
                )
            });
        }
    }
    count_later(&mut findings, &nan_seen, FindingKind::NanInf, "op");
    count_later(&mut findings, &zero_seen, FindingKind::AllZero, "op");
    for d in disconnects(run) {
        findings.push(Finding {
            kind: FindingKind::BufferDisconnect,
            phase: d.phase,
            op: d.op.clone(),
            index: d.index,
            detail: format!(
                "the kernel wrote buffer #{} @{:#x}, the op handed on buffer #{} @{:#x}{}",
                d.kernel_wrote.id.0,
                d.kernel_wrote.address,
                d.returned.id.0,
                d.returned.address,
                if d.consumers.is_empty() {
                    String::new()
                } else {
                    format!(", which {} read", d.consumers.join(", "))
                }
            ),
        });
    }
    for (i, r) in orphan_reads(run) {
        let e = &run.events[i];
        findings.push(Finding {
            kind: FindingKind::BufferDisconnect,
            phase: e.phase,
            op: e.name.clone(),
            index: i,
            detail: format!(
                "reads buffer #{} @{:#x}, which no earlier op wrote",
                r.id.0, r.address
            ),
        });
    }
    findings
}

/// Records a finding only for the first occurrence in a phase; counts the rest.
fn note_first(
    seen: &mut Vec<(Phase, usize)>,
    findings: &mut Vec<Finding>,
    phase: Phase,
    make: impl FnOnce() -> Finding,
) {
    match seen.iter_mut().find(|(p, _)| *p == phase) {
        Some((_, n)) => *n += 1,
        None => {
            seen.push((phase, 0));
            findings.push(make());
        }
    }
}

fn count_later(findings: &mut [Finding], seen: &[(Phase, usize)], kind: FindingKind, what: &str) {
    for (phase, later) in seen {
        if *later == 0 {
            continue;
        }
        if let Some(f) = findings
            .iter_mut()
            .find(|f| f.kind == kind && f.phase == *phase)
        {
            f.detail
                .push_str(&format!("; {later} later {what}s of {phase} too"));
        }
    }
}

/// The first comparison over tolerance in each phase, as findings.
fn first_per_phase(
    comparisons: &[OpComparison],
    tolerance: f64,
    kind: FindingKind,
    describe: impl Fn(Phase) -> String,
) -> Vec<Finding> {
    let mut phases: Vec<Phase> = comparisons.iter().map(|c| c.phase).collect();
    phases.dedup();
    let mut out = Vec::new();
    for phase in phases {
        let in_phase: Vec<OpComparison> = comparisons
            .iter()
            .filter(|c| c.phase == phase)
            .cloned()
            .collect();
        let Some(first) = first_divergence(&in_phase, tolerance) else {
            continue;
        };
        let later = in_phase.iter().filter(|c| c.exceeds(tolerance)).count() - 1;
        let figures = first.diff.as_ref().map(|d| d.summary()).unwrap_or_default();
        out.push(Finding {
            kind,
            phase,
            op: first.name.clone(),
            index: first.index,
            detail: format!(
                "{}: {figures} (tolerance {tolerance:.0e}){}",
                describe(phase),
                if later > 0 {
                    format!("; {later} later ops of {phase} differ too")
                } else {
                    String::new()
                }
            ),
        });
    }
    out
}
