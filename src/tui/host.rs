//! The debugger core as the UI drives it: commands in, updates out. The host owns the
//! [`Controller`] and runs wherever its driver puts it (a worker thread for the real UI, the
//! caller's thread in tests), so the UI itself never computes.

use crate::backend::Backend;
use crate::debug::breakpoint::Breakpoint;
use crate::debug::compare::first_divergence;
use crate::debug::controller::{Controller, Stop};
use crate::debug::runner::Job;
use crate::debug::{Flags, RunRecord};
use crate::engine::generate::{Outcome, Schedule};
use crate::engine::trace::{OpEvent, Phase};
use crate::error::{Error, Result};
use crate::model::{Layout, Model};
use crate::session::{Cursor, ModelSource, Session, VERSION};
use crate::tensor::Tensor;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// What the UI asks of the debugger.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    Step,
    NextLayer,
    Continue,
    Restart,
    SetFlag(String, String),
    ToggleBreakpoint(Breakpoint),
    AddBreakpoint(Breakpoint),
    RemoveBreakpoint(Breakpoint),
    /// Compute the comparison runs of the current run: every phase on the other MLA path, and a
    /// whole-sequence prefill.
    Compare,
    /// Find the first op of the current run that differs from the comparison run.
    Bisect,
    Save {
        path: PathBuf,
        cursor: Option<Cursor>,
        notes: Vec<String>,
    },
    Load(PathBuf),
}

/// The two comparison runs `Compare` computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AuxKind {
    /// The same tokens with every phase on the other MLA path.
    OtherPath,
    /// The whole token sequence prefilled at once.
    WholePrefill,
}

/// What the debugger tells the UI.
#[derive(Debug, Clone)]
pub enum Update {
    /// The model and what will run (sent first, and again after a load).
    Loaded(Box<Info>),
    /// An op of run `run` (a new run number starts a new run).
    Op {
        run: usize,
        flags: Flags,
        event: Box<OpEvent>,
        output: Arc<Tensor>,
    },
    /// Which earlier run the current one is compared with.
    Comparison(Option<usize>),
    /// Run `run` ended.
    Finished {
        run: usize,
        outcome: Option<Outcome>,
        error: Option<String>,
    },
    Stopped(Stop),
    Breakpoints(Vec<Breakpoint>),
    Flags(Flags),
    Aux {
        run: usize,
        kind: AuxKind,
        record: Arc<RunRecord>,
    },
    /// Move the selection to op `index` of the current run.
    Select(usize),
    Log(String),
    Error(String),
    /// `Some(what)` while a command runs, `None` when the debugger is idle again.
    Busy(Option<String>),
}

/// The model and run the debugger holds.
#[derive(Debug, Clone)]
pub struct Info {
    pub layout: Layout,
    pub source: String,
    pub schedule: Schedule,
    pub layers: Range<usize>,
}

/// Where updates go.
pub type Send = Arc<dyn Fn(Update) + std::marker::Send + Sync>;

/// A model ready to debug.
pub struct HostSpec {
    pub model: Arc<Model>,
    pub source: ModelSource,
    pub backend: Arc<dyn Backend>,
    pub schedule: Schedule,
    pub layers: Range<usize>,
    pub flags: Flags,
}

pub struct Host {
    controller: Controller,
    source: ModelSource,
    send: Send,
    cancel: Arc<AtomicBool>,
}

impl Host {
    pub fn new(spec: HostSpec, send: Send, cancel: Arc<AtomicBool>) -> Result<Host> {
        let info = Info {
            layout: spec.model.layout.clone(),
            source: spec.model.weights.describe(),
            schedule: spec.schedule.clone(),
            layers: spec.layers.clone(),
        };
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
        };
        // Paused at the first op.
        host.handle(Command::Step);
        Ok(host)
    }

    fn log(&self, msg: impl Into<String>) {
        (self.send)(Update::Log(msg.into()));
    }

    /// Runs one command, sending what it does; errors become `Update::Error`.
    pub fn handle(&mut self, command: Command) {
        (self.send)(Update::Busy(Some(describe(&command))));
        if let Err(e) = self.run(command) {
            (self.send)(Update::Error(e.to_string()));
        }
        (self.send)(Update::Busy(None));
    }

    fn run(&mut self, command: Command) -> Result<()> {
        let c = &mut self.controller;
        match command {
            Command::Step => self.stopped(|c| c.step()),
            Command::NextLayer => self.stopped(|c| c.next_layer()),
            Command::Continue => self.stopped(|c| c.continue_run()),
            Command::Restart => {
                c.restart();
                let n = c.run_number();
                self.log(format!("restarted: run {n}"));
                self.stopped(|c| c.step());
            }
            Command::SetFlag(key, value) => {
                let change = c.set_flag(&key, &value)?;
                let flags = c.flags();
                (self.send)(Update::Flags(flags));
                (self.send)(Update::Comparison(c.history().len().checked_sub(1)));
                if let Some(note) = &change.note {
                    self.log(note.clone());
                }
                match &change.first_affected {
                    Some((i, phase, op)) => self.log(format!(
                        "{key} {value}: re-executed from op #{i} ({phase} {op}): {} ops computed, {} reused",
                        change.executed, change.replayed
                    )),
                    None if change.executed + change.replayed > 0 => self.log(format!(
                        "{key} {value}: no op so far is affected; {} ops reused",
                        change.replayed
                    )),
                    None => {}
                }
                self.finish_if_done();
            }
            Command::ToggleBreakpoint(bp) => {
                let on = c.toggle_breakpoint(bp.clone());
                self.log(format!(
                    "breakpoint {bp} {}",
                    if on { "set" } else { "removed" }
                ));
                (self.send)(Update::Breakpoints(self.controller.breakpoints().to_vec()));
            }
            Command::AddBreakpoint(bp) => {
                c.add_breakpoint(bp.clone());
                self.log(format!("breakpoint {bp} set"));
                (self.send)(Update::Breakpoints(self.controller.breakpoints().to_vec()));
            }
            Command::RemoveBreakpoint(bp) => {
                let was = c.remove_breakpoint(&bp);
                self.log(format!(
                    "breakpoint {bp} {}",
                    if was { "removed" } else { "was not set" }
                ));
                (self.send)(Update::Breakpoints(self.controller.breakpoints().to_vec()));
            }
            Command::Compare => self.compare()?,
            Command::Bisect => {
                let diffs = c.diff_runs();
                if diffs.is_empty() {
                    return Err(Error::invalid(
                        "bisect needs an earlier run to compare with: change a flag first",
                    ));
                }
                match first_divergence(&diffs, 1e-4) {
                    Some(d) => {
                        let figures = d.diff.as_ref().map(|x| x.summary()).unwrap_or_default();
                        self.log(format!(
                            "bisect: first divergent op #{} {} {}: {figures}",
                            d.index, d.phase, d.name
                        ));
                        (self.send)(Update::Select(d.index));
                    }
                    None => self.log(format!(
                        "bisect: no op differs beyond 1e-4 ({} compared)",
                        diffs.len()
                    )),
                }
            }
            Command::Save {
                path,
                cursor,
                notes,
            } => {
                let session = self.session(cursor, notes);
                session.save(&path)?;
                self.log(format!("saved session to {}", path.display()));
            }
            Command::Load(path) => self.load(path)?,
        }
        Ok(())
    }

    /// Runs a controller command and reports where it stopped.
    fn stopped(&mut self, f: impl FnOnce(&mut Controller) -> Stop) {
        let stop = f(&mut self.controller);
        if let Stop::Breakpoint(b) = &stop {
            let bp = self.controller.breakpoints()[*b].clone();
            self.log(format!("breakpoint {bp} hit"));
        }
        (self.send)(Update::Stopped(stop));
        self.finish_if_done();
    }

    fn finish_if_done(&self) {
        let c = &self.controller;
        if c.finished() {
            let run = c.current();
            (self.send)(Update::Finished {
                run: c.run_number(),
                outcome: run.outcome.clone(),
                error: run.error.clone(),
            });
        }
    }

    /// The comparison runs for the current run, fed its tokens.
    fn compare(&mut self) -> Result<()> {
        let c = &self.controller;
        let run = c.current();
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
        let number = c.run_number();
        let forced = Schedule {
            prompt: tokens.clone(),
            prefill_len: c.schedule().prefill_len,
            decode_steps: 0,
        };
        let mut other = flags;
        other.mla_disable = false;
        other.prefill_path = flip(flags.paths().prefill);
        other.decode_path = flip(flags.paths().decode);
        let record = job.run_schedule(other, &forced, None)?;
        (self.send)(Update::Aux {
            run: number,
            kind: AuxKind::OtherPath,
            record: Arc::new(record),
        });
        let whole = Schedule {
            prefill_len: tokens.len(),
            prompt: tokens,
            decode_steps: 0,
        };
        let record = job.run_schedule(flags, &whole, None)?;
        (self.send)(Update::Aux {
            run: number,
            kind: AuxKind::WholePrefill,
            record: Arc::new(record),
        });
        self.log("comparisons ready: absorbed vs naive, prefill vs decode");
        Ok(())
    }

    fn session(&self, cursor: Option<Cursor>, notes: Vec<String>) -> Session {
        let c = &self.controller;
        Session {
            version: VERSION,
            model: self.source.clone(),
            prompt: c.schedule().prompt.clone(),
            prefill: c.schedule().prefill_len,
            decode: c.schedule().decode_steps,
            layers: (c.layers().start, c.layers().end),
            flags: c.flags(),
            breakpoints: c.breakpoints().to_vec(),
            cursor,
            notes,
        }
    }

    /// Replaces the debugger with a saved session and runs it to its cursor.
    fn load(&mut self, path: PathBuf) -> Result<()> {
        let session = Session::load(&path)?;
        let backend = self.controller.backend().clone();
        let model = if session.model == self.source {
            self.controller.model_arc()
        } else {
            Arc::new(load_model(&session.model)?)
        };
        if session.layers.1 > model.layout.num_layers || session.layers.0 >= session.layers.1 {
            return Err(Error::parse(
                &path,
                format!("layers {:?} do not fit the model", session.layers),
            ));
        }
        let spec = HostSpec {
            model,
            source: session.model.clone(),
            backend,
            schedule: Schedule {
                prompt: session.prompt.clone(),
                prefill_len: session.prefill,
                decode_steps: session.decode,
            },
            layers: session.layers.0..session.layers.1,
            flags: session.flags,
        };
        let mut next = Host::new(spec, self.send.clone(), self.cancel.clone())?;
        for bp in &session.breakpoints {
            next.controller.add_breakpoint(bp.clone());
        }
        (self.send)(Update::Breakpoints(session.breakpoints.clone()));
        if let Some(cursor) = &session.cursor {
            while next
                .controller
                .position()
                .is_some_and(|p| (p.phase, &p.op) != (cursor.phase, &cursor.op))
            {
                if next.controller.step() != Stop::Stepped {
                    break;
                }
            }
            (self.send)(Update::Stopped(Stop::Stepped));
            next.finish_if_done();
        }
        for note in &session.notes {
            next.log(format!("note: {note}"));
        }
        next.log(format!("loaded session {}", path.display()));
        *self = next;
        Ok(())
    }
}

fn flip(p: crate::engine::MlaPath) -> crate::engine::MlaPath {
    match p {
        crate::engine::MlaPath::Naive => crate::engine::MlaPath::Absorbed,
        crate::engine::MlaPath::Absorbed => crate::engine::MlaPath::Naive,
    }
}

fn describe(c: &Command) -> String {
    match c {
        Command::Step => "step".into(),
        Command::NextLayer => "next layer".into(),
        Command::Continue => "continue".into(),
        Command::Restart => "restart".into(),
        Command::SetFlag(k, v) => format!("set {k} {v}"),
        Command::Compare => "comparison runs".into(),
        Command::Bisect => "bisect".into(),
        Command::Save { .. } => "save".into(),
        Command::Load(_) => "load".into(),
        _ => "breakpoints".into(),
    }
}

/// Loads the model a session names.
pub fn load_model(source: &ModelSource) -> Result<Model> {
    const BUDGET: usize = 8 << 30;
    let args = |layout: Option<&String>,
                model: Option<&std::path::PathBuf>,
                seed,
                quant: &Option<String>| {
        crate::cli::args::ModelArgs {
            layout: layout.cloned(),
            model: model.cloned(),
            seed,
            weight_cache_mb: BUDGET >> 20,
            quant: quant.clone(),
        }
    };
    match source {
        ModelSource::Layout {
            layout,
            seed,
            quant,
        } => {
            Layout::resolve(layout)?;
            args(Some(layout), None, *seed, quant).load()
        }
        ModelSource::Checkpoint {
            path,
            fingerprint,
            quant,
        } => {
            let now = crate::session::checkpoint_fingerprint(path)?;
            if &now != fingerprint {
                return Err(Error::invalid(format!(
                    "{}: the checkpoint changed since the session was saved",
                    path.display()
                )));
            }
            args(None, Some(path), 0, quant).load()
        }
    }
}

/// The position of an op, for the UI: phase and name.
pub fn cursor_of(event: &OpEvent) -> Cursor {
    Cursor {
        phase: event.phase,
        op: event.name.clone(),
    }
}

/// Whether the phase is a decode step.
pub fn is_decode(p: Phase) -> bool {
    matches!(p, Phase::Decode(_))
}
