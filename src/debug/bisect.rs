//! `bisect`: the first op, in execution order, whose output differs between two runs (or a run
//! and a dump) by more than the tolerance, with the op before it that still agreed.

use super::compare::{compare_runs, OpComparison};
use super::external::ExternalDump;
use super::record::RunRecord;
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

/// An op that differs: over tolerance, or not comparable at all (outputs of other shapes).
fn differs(c: &OpComparison, tolerance: f64) -> bool {
    c.diff.is_err() || c.exceeds(tolerance)
}

/// Bisects comparisons already in execution order, of a run of `ops` ops.
pub fn bisect(
    comparisons: Vec<OpComparison>,
    ops: usize,
    not_compared: Vec<String>,
    tolerance: f64,
) -> Bisection {
    let first = comparisons.iter().position(|c| differs(c, tolerance));
    let last_good = first.and_then(|f| {
        comparisons[..f]
            .iter()
            .rev()
            .find(|c| c.diff.is_ok())
            .cloned()
    });
    Bisection {
        compared: comparisons.len(),
        ops,
        not_compared,
        divergent: comparisons.iter().filter(|c| differs(c, tolerance)).count(),
        last_good,
        first: first.map(|f| comparisons[f].clone()),
        notes: Vec::new(),
    }
}

/// Run `a` against run `b` (the reference).
pub fn bisect_runs(a: &RunRecord, b: &RunRecord, num_heads: usize, tolerance: f64) -> Bisection {
    let missing = a
        .events
        .iter()
        .filter(|e| b.find(e.phase, &e.name).is_none())
        .map(|e| e.dump_name())
        .collect();
    bisect(compare_runs(a, b, num_heads), a.len(), missing, tolerance)
}

/// Run `a` against an external dump (an error when the dump is of other tokens or shapes).
pub fn bisect_dump(
    a: &RunRecord,
    dump: &ExternalDump,
    num_heads: usize,
    tolerance: f64,
) -> Result<Bisection> {
    let r = dump.compare(a, num_heads)?;
    let mut b = bisect(r.comparisons, r.ops, r.not_compared, tolerance);
    b.notes = r.notes;
    Ok(b)
}
