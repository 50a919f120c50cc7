//! `bisect`: the first op, in execution order, whose output differs between two runs (or a run
//! and a dump) by more than its tolerance, with the op before it that still agreed.

use super::compare::OpComparison;
use super::external::ExternalDump;
use super::paired::Paired;
use super::record::RunRecord;
use super::selection::SelectionDiff;
use super::tolerance::Tolerances;
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Bisection {
    /// Ops compared.
    pub compared: usize,
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
}

/// Bisects comparisons already in execution order and judged.
pub fn bisect(comparisons: Vec<OpComparison>) -> Bisection {
    let first = comparisons.iter().position(|c| c.exceeds_its());
    let last_good = first.and_then(|f| {
        comparisons[..f]
            .iter()
            .rev()
            .find(|c| c.diff.is_ok())
            .cloned()
    });
    Bisection {
        compared: comparisons.len(),
        divergent: comparisons.iter().filter(|c| c.exceeds_its()).count(),
        last_good,
        first: first.map(|f| comparisons[f].clone()),
        first_choice: None,
        flips: Vec::new(),
    }
}

/// Bisects a selection-aware comparison of two runs.
pub fn bisect_paired(paired: Paired) -> Bisection {
    let mut b = bisect(paired.comparisons);
    b.first_choice = paired
        .clear
        .into_iter()
        .next()
        .filter(|d| b.first.as_ref().is_none_or(|f| d.index < f.index));
    b.flips = paired.flips;
    b
}

/// Run `a` against an external dump.
pub fn bisect_dump(
    a: &RunRecord,
    dump: &ExternalDump,
    num_heads: usize,
    tolerances: &Tolerances,
) -> Bisection {
    let mut comparisons = dump.compare(a, num_heads);
    tolerances.judge(a, &mut comparisons);
    bisect(comparisons)
}
