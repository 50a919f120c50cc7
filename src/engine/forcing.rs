//! Teacher forcing of discrete choices: a run may be told which experts (MoE top-k) or which
//! keys (DSA top-k) to pick at given rows instead of computing them.
//!
//! Why: two correct runs (absorbed vs naive, prefill vs decode, bf16 on two devices) can pick
//! differently when two candidates score within rounding noise of each other, and everything
//! downstream of the flip then differs. The debugger notes such a flip and re-runs the second
//! run with the first run's choice, so that one near-tie does not cascade into dozens of
//! findings. Everything else about the forced op is computed as usual (the MoE weights come
//! from the run's own router scores at the forced experts).

use super::trace::Phase;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// One forced row, as sessions record it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForcedChoice {
    pub phase: Phase,
    pub op: String,
    pub row: usize,
    pub chosen: Vec<usize>,
}

/// Choices to impose, by (phase, op name) and row of that op's output.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ForcedSelections {
    ops: HashMap<(Phase, String), BTreeMap<usize, Vec<usize>>>,
}

impl ForcedSelections {
    /// Forces row `row` of op `name` in `phase` to choose `chosen`.
    pub fn force(&mut self, phase: Phase, name: &str, row: usize, chosen: Vec<usize>) {
        self.ops
            .entry((phase, name.to_string()))
            .or_default()
            .insert(row, chosen);
    }

    /// The forced rows of one op.
    pub fn rows(&self, phase: Phase, name: &str) -> Option<&BTreeMap<usize, Vec<usize>>> {
        self.ops.get(&(phase, name.to_string()))
    }

    /// Number of forced rows over all ops.
    pub fn len(&self) -> usize {
        self.ops.values().map(BTreeMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Every forced row, in a stable order (phase, op, row).
    pub fn entries(&self) -> Vec<ForcedChoice> {
        let mut out: Vec<ForcedChoice> = self
            .ops
            .iter()
            .flat_map(|((phase, op), rows)| {
                rows.iter().map(|(&row, chosen)| ForcedChoice {
                    phase: *phase,
                    op: op.clone(),
                    row,
                    chosen: chosen.clone(),
                })
            })
            .collect();
        out.sort_by(|a, b| (a.phase, &a.op, a.row).cmp(&(b.phase, &b.op, b.row)));
        out
    }

    /// The choices `entries` lists.
    pub fn from_entries(entries: &[ForcedChoice]) -> ForcedSelections {
        let mut f = ForcedSelections::default();
        for e in entries {
            f.force(e.phase, &e.op, e.row, e.chosen.clone());
        }
        f
    }

    /// Replaces the rows of `choices` (one per row of op `name`) that are forced; each forced
    /// choice must name `len` distinct candidates below `candidates(row)`.
    pub fn apply(
        &self,
        phase: Phase,
        name: &str,
        choices: &mut [Vec<usize>],
        candidates: impl Fn(usize) -> usize,
    ) -> Result<()> {
        let Some(rows) = self.rows(phase, name) else {
            return Ok(());
        };
        for (&row, chosen) in rows {
            let slot = choices.get_mut(row).ok_or_else(|| {
                Error::invalid(format!("forced selection: {phase} {name} has no row {row}"))
            })?;
            let limit = candidates(row);
            let mut distinct = chosen.clone();
            distinct.sort_unstable();
            distinct.dedup();
            if chosen.len() != slot.len()
                || distinct.len() != chosen.len()
                || chosen.iter().any(|&c| c >= limit)
            {
                return Err(Error::invalid(format!(
                    "forced selection: {phase} {name} row {row} takes {} distinct candidates \
                     below {limit}, not {chosen:?}",
                    slot.len()
                )));
            }
            *slot = chosen.clone();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forced_rows_replace_only_their_rows() {
        let mut f = ForcedSelections::default();
        f.force(Phase::Prefill, "x.topk", 1, vec![4, 2]);
        let mut choices = vec![vec![0, 1], vec![0, 1]];
        f.apply(Phase::Prefill, "x.topk", &mut choices, |_| 8)
            .unwrap();
        assert_eq!(choices, vec![vec![0, 1], vec![4, 2]]);
        f.apply(Phase::Decode(0), "x.topk", &mut choices, |_| 8)
            .unwrap();
        assert_eq!(f.len(), 1);
        assert_eq!(ForcedSelections::from_entries(&f.entries()), f);
        let mut bad = ForcedSelections::default();
        bad.force(Phase::Prefill, "x.topk", 0, vec![9, 1]);
        assert!(bad
            .apply(Phase::Prefill, "x.topk", &mut choices, |_| 8)
            .is_err());
        bad.force(Phase::Prefill, "x.topk", 0, vec![1, 1]);
        assert!(bad
            .apply(Phase::Prefill, "x.topk", &mut choices, |_| 8)
            .is_err());
        bad.force(Phase::Prefill, "x.topk", 5, vec![1, 2]);
        assert!(bad
            .apply(Phase::Prefill, "x.topk", &mut choices, |_| 8)
            .is_err());
    }
}
