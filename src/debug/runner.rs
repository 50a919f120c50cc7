//! Runs a schedule to its end under a set of flags and keeps everything: the building block of
//! `check`, `bisect` and the comparisons.

use super::flags::Flags;
use super::record::{ReplayPrefix, RunRecord};
use crate::backend::Backend;
use crate::engine::generate::{self, Schedule};
use crate::engine::{Engine, ForcedSelections};
use crate::error::Result;
use crate::model::Model;
use std::ops::Range;
use std::sync::Arc;

/// What every run of one debugging job shares.
#[derive(Clone, Copy)]
pub struct Job<'a> {
    pub model: &'a Model,
    pub backend: &'a dyn Backend,
    pub schedule: &'a Schedule,
    pub layers: &'a Range<usize>,
    /// Poisoned buffers, so unwritten elements show (the debugger always wants this).
    pub poison: bool,
}

impl Job<'_> {
    /// Runs the schedule with `flags`, taking the ops before `replay.until` from `replay`.
    pub fn run(&self, flags: Flags, replay: Option<ReplayPrefix>) -> Result<RunRecord> {
        self.run_schedule(flags, self.schedule, replay)
    }

    /// Runs another schedule (a whole-sequence prefill, say) with `flags`.
    pub fn run_schedule(
        &self,
        flags: Flags,
        schedule: &Schedule,
        replay: Option<ReplayPrefix>,
    ) -> Result<RunRecord> {
        self.run_forced(flags, schedule, &Arc::default(), replay)
    }

    /// Runs `schedule` with `flags`, making the `forced` choices instead of computing them.
    pub fn run_forced(
        &self,
        flags: Flags,
        schedule: &Schedule,
        forced: &Arc<ForcedSelections>,
        replay: Option<ReplayPrefix>,
    ) -> Result<RunRecord> {
        let mut options = flags.engine_options(self.layers.clone(), self.poison)?;
        options.forced = forced.clone();
        let mut engine = Engine::new(self.model, self.backend, options)?;
        if let Some(r) = &replay {
            engine = engine.with_replay(r);
        }
        let mut record = RunRecord::new(flags);
        record.forced = forced.clone();
        let outcome = generate::run(&mut engine, schedule, &mut record)?;
        record.outcome = Some(outcome);
        Ok(record)
    }
}

/// A whole CPU run of built-in layout `layout` with synthetic weights of `seed`, poisoned,
/// default flags: what unit tests of the detectors examine.
#[cfg(test)]
pub fn cpu_run(layout: &str, seed: u64, schedule: Schedule) -> RunRecord {
    let model = Model::synthetic(
        crate::model::Layout::resolve(layout).unwrap(),
        seed,
        1 << 30,
    )
    .unwrap();
    let layers = 0..model.layout.num_layers;
    let job = Job {
        model: &model,
        backend: &crate::backend::cpu::CpuBackend,
        schedule: &schedule,
        layers: &layers,
        poison: true,
    };
    job.run(Flags::default(), None).unwrap()
}
