//! A run as the debugger keeps it: the flags it ran with, every event and every output, and how
//! many ops were computed or taken from an earlier run. A record is an [`Observer`] (it fills as
//! the engine runs) and a [`Replay`] source (a later run may reuse its leading ops).

use super::flags::Flags;
use crate::engine::generate::Outcome;
use crate::engine::trace::{Observer, OpEvent, Phase, Replay};
use crate::engine::{ForcedSelections, OpCounts};
use crate::error::Result;
use crate::tensor::Tensor;
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Debug, Clone, Default)]
pub struct RunRecord {
    pub flags: Flags,
    pub events: Vec<OpEvent>,
    pub outputs: Vec<Arc<Tensor>>,
    pub counts: OpCounts,
    /// Set when the run finished.
    pub outcome: Option<Outcome>,
    /// Set when the run failed or was stopped.
    pub error: Option<String>,
    /// Choices the run was made to take instead of computing them (teacher forcing; empty for
    /// a plain run).
    pub forced: Arc<ForcedSelections>,
    by_name: HashMap<(Phase, Option<usize>, String), usize>,
}

impl RunRecord {
    pub fn new(flags: Flags) -> RunRecord {
        RunRecord {
            flags,
            ..RunRecord::default()
        }
    }

    pub fn push(&mut self, event: OpEvent, output: Arc<Tensor>) {
        let key = (event.phase, event.rank, event.name.clone());
        self.by_name.insert(key, self.events.len());
        if event.replayed {
            self.counts.replayed += 1;
        } else {
            self.counts.executed += 1;
        }
        self.events.push(event);
        self.outputs.push(output);
    }

    /// Replaces op `index` by the same op computed again (its name and phase unchanged).
    pub fn replace(&mut self, index: usize, event: OpEvent, output: Arc<Tensor>) {
        if index < self.events.len() {
            self.events[index] = event;
            self.outputs[index] = output;
        }
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    pub fn finished(&self) -> bool {
        self.outcome.is_some()
    }

    /// Index of op `name` in `phase` (rank 0's under tensor parallelism).
    pub fn find(&self, phase: Phase, name: &str) -> Option<usize> {
        self.find_at(phase, None, name)
            .or_else(|| self.find_at(phase, Some(0), name))
    }

    /// Index of op `name` in `phase` run by `rank`.
    pub fn find_at(&self, phase: Phase, rank: Option<usize>, name: &str) -> Option<usize> {
        self.by_name.get(&(phase, rank, name.to_string())).copied()
    }

    /// Index of op `name` in the phase of `e`, run by the rank of `e`: the op of this run that
    /// pairs with a related op `e` of this run or of another with the same ranks.
    pub fn find_for(&self, e: &OpEvent, name: &str) -> Option<usize> {
        self.find_at(e.phase, e.rank, name)
    }

    /// Output of op `name` in `phase` (rank 0's under tensor parallelism).
    pub fn output(&self, phase: Phase, name: &str) -> Option<&Tensor> {
        self.find(phase, name).map(|i| &*self.outputs[i])
    }

    /// Output of op `name` in the phase and rank of `e` (see [`RunRecord::find_for`]).
    pub fn output_for(&self, e: &OpEvent, name: &str) -> Option<&Tensor> {
        self.find_for(e, name).map(|i| &*self.outputs[i])
    }

    /// The phases the run went through, in order.
    pub fn phases(&self) -> Vec<Phase> {
        let mut phases: Vec<Phase> = Vec::new();
        for e in &self.events {
            if phases.last() != Some(&e.phase) {
                phases.push(e.phase);
            }
        }
        phases
    }
}

impl Observer for RunRecord {
    fn on_op(&mut self, event: &OpEvent, output: &Tensor) -> Result<()> {
        self.push(event.clone(), Arc::new(output.clone()));
        Ok(())
    }
}

/// The leading ops of a record, up to (not including) `until`, offered for replay.
pub struct ReplayPrefix<'a> {
    pub record: &'a RunRecord,
    pub until: usize,
}

impl Replay for ReplayPrefix<'_> {
    fn lookup(&self, index: usize, phase: Phase, name: &str) -> Option<(&OpEvent, &Tensor)> {
        if index >= self.until {
            return None;
        }
        let e = self.record.events.get(index)?;
        (e.phase == phase && e.name == name).then(|| (e, &*self.record.outputs[index]))
    }
}
