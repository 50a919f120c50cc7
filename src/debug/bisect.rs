//! `bisect`: the first op, in execution order, whose output differs between two runs (or a run
//! and a dump) by more than its tolerance, with the op before it that still agreed.

use super::compare::OpComparison;
use super::external::ExternalDump;
use super::paired::{compare_reference, Paired};
use super::record::RunRecord;
use super::runner::Job;
use super::selection::SelectionDiff;
use super::tolerance::Tolerances;
use crate::error::Result;
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Bisection {
    /// Ops compared.
    pub compared: usize,
    /// Ops in the run examined.
    pub ops: usize,
    /// `PHASE/NAME` of the ops of the run the reference lacks (not compared).
    pub not_compared: Vec<String>,
    /// The first op over tolerance.
    pub first: Option<OpComparison>,
    /// The last op before it that was within tolerance.
    pub last_good: Option<OpComparison>,
    /// Ops over tolerance in all.
    pub divergent: usize,
    /// A choice (MoE experts, DSA keys) that differs at a clear margin before the first op over
    /// tolerance: then it is the first divergence.
    pub first_choice: Option<SelectionDiff>,
    /// Choices that flipped within noise; run B was forced to A's choice at each.
    pub flips: Vec<SelectionDiff>,
    /// What the reader should know about the reference (a dump whose tokens could not be
    /// checked, other generated tokens).
    pub notes: Vec<String>,
}

impl Bisection {
    /// `130 of 130 ops compared`, with how many were not and the first few of them.
    pub fn coverage(&self) -> String {
        let mut s = format!("{} of {} ops compared", self.compared, self.ops);
        if !self.not_compared.is_empty() {
            let first: Vec<&str> = self
                .not_compared
                .iter()
                .take(4)
                .map(String::as_str)
                .collect();
            s.push_str(&format!(
                "; {} not in the reference: {}{}",
                self.not_compared.len(),
                first.join(", "),
                if self.not_compared.len() > first.len() {
                    ", …"
                } else {
                    ""
                }
            ));
        }
        s
    }
}

/// An op that differs: over its tolerance (NaN / ±Inf alike on both sides aside), or not
/// comparable at all (outputs of other shapes).
fn differs(c: &OpComparison) -> bool {
    c.diff.is_err() || c.diverges()
}

/// Bisects judged comparisons already in execution order, of a run of `ops` ops.
pub fn bisect(comparisons: Vec<OpComparison>, ops: usize, not_compared: Vec<String>) -> Bisection {
    let first = comparisons.iter().position(differs);
    let last_good = first.and_then(|f| {
        comparisons[..f]
            .iter()
            .rev()
            .find(|c| c.diff.is_ok())
            .cloned()
    });
    let alike = comparisons.iter().filter(|c| c.fails_only_alike()).count();
    let notes = (alike > 0)
        .then(|| {
            format!(
                "{alike} op(s) hold the same NaN/Inf on both sides and agree wherever both are \
                 finite: not where the two part (check's nan-inf finding says where they arise)"
            )
        })
        .into_iter()
        .collect();
    Bisection {
        compared: comparisons.len(),
        ops,
        not_compared,
        divergent: comparisons.iter().filter(|c| differs(c)).count(),
        last_good,
        first: first.map(|f| comparisons[f].clone()),
        first_choice: None,
        flips: Vec::new(),
        notes,
    }
}

/// Bisects a selection-aware comparison of run `a` with a second run.
pub fn bisect_paired(a: &RunRecord, paired: Paired) -> Bisection {
    // A tensor-parallel A against B on one rank pairs each rank's op with its unsharded op.
    let one_rank = paired.other.events.iter().all(|o| o.rank.is_none());
    let missing = a
        .events
        .iter()
        .filter(|e| !pairs_in(&paired.other, e, one_rank))
        .map(|e| e.dump_name())
        .collect();
    let mut b = bisect(paired.comparisons, a.len(), missing);
    b.first_choice = paired
        .clear
        .into_iter()
        .next()
        .filter(|d| b.first.as_ref().is_none_or(|f| d.index < f.index));
    b.flips = paired.flips;
    b
}

/// Whether `other` holds the op that `e` pairs with: the same op of the same rank, or, for a
/// rank's op against a run on one rank (`one_rank`), the op of that run it is compared with (a
/// partial sum is compared through its all-reduce).
fn pairs_in(other: &RunRecord, e: &crate::engine::OpEvent, one_rank: bool) -> bool {
    if other.find_for(e, &e.name).is_some() {
        return true;
    }
    let partial = crate::model::shard::partial_sum(&e.name);
    e.rank.is_some() && one_rank && (partial || super::tp::unsharded_op(other, e).is_some())
}

/// Run `a` against an external dump (an error when the dump is of other tokens or shapes).
pub fn bisect_dump(
    job: &Job,
    a: &RunRecord,
    dump: &ExternalDump,
    tolerances: &Tolerances,
) -> Result<Bisection> {
    let (paired, r) = compare_reference(job, a, dump, tolerances)?;
    let mut b = bisect_paired(a, paired);
    // Choices count as compared too (as choices).
    b.compared = r.comparisons.len();
    b.not_compared = r.not_compared;
    b.notes.extend(r.notes);
    Ok(b)
}
