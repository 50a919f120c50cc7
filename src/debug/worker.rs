//! The engine on a worker thread that stops after every op until the controller lets it go on:
//! what makes "paused at op k" a real pause of a real execution.

use super::flags::Flags;
use super::record::{ReplayPrefix, RunRecord};
use crate::backend::Backend;
use crate::engine::generate::{self, Outcome, Schedule};
use crate::engine::trace::{Observer, OpEvent};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::tensor::Tensor;
use std::ops::Range;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

pub(super) enum Message {
    Op(Box<OpEvent>, Arc<Tensor>),
    Done(std::result::Result<Outcome, String>),
}

pub(super) enum Gate {
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

pub(super) struct Worker {
    pub(super) events: Receiver<Message>,
    pub(super) gate: Sender<Gate>,
    handle: Option<JoinHandle<()>>,
    /// The worker is paused after an op the controller has received.
    pub(super) paused: bool,
    pub(super) done: bool,
}

impl Worker {
    /// Stops the engine (if still running) and waits for the thread.
    pub(super) fn stop(&mut self) {
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

/// Starts the engine on a worker thread, paused before its first op is handed over.
pub(super) fn spawn(
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
