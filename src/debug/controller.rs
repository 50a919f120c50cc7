//! The execution controller: step one op, step to the next layer, continue to a breakpoint or
//! the end, restart, and change flags while paused.
//!
//! The engine runs on a worker thread and stops after every op until the controller lets it go
//! on, so "paused at op k" is a real pause of a real execution. A flag change stops the worker
//! and starts a new one under the new flags, which takes every op before the first op the change
//! affects from the previous run (see [`Flags::first_affected`]) and computes the rest, up to
//! where the previous run was paused. The previous run is kept, and the two are compared op by op.

use super::breakpoint::{self, first_hit, Breakpoint};
use super::compare::{compare_outputs, compare_runs, OpComparison};
use super::flags::Flags;
use super::record::RunRecord;
use super::tolerance::Tolerances;
use super::worker::{spawn, Gate, Message, Worker};
use crate::backend::Backend;
use crate::engine::generate::Schedule;
use crate::engine::trace::{OpEvent, Phase};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::tensor::Tensor;
use serde::Serialize;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Where execution stands: the last op executed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Position {
    pub index: usize,
    pub phase: Phase,
    pub layer: Option<usize>,
    pub op: String,
}

/// Why execution stopped.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Stop {
    /// One op was executed (a step).
    Stepped,
    /// The first op of another layer (or of the final ops) was reached.
    NextLayer,
    /// Breakpoint `n` of the list hit at the current position.
    Breakpoint(usize),
    /// The run reached its end.
    End,
    /// The engine failed; the message says why.
    Failed(String),
    /// The user cancelled a long run; the engine is paused where it was.
    Cancelled,
}

/// What a flag change did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FlagChange {
    /// The first op of the previous run the change affects: (index, phase, op).
    pub first_affected: Option<(usize, Phase, String)>,
    pub replayed: usize,
    pub executed: usize,
    /// Anything worth saying (a flag with nothing to act on).
    pub note: Option<String>,
}

pub struct Controller {
    model: Arc<Model>,
    backend: Arc<dyn Backend>,
    schedule: Schedule,
    layers: Range<usize>,
    flags: Flags,
    current: RunRecord,
    /// Earlier runs, oldest first, and the schedule each ran.
    history: Vec<Arc<RunRecord>>,
    history_schedules: Vec<Schedule>,
    /// Index into `history` of the run the current one is compared with.
    comparison: Option<usize>,
    breakpoints: Vec<Breakpoint>,
    worker: Worker,
    /// Set from another thread to stop a running `continue`, `next_layer` or re-execution
    /// between two ops.
    cancel: Arc<AtomicBool>,
    /// Told of every op as it arrives (a UI streams them).
    listener: Option<Listener>,
}

/// A callback for every op the controller receives: (run number, the run's flags, event, output).
pub type Listener = Box<dyn FnMut(usize, &Flags, &OpEvent, &Arc<Tensor>) + Send>;

impl Controller {
    /// Starts a paused run: nothing has executed yet.
    pub fn new(
        model: Arc<Model>,
        backend: Arc<dyn Backend>,
        schedule: Schedule,
        layers: Range<usize>,
        flags: Flags,
    ) -> Result<Controller> {
        schedule.validate()?;
        flags.engine_options(layers.clone(), true)?;
        let worker = spawn(&model, &backend, &schedule, &layers, flags, None);
        Ok(Controller {
            model,
            backend,
            schedule,
            layers,
            flags,
            current: RunRecord::new(flags),
            history: Vec::new(),
            history_schedules: Vec::new(),
            comparison: None,
            breakpoints: Vec::new(),
            worker,
            cancel: Arc::new(AtomicBool::new(false)),
            listener: None,
        })
    }

    /// The flag that cancels a running command when set (it is cleared when a command starts).
    pub fn cancel_flag(&self) -> Arc<AtomicBool> {
        self.cancel.clone()
    }

    /// Shares a cancel flag owned elsewhere (a UI thread sets it on Esc).
    pub fn set_cancel_flag(&mut self, flag: Arc<AtomicBool>) {
        self.cancel = flag;
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Sets the callback told of every op as it arrives.
    pub fn set_listener(&mut self, listener: Listener) {
        self.listener = Some(listener);
    }

    /// The number of the current run: runs are numbered from 0, earlier ones are in
    /// `history()` at their number.
    pub fn run_number(&self) -> usize {
        self.history.len()
    }

    pub fn layers(&self) -> &Range<usize> {
        &self.layers
    }

    fn cancelled(&self) -> bool {
        self.cancel.swap(false, Ordering::Relaxed)
    }

    pub fn flags(&self) -> Flags {
        self.flags
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn model_arc(&self) -> Arc<Model> {
        self.model.clone()
    }

    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The run in progress (or finished).
    pub fn current(&self) -> &RunRecord {
        &self.current
    }

    /// Earlier runs, oldest first.
    pub fn history(&self) -> &[Arc<RunRecord>] {
        &self.history
    }

    /// The schedule run `n` ran (the current schedule for the current run).
    pub fn schedule_of(&self, n: usize) -> &Schedule {
        self.history_schedules.get(n).unwrap_or(&self.schedule)
    }

    /// The run the current one is compared with, if any.
    pub fn comparison(&self) -> Option<&RunRecord> {
        self.comparison.map(|i| &*self.history[i])
    }

    /// Compares with earlier run `index` of the history.
    pub fn compare_with(&mut self, index: usize) -> Result<()> {
        if index >= self.history.len() {
            return Err(Error::invalid(format!("there is no earlier run {index}")));
        }
        self.comparison = Some(index);
        Ok(())
    }

    pub fn breakpoints(&self) -> &[Breakpoint] {
        &self.breakpoints
    }

    /// The breakpoints, for the commands that change them (see [`crate::debug::breakpoint`]).
    pub fn breakpoints_mut(&mut self) -> &mut Vec<Breakpoint> {
        &mut self.breakpoints
    }

    pub fn add_breakpoint(&mut self, bp: Breakpoint) {
        breakpoint::add(&mut self.breakpoints, bp)
    }

    /// Removes a breakpoint; returns whether it was set.
    pub fn remove_breakpoint(&mut self, bp: &Breakpoint) -> bool {
        breakpoint::remove(&mut self.breakpoints, bp)
    }

    /// Removes every breakpoint; returns how many there were.
    pub fn clear_breakpoints(&mut self) -> usize {
        std::mem::take(&mut self.breakpoints).len()
    }

    /// Sets the breakpoint if absent, removes it if present; returns whether it is now set.
    pub fn toggle_breakpoint(&mut self, bp: Breakpoint) -> bool {
        breakpoint::toggle(&mut self.breakpoints, bp)
    }

    /// The last op executed, or `None` before the first.
    pub fn position(&self) -> Option<Position> {
        let e = self.current.events.last()?;
        Some(Position {
            index: e.index,
            phase: e.phase,
            layer: e.layer,
            op: e.name.clone(),
        })
    }

    pub fn finished(&self) -> bool {
        self.worker.done
    }

    /// Lets the engine run one more op. Returns its index, or `None` when the run ended (the
    /// outcome or the error is then in the current record).
    fn advance(&mut self) -> Option<usize> {
        if self.worker.done {
            return None;
        }
        if self.worker.paused {
            if self.worker.gate.send(Gate::Go).is_err() {
                self.worker.done = true;
                return None;
            }
            self.worker.paused = false;
        }
        match self.worker.events.recv() {
            Ok(Message::Op(event, output)) => {
                if let Some(listener) = &mut self.listener {
                    listener(self.history.len(), &self.current.flags, &event, &output);
                }
                self.current.push(*event, output);
                self.worker.paused = true;
                Some(self.current.len() - 1)
            }
            Ok(Message::Done(result)) => {
                self.worker.done = true;
                match result {
                    Ok(outcome) => self.current.outcome = Some(outcome),
                    Err(e) => self.current.error = Some(e),
                }
                None
            }
            Err(_) => {
                self.worker.done = true;
                self.current.error = Some("the engine thread ended unexpectedly".to_string());
                None
            }
        }
    }

    fn ended(&self) -> Stop {
        match &self.current.error {
            Some(e) => Stop::Failed(e.clone()),
            None => Stop::End,
        }
    }

    /// Executes one op.
    pub fn step(&mut self) -> Stop {
        match self.advance() {
            Some(_) => Stop::Stepped,
            None => self.ended(),
        }
    }

    /// Runs to the first op of the next layer (or of the ops after the last layer, or of the
    /// next phase), stopping early at a breakpoint.
    pub fn next_layer(&mut self) -> Stop {
        let start = self.current.events.last().map(|e| (e.phase, e.layer));
        self.cancel.store(false, Ordering::Relaxed);
        loop {
            if self.cancelled() {
                return Stop::Cancelled;
            }
            let Some(i) = self.advance() else {
                return self.ended();
            };
            if let Some(b) = self.breakpoint_hit(i) {
                return Stop::Breakpoint(b);
            }
            let e = &self.current.events[i];
            let moved = match start {
                None => e.layer.is_some(),
                Some((phase, layer)) => e.phase != phase || e.layer != layer,
            };
            if moved {
                return Stop::NextLayer;
            }
        }
    }

    /// Runs until a breakpoint is hit or the run ends.
    pub fn continue_run(&mut self) -> Stop {
        self.cancel.store(false, Ordering::Relaxed);
        loop {
            if self.cancelled() {
                return Stop::Cancelled;
            }
            let Some(i) = self.advance() else {
                return self.ended();
            };
            if let Some(b) = self.breakpoint_hit(i) {
                return Stop::Breakpoint(b);
            }
        }
    }

    /// Runs until op `index` has executed (or the run ends, or is cancelled); breakpoints on
    /// the way do not stop it.
    pub fn run_to(&mut self, index: usize) -> Stop {
        self.cancel.store(false, Ordering::Relaxed);
        while self.current.len() <= index {
            if self.cancelled() {
                return Stop::Cancelled;
            }
            if self.advance().is_none() {
                return self.ended();
            }
        }
        Stop::Stepped
    }

    /// The first breakpoint op `i` of the current run triggers.
    fn breakpoint_hit(&self, i: usize) -> Option<usize> {
        let diff = |j: usize| self.op_diff(j).and_then(|c| c.diff.ok()).map(|d| d.error());
        first_hit(&self.breakpoints, &self.current.events, i, &diff)
    }

    /// Op `i` of the current run compared with the same op of the comparison run.
    pub fn op_diff(&self, i: usize) -> Option<OpComparison> {
        let other = self.comparison()?;
        let e = &self.current.events[i];
        let j = other.find_for(e, &e.name)?;
        Some(compare_outputs(
            e,
            i,
            self.current.outputs[i].data(),
            &other.events[j].shape,
            other.outputs[j].data(),
            self.model.layout.num_heads,
        ))
    }

    /// Every op of the current run compared with the comparison run.
    pub fn diff_runs(&self) -> Vec<OpComparison> {
        match self.comparison() {
            Some(other) => compare_runs(
                &self.current,
                other,
                self.model.layout.num_heads,
                &Tolerances::table_for(self.current.flags.dtype, other.flags.dtype),
            ),
            None => Vec::new(),
        }
    }

    /// Starts the run over under the current flags; the finished or partial run is kept.
    pub fn restart(&mut self) {
        self.worker.stop();
        let previous = std::mem::replace(&mut self.current, RunRecord::new(self.flags));
        self.history.push(Arc::new(previous));
        self.history_schedules.push(self.schedule.clone());
        self.worker = spawn(
            &self.model,
            &self.backend,
            &self.schedule,
            &self.layers,
            self.flags,
            None,
        );
    }

    /// Changes one flag (see [`Flags::set`]) and re-executes.
    pub fn set_flag(&mut self, key: &str, value: &str) -> Result<FlagChange> {
        let mut flags = self.flags;
        let mut note = flags.set(key, value)?;
        if key == "force-dequant" && !self.model.has_quantized_kv_b() {
            note = Some(super::flags::FORCE_DEQUANT_IDLE.to_string());
        }
        let mut change = self.set_flags(flags)?;
        change.note = note;
        Ok(change)
    }

    /// Changes the flags: re-executes from the first op the change affects, up to where the
    /// current run stands, keeping the current run for comparison.
    pub fn set_flags(&mut self, new: Flags) -> Result<FlagChange> {
        new.engine_options(self.layers.clone(), true)?;
        new.check_layout(&self.model.layout)?;
        let mut inert = self.flags;
        if !self.model.has_quantized_kv_b() {
            inert.force_dequant = new.force_dequant;
        }
        if inert == new {
            // Nothing the engine reads changed (force-dequant without a quantized kv_b_proj).
            self.flags = new;
            self.current.flags = new;
            return Ok(FlagChange {
                first_affected: None,
                replayed: 0,
                executed: 0,
                note: None,
            });
        }
        // Another device, or another storage type on the GPU, needs another backend.
        let device_changed = new.device != self.flags.device
            || (new.device == super::flags::DeviceFlag::Cuda && new.dtype != self.flags.dtype);
        let backend = if device_changed {
            let choice = match new.device {
                super::flags::DeviceFlag::Cpu => crate::backend::DeviceChoice::Cpu,
                super::flags::DeviceFlag::Cuda => crate::backend::DeviceChoice::Cuda,
            };
            Some(Arc::<dyn Backend>::from(
                crate::backend::select(choice, new.dtype)?.0,
            ))
        } else {
            None
        };
        if let Some(b) = backend {
            self.worker.stop();
            self.backend = b;
        }
        let first = self.flags.first_affected(&new, &self.current.events);
        Ok(self.reexecute(new, self.schedule.clone(), first))
    }

    /// Changes the schedule (prompt, prefill, decode steps): re-executes from the first op of
    /// the first phase the change affects (the ops before it are the same computation), up to
    /// where the current run stands, keeping the current run for comparison.
    pub fn set_schedule(&mut self, new: Schedule) -> Result<FlagChange> {
        new.validate()?;
        let first = self
            .schedule
            .first_changed_phase(&new)
            .and_then(|phase| self.current.events.iter().position(|e| e.phase >= phase));
        Ok(self.reexecute(self.flags, new, first))
    }

    /// Starts a new run under `flags` and `schedule` that takes the ops before `first` (all of
    /// them when `None`) from the current run, and runs it to where the current run stood.
    fn reexecute(&mut self, flags: Flags, schedule: Schedule, first: Option<usize>) -> FlagChange {
        self.worker.stop();
        self.cancel.store(false, Ordering::Relaxed);
        let old = Arc::new(std::mem::replace(&mut self.current, RunRecord::new(flags)));
        let until = first.unwrap_or(old.len());
        self.history.push(old.clone());
        self.history_schedules
            .push(std::mem::replace(&mut self.schedule, schedule));
        self.comparison = Some(self.history.len() - 1);
        self.flags = flags;
        self.worker = spawn(
            &self.model,
            &self.backend,
            &self.schedule,
            &self.layers,
            flags,
            Some((old.clone(), until)),
        );
        // Run to where the previous run stood: its end, or its last op (or the point where the
        // new run passes it, when the change removed that op).
        match old.events.last() {
            _ if old.finished() => while !self.cancelled() && self.advance().is_some() {},
            None => {}
            Some(stop) => {
                let target = order_key(stop);
                while let Some(i) = self.advance() {
                    if self.cancelled() {
                        break;
                    }
                    let e = &self.current.events[i];
                    if (e.phase, &e.name) == (stop.phase, &stop.name) || order_key(e) > target {
                        break;
                    }
                }
            }
        }
        FlagChange {
            first_affected: first.map(|i| (i, old.events[i].phase, old.events[i].name.clone())),
            replayed: self.current.counts.replayed,
            executed: self.current.counts.executed,
            note: None,
        }
    }
}

/// Where an op stands in execution order across runs whose op lists differ: phase, then layer
/// (the embedding before every layer, the final ops after).
fn order_key(e: &OpEvent) -> (Phase, i64) {
    let layer = match (e.layer, e.kind) {
        (Some(l), _) => l as i64,
        (None, crate::engine::OpKind::Embedding) => -1,
        (None, _) => i64::MAX,
    };
    (e.phase, layer)
}
