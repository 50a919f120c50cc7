//! The comparison's bookkeeping of its sequence: what mladb ran for each engine step, where an
//! op of a step is in mladb's run, and letting go of the outputs of steps that are done.

use super::live::{Comparator, StepRun};
use crate::debug::flags::Flags;
use crate::debug::record::RunRecord;
use crate::debug::tolerance::Judge;
use crate::engine::Engine;
use crate::tensor::Tensor;
use std::sync::Arc;

/// mladb's reference of the sequence the engine is running.
pub(super) struct Sequence<'m> {
    pub(super) engine: Engine<'m>,
    pub(super) record: RunRecord,
    /// The engine's values at mladb's ops, in mladb's order (kept for the debugger's view).
    pub(super) seen: RunRecord,
    pub(super) judge: Option<Judge>,
    /// Ops of `record` the judge has passed.
    pub(super) judged: usize,
    /// The comparator's count of sequences when this one began.
    pub(super) number: usize,
    /// Each step's tokens so far, in order: what a re-run of the sequence feeds the engine.
    pub(super) history: Vec<Vec<u32>>,
    /// Re-runs of the sequence made to follow them, and the first op the last one changed.
    pub(super) reruns: usize,
    pub(super) recomputed_from: usize,
}

impl<'m> Sequence<'m> {
    pub(super) fn new(engine: Engine<'m>, flags: Flags, number: usize) -> Sequence<'m> {
        Sequence {
            engine,
            number,
            record: RunRecord::new(flags),
            seen: RunRecord::new(flags),
            judge: None,
            judged: 0,
            history: Vec::new(),
            reruns: 0,
            recomputed_from: 0,
        }
    }
}

/// Runs one engine step on mladb's `engine` into `record`: several tokens at position 0 as a
/// prefill, one token as a decode step (a chunked prefill is refused before this).
pub(super) fn run_step(
    engine: &mut Engine,
    tokens: &[u32],
    record: &mut RunRecord,
) -> crate::error::Result<()> {
    if tokens.len() > 1 && engine.position() == 0 {
        engine.prefill(tokens, record)?;
    } else if let [token] = tokens {
        engine.decode(*token, record)?;
    } else {
        return Err(crate::error::Error::invalid(format!(
            "{} tokens at position {} (a chunked prefill)",
            tokens.len(),
            engine.position()
        )));
    }
    Ok(())
}

impl<'m> Comparator<'m> {
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
        let empty = Arc::new(Tensor::from_vec(&[0], Vec::new()));
        let done: Vec<StepRun> = self
            .steps
            .extract_if(|&s, _| s < done)
            .map(|x| x.1)
            .collect();
        for run in done {
            // A step of a sequence no longer held indexes a record that is gone.
            let mut held = [self.seq.as_mut(), self.retired.as_mut()]
                .into_iter()
                .flatten();
            if let Some(seq) = held.find(|s| s.number == run.sequence) {
                for i in run.events.unwrap_or(0..0) {
                    seq.record.outputs[i] = empty.clone();
                }
            }
        }
        let retired = self.retired.as_ref().map(|s| s.number);
        if retired.is_some_and(|n| self.steps.values().all(|r| r.sequence != n)) {
            self.retired = None;
        }
    }

    /// mladb's reference of the sequence step `step` belongs to: the current one, or the one
    /// before it while a rank still sends its steps.
    pub(super) fn seq_of(&self, step: u64) -> Option<&Sequence<'m>> {
        let n = self.steps.get(&step)?.sequence;
        [self.seq.as_ref(), self.retired.as_ref()]
            .into_iter()
            .flatten()
            .find(|s| s.number == n)
    }

    pub(super) fn seq_of_mut(&mut self, step: u64) -> Option<&mut Sequence<'m>> {
        let n = self.steps.get(&step)?.sequence;
        [self.seq.as_mut(), self.retired.as_mut()]
            .into_iter()
            .flatten()
            .find(|s| s.number == n)
    }

    /// The current sequence: mladb's run of it, and the engine's values at its ops so far
    /// (with `keep_engine`).
    pub fn runs(&self) -> Option<(&RunRecord, &RunRecord)> {
        self.seq.as_ref().map(|s| (&s.record, &s.seen))
    }

    /// How many times mladb re-ran the current sequence to follow the engine's choices, and the
    /// first op of its run the last re-run changed (a view that holds the run's ops replaces
    /// those from there on).
    pub fn recomputed(&self) -> Option<(usize, usize)> {
        self.seq.as_ref().map(|s| (s.reruns, s.recomputed_from))
    }

    /// Where mladb's run of `step` has op `op` (a step's ops are its phase's).
    pub(super) fn op_index(&self, step: u64, op: &str) -> Option<usize> {
        let run = self.steps.get(&step)?;
        run.events.as_ref().ok()?;
        self.seq_of(step)?.record.find(run.phase, op)
    }
}
