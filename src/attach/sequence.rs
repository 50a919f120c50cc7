//! The comparison's bookkeeping of its sequence: what mladb ran for each engine step, where an
//! op of a step is in mladb's run, and letting go of the outputs of steps that are done.

use super::live::Comparator;
use crate::debug::record::RunRecord;
use crate::tensor::Tensor;
use std::sync::Arc;

impl Comparator<'_> {
    /// Lets go of mladb's outputs of the steps every rank has gone past (their tensors all came
    /// before: each connection sends in order), so that a long attachment holds the outputs of
    /// the steps in flight only, not of the whole sequence.
    pub(super) fn release_done_steps(&mut self) {
        // Every rank must have said hello (one not yet connected may still send any step); a
        // rank that closed sent everything.
        if (self.ranks.len() as u32) < self.world {
            return;
        }
        let Some(Some(done)) = self.conns.values().map(|c| c.step).min() else {
            return;
        };
        let (Some(seq), empty) = (
            self.seq.as_mut(),
            Arc::new(Tensor::from_vec(&[0], Vec::new())),
        ) else {
            return;
        };
        let current = self.sequences;
        for (_, run) in self.steps.extract_if(|&s, _| s < done) {
            // A step of an earlier sequence indexes a record that is gone.
            if run.sequence == current {
                for i in run.events.unwrap_or(0..0) {
                    seq.record.outputs[i] = empty.clone();
                }
            }
        }
    }

    /// The current sequence: mladb's run of it, and the engine's values at its ops so far
    /// (with `keep_engine`).
    pub fn runs(&self) -> Option<(&RunRecord, &RunRecord)> {
        self.seq.as_ref().map(|s| (&s.record, &s.seen))
    }

    /// Where mladb's run of `step` has op `op` (a step's ops are its phase's).
    pub(super) fn op_index(&self, step: u64, op: &str) -> Option<usize> {
        let run = self.steps.get(&step)?;
        run.events.as_ref().ok()?;
        self.seq.as_ref()?.record.find(run.phase, op)
    }
}
