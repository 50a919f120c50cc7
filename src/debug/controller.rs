//! The execution controller: step one op, step to the next layer, continue to a breakpoint or
//! the end, restart, and change flags while paused.
//!
//! The engine runs on a worker thread and stops after every op until the controller lets it go
//! on, so "paused at op k" is a real pause of a real execution. A flag change stops the worker
//! and starts a new one under the new flags, which takes every op before the first op the change
//! affects from the previous run (see [`Flags::first_affected`]) and computes the rest, up to
//! where the previous run was paused. The previous run is kept, and the two are compared op by op.

use super::breakpoint::Breakpoint;
use super::compare::{compare_outputs, compare_runs, OpComparison};
use super::flags::Flags;
use super::record::{ReplayPrefix, RunRecord};
use super::tolerance::Tolerances;
use crate::backend::Backend;
use crate::engine::generate::{self, Outcome, Schedule};
use crate::engine::trace::{Observer, OpEvent, Phase};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::tensor::Tensor;
use serde::Serialize;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

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

enum Message {
    Op(Box<OpEvent>, Arc<Tensor>),
    Done(std::result::Result<Outcome, String>),
}

enum Gate {
    Go,
    Stop,
}

/// The engine's observer on the worker thread: hands each op over, then waits to be let go on.
struct GateObserver {
    events: Sender<Message>,
    gate: Receiver<Gate>,
}

const STOPPED: &str = "stopped by the debugger";

impl Observer for GateObserver {
    fn on_op(&mut self, event: &OpEvent, output: &Tensor) -> Result<()> {
        let stopped = || Error::invalid(STOPPED);
        self.events
            .send(Message::Op(
                Box::new(event.clone()),
                Arc::new(output.clone()),
            ))
            .map_err(|_| stopped())?;
        match self.gate.recv() {
            Ok(Gate::Go) => Ok(()),
            _ => Err(stopped()),
        }
    }
}

struct Worker {
    events: Receiver<Message>,
    gate: Sender<Gate>,
    handle: Option<JoinHandle<()>>,
    /// The worker is paused after an op the controller has received.
    paused: bool,
    done: bool,
}

impl Worker {
    /// Stops the engine (if still running) and waits for the thread.
    fn stop(&mut self) {
        if !self.done {
            let _ = self.gate.send(Gate::Stop);
            while let Ok(msg) = self.events.recv() {
                if matches!(msg, Message::Done(_)) {
                    break;
                }
                let _ = self.gate.send(Gate::Stop);
            }
            self.done = true;
        }
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop();
    }
}

pub struct Controller {
    model: Arc<Model>,
    backend: Arc<dyn Backend>,
    schedule: Schedule,
    layers: Range<usize>,
    flags: Flags,
    current: RunRecord,
    /// Earlier runs, oldest first.
    history: Vec<Arc<RunRecord>>,
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

    pub fn add_breakpoint(&mut self, bp: Breakpoint) {
        if !self.breakpoints.contains(&bp) {
            self.breakpoints.push(bp);
        }
    }

    /// Removes a breakpoint; returns whether it was set.
    pub fn remove_breakpoint(&mut self, bp: &Breakpoint) -> bool {
        let before = self.breakpoints.len();
        self.breakpoints.retain(|b| b != bp);
        before != self.breakpoints.len()
    }

    /// Sets the breakpoint if absent, removes it if present; returns whether it is now set.
    pub fn toggle_breakpoint(&mut self, bp: Breakpoint) -> bool {
        if self.remove_breakpoint(&bp) {
            false
        } else {
            self.add_breakpoint(bp);
            true
        }
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

    /// The first breakpoint op `i` of the current run triggers.
    fn breakpoint_hit(&self, i: usize) -> Option<usize> {
        if self.breakpoints.is_empty() {
            return None;
        }
        let e = &self.current.events[i];
        let previous = i.checked_sub(1).map(|p| &self.current.events[p]);
        let diff = self.op_diff(i).and_then(|c| c.diff.ok()).map(|d| d.error());
        self.breakpoints
            .iter()
            .position(|b| b.hits(e, previous, diff))
    }

    /// Op `i` of the current run compared with the same op of the comparison run.
    pub fn op_diff(&self, i: usize) -> Option<OpComparison> {
        let other = self.comparison()?;
        let e = &self.current.events[i];
        let j = other.find(e.phase, &e.name)?;
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
                &Tolerances::Table(self.current.flags.dtype),
            ),
            None => Vec::new(),
        }
    }

    /// Starts the run over under the current flags; the finished or partial run is kept.
    pub fn restart(&mut self) {
        self.worker.stop();
        let previous = std::mem::replace(&mut self.current, RunRecord::new(self.flags));
        self.history.push(Arc::new(previous));
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
        self.worker.stop();
        if let Some(b) = backend {
            self.backend = b;
        }
        self.cancel.store(false, Ordering::Relaxed);
        let old = Arc::new(std::mem::replace(&mut self.current, RunRecord::new(new)));
        let first = self.flags.first_affected(&new, &old.events);
        let until = first.unwrap_or(old.len());
        self.history.push(old.clone());
        self.comparison = Some(self.history.len() - 1);
        self.flags = new;
        self.worker = spawn(
            &self.model,
            &self.backend,
            &self.schedule,
            &self.layers,
            new,
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
        Ok(FlagChange {
            first_affected: first.map(|i| (i, old.events[i].phase, old.events[i].name.clone())),
            replayed: self.current.counts.replayed,
            executed: self.current.counts.executed,
            note: None,
        })
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

/// Starts the engine on a worker thread, paused before its first op is handed over.
fn spawn(
    model: &Arc<Model>,
    backend: &Arc<dyn Backend>,
    schedule: &Schedule,
    layers: &Range<usize>,
    flags: Flags,
    replay: Option<(Arc<RunRecord>, usize)>,
) -> Worker {
    let (event_tx, event_rx) = channel();
    let (gate_tx, gate_rx) = channel();
    let (model, backend, schedule, layers) = (
        model.clone(),
        backend.clone(),
        schedule.clone(),
        layers.clone(),
    );
    let handle = std::thread::Builder::new()
        .name("mladb-engine".into())
        .spawn(move || {
            let events = event_tx.clone();
            let result = (|| {
                let options = flags.engine_options(layers, true)?;
                let mut engine = Engine::new(&model, backend.as_ref(), options)?;
                let prefix = replay.as_ref().map(|(record, until)| ReplayPrefix {
                    record,
                    until: *until,
                });
                if let Some(p) = &prefix {
                    engine = engine.with_replay(p);
                }
                let mut observer = GateObserver {
                    events,
                    gate: gate_rx,
                };
                generate::run(&mut engine, &schedule, &mut observer)
            })();
            let _ = event_tx.send(Message::Done(result.map_err(|e| e.to_string())));
        })
        .expect("the engine thread starts");
    Worker {
        events: event_rx,
        gate: gate_tx,
        handle: Some(handle),
        paused: false,
        done: false,
    }
}
