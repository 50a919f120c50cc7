//! `bisect`: the first op, in execution order, whose output differs between two runs (or a run
//! and a dump) by more than the tolerance, with the op before it that still agreed.

use super::compare::{compare_runs, OpComparison};
use super::external::ExternalDump;
use super::record::RunRecord;
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
}

/// Bisects comparisons already in execution order.
pub fn bisect(comparisons: Vec<OpComparison>, tolerance: f64) -> Bisection {
    let first = comparisons.iter().position(|c| c.exceeds(tolerance));
    let last_good = first.and_then(|f| {
        comparisons[..f]
            .iter()
            .rev()
            .find(|c| c.diff.is_ok())
            .cloned()
    });
    Bisection {
        compared: comparisons.len(),
        divergent: comparisons.iter().filter(|c| c.exceeds(tolerance)).count(),
        last_good,
        first: first.map(|f| comparisons[f].clone()),
    }
}

/// Run `a` against run `b` (the reference).
pub fn bisect_runs(a: &RunRecord, b: &RunRecord, num_heads: usize, tolerance: f64) -> Bisection {
    bisect(compare_runs(a, b, num_heads), tolerance)
}

/// Run `a` against an external dump.
pub fn bisect_dump(
    a: &RunRecord,
    dump: &ExternalDump,
    num_heads: usize,
    tolerance: f64,
) -> Bisection {
    bisect(dump.compare(a, num_heads), tolerance)
}
