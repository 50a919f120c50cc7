//! `check`: runs the detectors over a run and reports what they find.
//!
//! * per op of the run: NaN/Inf, all-zero outputs, elements left unwritten in poisoned buffers,
//!   buffer disconnects (a kernel wrote one buffer, the next op read another);
//! * against re-runs of the same schedule: absorbed vs naive (every phase run on the other MLA
//!   path), prefill vs decode (each decoded token against its row in a whole-sequence prefill);
//! * against a reference dump, when one is given;
//! * quantized vs dequantized kv_b_proj, once weights can be quantized (until then, a note);
//! * on the GPU, the fast (production) attention kernels against the reference kernels: the run
//!   again with `attn-kernel reference`, op by op;
//! * with an fp8_ds_mla latent cache, each cached row against what E4M3 explains of the row
//!   written ([`super::kv_quant`]);
//! * under tensor parallelism, every rank against the same run on one rank ([`super::tp`]).
//!
//! Mismatch and NaN detectors report the first op of each phase (where a fault shows first) and
//! count the rest; unwritten elements and disconnects are reported at every op that has them.

use super::compare::OpComparison;
use super::external::{ExternalDump, ReferenceComparison};
use super::findings::{first_per_phase, fold_repeats, headroom_of};
use super::flags::Flags;
use super::paired::{compare_paired, compare_reference, Paired, Pairing};
pub use super::per_op::per_op_findings;
use super::record::RunRecord;
use super::runner::Job;
use super::selection::{ambiguous_selections, AmbiguousSelection};
use super::tolerance::Tolerances;
use crate::engine::generate::Schedule;
use crate::engine::trace::{OpKind, Phase};
use crate::engine::{Fault, MlaPath, StorageDtype};
use crate::error::Result;
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
    KernelMismatch,
    KvQuantMismatch,
    TpMismatch,
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
    /// The tensor-parallel rank that ran the op (`None` without tensor parallelism).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<usize>,
    pub detail: String,
}

impl Finding {
    /// The op and, under tensor parallelism, its rank: `model.layers.0.mlp (rank 1)`.
    pub fn op_text(&self) -> String {
        match self.rank {
            Some(r) => format!("{} (rank {r})", self.op),
            None => self.op.clone(),
        }
    }
}

/// What `check` compares against and how strictly.
pub struct CheckOptions {
    /// One relative L2 tolerance for every op; `None` takes the table of the run's dtype
    /// ([`Tolerances`]).
    pub tolerance: Option<f64>,
    pub reference: Option<ExternalDump>,
}

/// `kernel-mismatch`: where the checked run's attention ran a fast kernel, the run again on the
/// reference kernels, op by op (the first attention op sees identical inputs in both; later ones
/// carry the earlier difference, which the tolerances propagate). Says why when nothing ran fast.
fn kernel_mismatch(
    v: &mut Verdicts,
    run: &RunRecord,
    flags: Flags,
    paired: impl FnOnce(Flags) -> Result<Paired>,
) -> Result<()> {
    if flags.device != super::flags::DeviceFlag::Cuda {
        v.notes.push(
            "fast vs reference kernels: skipped, the CPU runs the reference kernels only".into(),
        );
        return Ok(());
    }
    if !run.events.iter().any(|e| e.ran_fast_kernel()) {
        let why = run
            .events
            .iter()
            .find_map(|e| e.reference_reason())
            .unwrap_or("no attention op ran");
        v.notes.push(format!(
            "fast vs reference kernels: skipped, no attention op ran a fast kernel ({why})"
        ));
        return Ok(());
    }
    let mut other = flags;
    other.kernels.kernel = crate::ops::AttnKernel::Reference;
    let paired = paired(other)?;
    // Both runs compute the same model: an op of either kernel's that cannot be set beside its
    // counterpart (another shape) is itself a mismatch, and how many ops were compared is said,
    // so that a comparison of nothing never reads as agreement.
    let failed = not_compared(&paired.comparisons);
    if let Some((c, why)) = failed.first() {
        v.findings.push(Finding {
            kind: FindingKind::KernelMismatch,
            phase: c.phase,
            op: c.name.clone(),
            index: c.index,
            rank: None,
            detail: format!(
                "the fast kernels' op cannot be compared with the reference kernels' ({why}); {} \
                 op(s) like it",
                failed.len()
            ),
        });
    }
    v.notes.push(format!(
        "fast vs reference kernels: {} ops compared{}",
        paired.comparisons.len() - failed.len(),
        match failed.len() {
            0 => String::new(),
            n => format!(", {n} could not be"),
        }
    ));
    v.add(
        paired,
        Comparison {
            name: "fast vs reference kernels",
            kind: FindingKind::KernelMismatch,
            describe: format!(
                "attention on the fast kernels ({}) vs the reference kernels",
                super::flags::kernels_text(&flags.kernels)
            ),
        },
    );
    Ok(())
}

/// `tp-mismatch`: under tensor parallelism, the same schedule again on one rank, each rank's
/// ops against their part of it.
fn tp_mismatch(
    v: &mut Verdicts,
    run: &RunRecord,
    flags: Flags,
    paired: impl FnOnce(Flags) -> Result<Paired>,
) -> Result<()> {
    if flags.tp < 2 {
        return Ok(());
    }
    let one = Flags { tp: 1, ..flags };
    let paired = paired(one)?;
    let partial = super::tp::partial_sums(run);
    let failed = not_compared(&paired.comparisons);
    let mut uncompared = match failed.first() {
        Some((_, why)) => format!("; {} could not be compared (first: {why})", failed.len()),
        None => String::new(),
    };
    let missing = super::tp::without_counterpart(run, &paired.other);
    if missing > 0 {
        uncompared.push_str(&format!("; {missing} have no op of their name on one rank"));
    }
    v.notes.push(format!(
        "tp {} vs one rank: {} ops compared{uncompared}; {partial} partial sums compared \
         through their all-reduce",
        flags.tp,
        paired.comparisons.len() - failed.len(),
    ));
    v.add(
        paired,
        Comparison {
            name: "tensor parallel vs one rank",
            kind: FindingKind::TpMismatch,
            describe: format!("rank's part vs the run on one rank (tp {})", flags.tp),
        },
    );
    Ok(())
}

/// The comparisons that could not be made (shapes differ, a sample against a whole tensor),
/// each with why: what a detector's note counts beside the ops it compared.
fn not_compared(comparisons: &[OpComparison]) -> Vec<(&OpComparison, &String)> {
    comparisons
        .iter()
        .filter_map(|c| c.diff.as_ref().err().map(|why| (c, why)))
        .collect()
}

/// The note for the ops of a comparison that fail only through NaN/Inf alike on both sides,
/// which the findings leave out ([`super::compare::OpComparison::fails_only_alike`]).
fn alike_note(name: &str, comparisons: &[OpComparison]) -> Option<String> {
    let alike = comparisons.iter().filter(|c| c.fails_only_alike()).count();
    (alike > 0).then(|| {
        format!(
            "{name}: {alike} op(s) agree wherever both sides are finite and hold the same NaN/Inf \
             elsewhere: not a difference between the two (the NaN/Inf finding reports them)"
        )
    })
}

/// A note about a discrete choice: not a bug, but what a reader of the findings must know.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SelectionNote {
    /// `selection-flip` (two runs chose differently within noise; the second was forced to the
    /// first's choice) or `ambiguous-selection` (a top-k boundary within noise in one run).
    pub kind: String,
    pub phase: Phase,
    pub op: String,
    pub index: usize,
    /// Which comparison saw it (`absorbed vs naive`, ...), empty for the checked run itself.
    pub comparison: String,
    pub detail: String,
}

impl fmt::Display for SelectionNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {}", self.kind, self.phase, self.op)?;
        if !self.comparison.is_empty() {
            write!(f, " ({})", self.comparison)?;
        }
        write!(f, ": {}", self.detail)
    }
}

pub struct CheckReport {
    pub findings: Vec<Finding>,
    /// Detectors that could not run, and why.
    pub notes: Vec<String>,
    /// Selection flips that were forced and ambiguous selections.
    pub selection_notes: Vec<SelectionNote>,
    pub tolerances: Tolerances,
    /// The largest relative L2 error each comparison saw per op kind (within tolerance or not):
    /// how close a clean run came to its tolerances.
    pub headroom: Vec<Headroom>,
    /// The checked run.
    pub run: RunRecord,
    /// Ops computed over all the runs the check made.
    pub ops_executed: usize,
    /// Re-runs made to force selection flips (their ops are in `ops_executed`).
    pub reruns: usize,
    /// The comparison with the reference dump, when there is one.
    pub reference: Option<ReferenceComparison>,
}

/// How close one op kind came to its tolerances in one comparison, and what the table would
/// need to pass it: the largest error at an op whose inputs agreed (against the floor), and the
/// largest gain of error over input error above the floor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Headroom {
    pub comparison: String,
    pub kind: OpKind,
    /// The op with the largest error relative to its tolerance, and both.
    pub op: String,
    pub phase: Phase,
    pub rel_l2: f64,
    pub tolerance: f64,
    /// The largest error at an op of this kind whose inputs agreed exactly.
    pub floor_error: f64,
    /// The largest (error − floor) / input error at an op whose inputs differed.
    pub gain_needed: f64,
}

/// The tolerance replays use when a session is verified on another device: one bf16 rounding
/// step in bf16, 1e-4 in f32.
pub fn default_tolerance(dtype: StorageDtype) -> f64 {
    match dtype {
        StorageDtype::F32 => 1e-4,
        StorageDtype::Bf16 => 3e-2,
    }
}

/// One comparison `check` makes: what it is called and which finding it gives.
struct Comparison<'a> {
    name: &'a str,
    kind: FindingKind,
    describe: String,
}

pub fn check(job: &Job, flags: Flags, options: &CheckOptions) -> Result<CheckReport> {
    let tolerances = options
        .tolerance
        .map_or(Tolerances::Table(flags.dtype), Tolerances::Uniform);
    let run = job.run(flags, None)?;
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
    let mut v = Verdicts {
        findings: per_op_findings(&run),
        notes: Vec::new(),
        selection_notes: ambiguous_selections(&run, job.model, &tolerances)
            .into_iter()
            .map(|a| SelectionNote {
                kind: "ambiguous-selection".into(),
                phase: a.phase,
                op: a.op.clone(),
                index: a.index,
                comparison: String::new(),
                detail: a.describe(),
            })
            .collect(),
        headroom: Vec::new(),
        ops: run.counts.executed,
        reruns: 0,
        tolerances,
    };
    let paired = |other: Flags, schedule: &Schedule, pairing: Pairing| {
        compare_paired(job, &run, other, schedule, pairing, &tolerances)
    };
    if let Some(o) = run.outcome.as_ref().filter(|o| !o.non_finite.is_empty()) {
        v.notes.push(format!("generated {}", o.generated_text()));
    }
    v.notes.extend(super::idle::check_notes(job, &run)?);
    if options.reference.is_none() {
        // No comparison between mladb's own runs can see these: every path and phase shares them.
        for f in [
            Fault::RopeNoninterleaved,
            Fault::IndexerRopeLayout,
            Fault::YarnMscale,
        ] {
            if flags.faults.contains(f) {
                v.notes.push(format!(
                    "{}: only a reference dump shows it (every path and phase shares it): \
                     check --reference DUMP",
                    f.name()
                ));
            }
        }
    }

    // Absorbed vs naive: every phase again on the other path.
    if flags.mla_disable {
        v.notes.push(
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
        let describe = [Phase::Prefill, Phase::Decode(0)]
            .map(|p| format!("{} vs {}", flags.path_of(p), flipped.path_of(p)));
        v.add(
            paired(flipped, &forced, Pairing::SameSchedule)?,
            Comparison {
                name: "absorbed vs naive",
                kind: FindingKind::AbsorbedNaiveMismatch,
                describe: format!("prefill {}, decode {}", describe[0], describe[1]),
            },
        );
    }

    // Prefill vs decode: the whole sequence prefilled at once.
    if run.phases().iter().any(|p| matches!(p, Phase::Decode(_))) {
        let whole_schedule = Schedule {
            prefill_len: tokens.len(),
            prompt: tokens,
            decode_steps: 0,
        };
        v.add(
            paired(flags, &whole_schedule, Pairing::DecodeRows)?,
            Comparison {
                name: "prefill vs decode",
                kind: FindingKind::PrefillDecodeMismatch,
                describe: "decoded against the cache vs the same token in a whole-sequence prefill"
                    .to_string(),
            },
        );
    } else {
        v.notes
            .push("prefill vs decode: skipped, the run has no decode steps".to_string());
    }

    // A quantized kv_b_proj: its decoding against what it was quantized from, then the run
    // again with the other kv_b_proj route (force-dequantize flipped), op by op.
    let (quant_found, quant_notes) = super::quant::quant_findings(job, &run)?;
    v.findings.extend(quant_found);
    v.notes.extend(quant_notes);
    if job.model.has_quantized_kv_b() {
        let mut flipped = flags;
        flipped.force_dequant = !flags.force_dequant;
        let route = |on: bool| {
            if on {
                "force-dequantized"
            } else {
                "quantized (identity)"
            }
        };
        v.add(
            paired(flipped, &forced, Pairing::SameSchedule)?,
            Comparison {
                name: "kv_b_proj routes",
                kind: FindingKind::QuantMismatch,
                describe: format!(
                    "kv_b_proj {} vs {}",
                    route(flags.force_dequant),
                    route(flipped.force_dequant)
                ),
            },
        );
    }

    kernel_mismatch(&mut v, &run, flags, |other| {
        paired(other, &forced, Pairing::SameSchedule)
    })?;

    tp_mismatch(&mut v, &run, flags, |other| {
        paired(other, &forced, Pairing::Ranks { tp: flags.tp })
    })?;

    let kv = super::kv_quant::kv_quant_mismatch(job, &run, flags, &forced)?;
    v.findings.extend(kv.findings);
    v.notes.extend(kv.notes);
    v.ops += kv.ops;

    let mut reference = None;
    if let Some(dump) = &options.reference {
        let (paired, compared) = compare_reference(job, &run, dump, &dump.tolerances(tolerances))?;
        v.notes.extend(compared.notes.iter().cloned());
        v.notes.push(format!("reference: {}", compared.summary()));
        let mut found = first_per_phase(
            &paired.comparisons,
            &paired.clear,
            FindingKind::ReferenceMismatch,
            "vs the reference dump",
        );
        let ties = ambiguous_selections(&paired.other, job.model, &tolerances);
        for f in &mut found {
            if let Some(why) = tie_before(f, &paired, &ties, dump) {
                f.detail.push_str(&why);
            }
        }
        v.findings.extend(found);
        v.notes.extend(alike_note("reference", &paired.comparisons));
        v.add_flips(
            &paired,
            "reference",
            "the run was made again with the reference's choice",
        );
        v.ops += paired.ops_executed;
        v.reruns += paired.reruns;
        v.headroom
            .extend(headroom_of("reference", &paired.comparisons, &tolerances));
        reference = Some(compared);
    }

    for f in &mut v.findings {
        f.rank = run.events.get(f.index).and_then(|e| e.rank);
    }
    v.findings.sort_by_key(|f| (f.index, f.kind as u8));
    v.selection_notes.sort_by_key(|n| n.index);
    // Replicated choices (router, indexer) noted once, not once per rank.
    let mut seen = std::collections::HashSet::new();
    v.selection_notes
        .retain(|n| seen.insert((n.kind.clone(), n.phase, n.op.clone(), n.detail.clone())));
    Ok(CheckReport {
        findings: fold_repeats(v.findings),
        notes: v.notes,
        selection_notes: v.selection_notes,
        tolerances,
        headroom: v.headroom,
        run,
        ops_executed: v.ops,
        reruns: v.reruns,
        reference,
    })
}

/// What the comparisons of one check add up to.
struct Verdicts {
    findings: Vec<Finding>,
    notes: Vec<String>,
    selection_notes: Vec<SelectionNote>,
    headroom: Vec<Headroom>,
    ops: usize,
    reruns: usize,
    tolerances: Tolerances,
}

impl Verdicts {
    /// The flips within noise a comparison forced, as notes.
    fn add_flips(&mut self, paired: &Paired, comparison: &str, what: &str) {
        self.selection_notes
            .extend(paired.flips.iter().map(|d| SelectionNote {
                kind: "selection-flip".into(),
                phase: d.phase,
                op: d.op.clone(),
                index: d.index,
                comparison: comparison.to_string(),
                detail: format!("{}; {what}", d.describe()),
            }));
    }

    /// Takes in one selection-aware comparison.
    fn add(&mut self, paired: Paired, c: Comparison) {
        self.ops += paired.ops_executed;
        self.reruns += paired.reruns;
        self.findings.extend(first_per_phase(
            &paired.comparisons,
            &paired.clear,
            c.kind,
            &c.describe,
        ));
        self.notes.extend(alike_note(c.name, &paired.comparisons));
        self.add_flips(&paired, c.name, "the second run was forced to A's choice");
        if paired.gave_up {
            self.notes.push(format!(
                "{}: stopped forcing selection flips after {} re-runs",
                c.name, paired.reruns
            ));
        }
        self.headroom
            .extend(headroom_of(c.name, &paired.comparisons, &self.tolerances));
    }
}

/// When a reference finding follows a choice of the checked run that sits on an exact or near
/// tie at the same token (another engine may break it another way), what to say about it: the
/// tie, and whether the dump held the reference's choice to rerun with.
fn tie_before(
    f: &Finding,
    paired: &Paired,
    ties: &[AmbiguousSelection],
    dump: &ExternalDump,
) -> Option<String> {
    let run = &paired.other;
    let e = run.events.get(f.index)?;
    let c = paired.comparisons.iter().find(|c| c.index == f.index)?;
    let at = c.diff.as_ref().ok()?.max_abs_at.clone();
    let axis = usize::from(e.kind == OpKind::AttentionProbs);
    let position = e.positions.0 + at.get(axis).copied().unwrap_or(0);
    let tie = ties
        .iter()
        .rfind(|t| t.index < f.index && t.covers(position))?;
    let row = tie.rows.iter().find(|r| r.position == position)?;
    let forced = paired
        .flips
        .iter()
        .any(|d| d.index == tie.index && d.position == position);
    let rerun = if forced {
        "the run was already made again with the dump's choice there"
    } else if dump.tensors.contains_key(&(tie.phase, tie.op.clone())) {
        "the dump's choice there is this run's"
    } else {
        "the dump holds no choice for that op, so check could not rerun with the reference's \
         (a dump with it, such as tools/hf_dump.py writes, lets it)"
    };
    Some(format!(
        " — it follows an ambiguous selection at {} {} position {position} (margin {:.2e}: kept {:?} vs left out {:?}): likely a tie-break difference, not a bug; {rerun}",
        tie.phase, tie.op, row.margin, row.kept_near, row.dropped_near
    ))
}

#[cfg(test)]
#[path = "detect_tests.rs"]
mod tests;
