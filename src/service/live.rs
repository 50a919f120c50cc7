//! The live debugger: the service over a [`Controller`] that computes. It runs wherever its
//! driver puts it (a worker thread for the real UI, the caller's thread in tests), so the UI
//! itself never computes.

mod changes;
mod sessions;

pub use changes::{inject, SCHEDULE_KEYS};

use super::{no_comparison, AuxKind, Command, DebugService, Goto, HostSpec, Info, Send, Update};
use crate::debug::breakpoint::Breakpoint;
use crate::debug::compare::OpComparison;
use crate::debug::controller::{Controller, Stop};
use crate::debug::idle::{idle_flags, Idle, KvBStorage};
use crate::debug::paired::{compare_paired, Pairing};
use crate::debug::runner::Job;
use crate::debug::tolerance::Tolerances;
use crate::debug::RunRecord;
use crate::engine::generate::Schedule;
use crate::error::{Error, Result};
use crate::session::recorded::Annotation;
use crate::session::{Cursor, ModelSource};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The live debugger.
pub struct Host {
    controller: Controller,
    source: ModelSource,
    send: Send,
    cancel: Arc<AtomicBool>,
    /// Per run number: ops it held when it became current, the first op its flags affected,
    /// the run it was compared with.
    starts: Vec<(usize, Option<usize>, Option<usize>)>,
    /// Notes placed in the timeline.
    annotations: Vec<Annotation>,
    /// Comparison runs computed, for the saved session.
    aux: Vec<(usize, AuxKind, Schedule, Arc<RunRecord>)>,
    /// How kv_b_proj is stored, and the flags last reported as having nothing to act on.
    kv_b: KvBStorage,
    idle: Vec<Idle>,
    /// `--max-memory-gb`, held for schedule changes and loads.
    max_memory_gb: Option<f64>,
    text: Option<Arc<crate::model::tokenizer::TextCodec>>,
    reference: Option<Arc<crate::debug::external::ExternalDump>>,
}

impl Host {
    pub fn new(spec: HostSpec, send: Send, cancel: Arc<AtomicBool>) -> Result<Host> {
        let info = Info {
            layout: spec.model.layout.clone(),
            source: spec.model.weights.describe(),
            schedule: spec.schedule.clone(),
            layers: spec.layers.clone(),
        };
        let kv_b = KvBStorage::of(&spec.model, &spec.layers)?;
        let max_memory_gb = spec.max_memory_gb;
        let mut controller = Controller::new(
            spec.model,
            spec.backend,
            spec.schedule,
            spec.layers,
            spec.flags,
        )?;
        controller.set_cancel_flag(cancel.clone());
        let listener_send = send.clone();
        controller.set_listener(Box::new(move |run, flags, event, output| {
            listener_send(Update::Op {
                run,
                flags: *flags,
                event: Box::new(event.clone()),
                output: output.clone(),
            })
        }));
        send(Update::Loaded(Box::new(info)));
        send(Update::Flags(spec.flags));
        let mut host = Host {
            controller,
            source: spec.source,
            send,
            cancel,
            starts: Vec::new(),
            annotations: Vec::new(),
            aux: Vec::new(),
            kv_b,
            idle: Vec::new(),
            max_memory_gb,
            text: spec.text,
            reference: spec.reference,
        };
        // Paused at the first op.
        host.handle(Command::Step);
        host.note_run_start(None);
        Ok(host)
    }

    /// Records where the current run started, when it is a new one.
    fn note_run_start(&mut self, first_affected: Option<usize>) {
        let c = &self.controller;
        let n = c.run_number();
        if self.starts.len() <= n {
            let compared = c.comparison().and_then(|cmp| {
                c.history()
                    .iter()
                    .position(|r| std::ptr::eq(&**r as *const RunRecord, cmp))
            });
            self.starts.resize(n + 1, (0, None, None));
            self.starts[n] = (c.current().len(), first_affected, compared);
        }
    }

    /// What only the live debugger does: run the engine, change flags and the schedule,
    /// compute comparison runs, load a session.
    fn run(&mut self, command: Command) -> Result<()> {
        let c = &mut self.controller;
        match command {
            Command::Step => self.stopped(|c| c.step()),
            Command::Steps(n) => {
                let cancel = self.cancel.clone();
                cancel.store(false, Ordering::Relaxed);
                self.stopped(|c| {
                    let mut stop = c.step();
                    for _ in 1..n {
                        if stop != Stop::Stepped {
                            break;
                        }
                        if cancel.swap(false, Ordering::Relaxed) {
                            return Stop::Cancelled;
                        }
                        stop = c.step();
                    }
                    stop
                })
            }
            Command::NextLayer => self.stopped(|c| c.next_layer()),
            Command::Continue => self.stopped(|c| c.continue_run()),
            Command::Restart => {
                c.restart();
                let n = c.run_number();
                self.log(format!("restarted: run {n}"));
                self.stopped(|c| c.step());
                self.note_run_start(None);
            }
            Command::SetFlag(key, value) => self.set(&key, &value)?,
            Command::Goto(Goto::Op(index)) => self.goto(index)?,
            Command::Compare => self.compare()?,
            Command::Load(path) => self.load(path)?,
            Command::GotoNote(_) => self.log(
                "notes are toured in a replay: :save FILE, then mladb replay FILE (} and { go from note to note)",
            ),
            // The shared commands never reach here (see `DebugService::dispatch`).
            other => unreachable!("{other:?} is handled by DebugService::dispatch"),
        }
        Ok(())
    }

    /// Runs a controller command and reports where it stopped.
    fn stopped(&mut self, f: impl FnOnce(&mut Controller) -> Stop) {
        let stop = f(&mut self.controller);
        self.report_stop(stop);
        self.finish_if_done();
    }

    fn finish_if_done(&self) {
        let c = &self.controller;
        if c.finished() {
            let run = c.current();
            let text = match (&self.text, &run.outcome) {
                (Some(codec), Some(o)) => Some(codec.pieces(&o.generated)),
                _ => None,
            };
            (self.send)(Update::Finished {
                run: c.run_number(),
                outcome: run.outcome.clone(),
                error: run.error.clone(),
                text,
            });
            if let Some(dump) = &self.reference {
                (self.send)(Update::Aux {
                    run: c.run_number(),
                    kind: AuxKind::Reference,
                    record: Arc::new(dump.aligned(run)),
                });
            }
        }
    }

    /// The comparison runs for the current run, fed its tokens.
    fn compare(&mut self) -> Result<()> {
        let c = &self.controller;
        let run = c.current();
        let number = c.run_number();
        if self.aux.iter().any(|a| a.0 == number) {
            self.log("comparisons of this run are already computed");
            return Ok(());
        }
        let tokens = match &run.outcome {
            Some(o) => o.tokens.clone(),
            None => {
                return Err(Error::invalid(
                    "comparisons need a finished run: continue to the end first (c)",
                ))
            }
        };
        let flags = c.flags();
        let job = Job {
            model: c.model(),
            backend: c.backend().as_ref(),
            schedule: c.schedule(),
            layers: c.layers(),
            poison: true,
        };
        let forced = Schedule {
            prompt: tokens.clone(),
            prefill_len: c.schedule().prefill_len,
            decode_steps: 0,
        };
        let mut other = flags;
        other.mla_disable = false;
        other.prefill_path = flip(flags.paths().prefill);
        other.decode_path = flip(flags.paths().decode);
        let whole = Schedule {
            prefill_len: tokens.len(),
            prompt: tokens,
            decode_steps: 0,
        };
        // Selection-aware, as check: a comparison run that flips a choice within noise is made
        // again with this run's choice there, so one near-tie does not mark every later op.
        let tolerances = Tolerances::Table(flags.dtype);
        for (kind, flags_b, schedule, pairing) in [
            (AuxKind::OtherPath, other, &forced, Pairing::SameSchedule),
            (AuxKind::WholePrefill, flags, &whole, Pairing::DecodeRows),
        ] {
            let paired = compare_paired(&job, run, flags_b, schedule, pairing, &tolerances)?;
            for d in &paired.flips {
                self.log(format!(
                    "{}: selection flip within noise at {} {}, {}; forced to this run's choice",
                    kind.name(),
                    d.phase,
                    d.op,
                    d.describe()
                ));
            }
            let record = Arc::new(paired.other);
            self.aux
                .push((number, kind, schedule.clone(), record.clone()));
            (self.send)(Update::Aux {
                run: number,
                kind,
                record,
            });
        }
        self.log("comparisons ready: absorbed vs naive, prefill vs decode");
        Ok(())
    }
}

fn flip(p: crate::engine::MlaPath) -> crate::engine::MlaPath {
    match p {
        crate::engine::MlaPath::Naive => crate::engine::MlaPath::Absorbed,
        crate::engine::MlaPath::Absorbed => crate::engine::MlaPath::Naive,
    }
}

impl DebugService for Host {
    fn sender(&self) -> &Send {
        &self.send
    }

    fn execute(&mut self, command: Command) -> Result<()> {
        self.run(command)
    }

    fn breakpoints_mut(&mut self) -> &mut Vec<Breakpoint> {
        self.controller.breakpoints_mut()
    }

    fn place(&self) -> (usize, usize) {
        let c = &self.controller;
        (c.run_number(), c.current().len())
    }

    fn annotations_mut(&mut self) -> &mut Vec<Annotation> {
        &mut self.annotations
    }

    fn op_comparisons(&self, what: &str) -> Result<Vec<OpComparison>> {
        let diffs = self.controller.diff_runs();
        if diffs.is_empty() {
            return Err(no_comparison(what, "change a flag or the schedule first"));
        }
        Ok(diffs)
    }

    fn save(
        &self,
        path: &Path,
        cursor: Option<Cursor>,
        notes: Vec<String>,
        tensors: bool,
    ) -> Result<()> {
        let session = self.session(cursor, notes);
        if tensors {
            session.save_with_tensors(path, &self.outputs())
        } else {
            session.save(path)
        }
    }

    fn idle_now(&self) -> Vec<Idle> {
        let c = &self.controller;
        let run = c.current();
        idle_flags(&c.flags(), &self.kv_b, &run.events, run.finished())
    }

    fn reported_idle(&mut self) -> &mut Vec<Idle> {
        &mut self.idle
    }
}
