//! Following the engine's choice: where the engine chose other experts or other keys than
//! mladb from numbers that agree within noise (a selection flip), mladb re-runs its reference of
//! the sequence with the engine's choice imposed at those rows, as `check` forces a flip, so
//! that every op after the choice is still compared, with what mladb computes from the
//! engine's choice, rather than excused.

use super::live::Comparator;
use super::sequence::run_step;
use crate::debug::record::RunRecord;
use crate::engine::trace::{OpEvent, Phase};
use crate::engine::{Engine, ForcedSelections};
use crate::tensor::{BufferId, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// Re-runs of one sequence made to follow flips; past them a flip is excused as before (the
/// rest of its layer is not judged), since each re-run repeats the whole sequence.
pub const MAX_RERUNS: usize = 16;

impl<'m> Comparator<'m> {
    /// A fresh engine for mladb's reference of a sequence, with `forced` choices imposed.
    pub(super) fn new_engine(&self, forced: ForcedSelections) -> Result<Engine<'m>, String> {
        let mut options = self
            .flags
            .engine_options(self.layers.clone(), true)
            .map_err(|e| e.to_string())?;
        options.forced = Arc::new(forced);
        Engine::new(self.model, self.backend, options).map_err(|e| e.to_string())
    }

    /// Imposes the engine's choice (`rows`: row, the candidates it chose) at choice op `op` of
    /// `phase` on mladb's reference of `step`'s sequence, and re-runs the sequence so far with every choice imposed
    /// until now. On success mladb's run, engine and judge follow the re-run; otherwise nothing
    /// changes and the reason is returned.
    pub(super) fn force_choice(
        &mut self,
        step: u64,
        phase: Phase,
        op: &str,
        rows: &[(usize, Vec<usize>)],
    ) -> Result<(), String> {
        let seq = self
            .seq_of_mut(step)
            .ok_or("no sequence is being compared")?;
        if seq.reruns >= MAX_RERUNS {
            return Err(format!(
                "mladb re-ran this sequence {MAX_RERUNS} times to follow earlier flips already"
            ));
        }
        // The choices imposed so far are the record's (the engine's flips it follows).
        let mut forced = (*seq.record.forced).clone();
        for (row, chosen) in rows {
            forced.force(phase, op, *row, chosen.clone());
        }
        let mut engine = self.new_engine(forced.clone())?;
        let seq = self.seq_of_mut(step).expect("checked above");
        let old = &seq.record;
        let mut record = RunRecord::new(old.flags);
        record.forced = Arc::new(forced.clone());
        let empty = Arc::new(Tensor::from_vec(&[0], Vec::new()));
        for tokens in &seq.history {
            let start = record.len();
            run_step(&mut engine, tokens, &mut record).map_err(|e| {
                format!("mladb's reference failed with the engine's choice imposed: {e}")
            })?;
            // What the comparison let go of stays let go of: a re-run holds no more memory
            // than the run it replaces.
            for i in start..record.len().min(old.len()) {
                if old.outputs[i].numel() == 0 {
                    record.outputs[i] = empty.clone();
                }
            }
        }
        if !same_ops(&old.events, &record.events) {
            return Err(
                "with the engine's choice imposed mladb's run has other ops (an op per chosen expert?)"
                    .into(),
            );
        }
        let from = old
            .events
            .iter()
            .position(|e| e.phase == phase && e.name == op)
            .unwrap_or(0);
        if let Some(judge) = seq.judge.as_mut() {
            judge.rename(&buffer_ids(&old.events, &record.events));
        }
        seq.record = record;
        seq.engine = engine;
        seq.reruns += 1;
        seq.recomputed_from = from;
        Ok(())
    }
}

/// The two runs hold the same ops in the same order, so an index of one is the same op in the
/// other.
fn same_ops(a: &[OpEvent], b: &[OpEvent]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.phase == y.phase && x.name == y.name && x.kind == y.kind)
}

/// Each buffer of the old run's ops, mapped to the buffer in its place in the re-run.
fn buffer_ids(old: &[OpEvent], new: &[OpEvent]) -> HashMap<BufferId, BufferId> {
    let mut ids = HashMap::new();
    for (a, b) in old.iter().zip(new) {
        ids.insert(a.output.id, b.output.id);
        if let (Some(x), Some(y)) = (&a.kernel_wrote, &b.kernel_wrote) {
            ids.insert(x.id, y.id);
        }
        for (x, y) in a.inputs.iter().zip(&b.inputs) {
            ids.insert(x.id, y.id);
        }
    }
    ids
}
