//! The debugger core as the UI drives it: commands in, updates out. The host owns the
//! [`Controller`] and runs wherever its driver puts it (a worker thread for the real UI, the
//! caller's thread in tests), so the UI itself never computes.

mod changes;
mod sessions;

pub use changes::{inject, SCHEDULE_KEYS};
pub use sessions::load_model;

use crate::backend::Backend;
use crate::debug::breakpoint::Breakpoint;
use crate::debug::compare::first_divergence;
use crate::debug::controller::{Controller, Stop};
use crate::debug::idle::{Idle, KvBStorage};
use crate::debug::paired::{compare_paired, Pairing};
use crate::debug::runner::Job;
use crate::debug::tolerance::Tolerances;
use crate::debug::{Flags, RunRecord};
use crate::engine::generate::{Outcome, Schedule};
use crate::engine::trace::{OpEvent, Phase};
use crate::error::{Error, Result};
use crate::model::{Layout, Model};
use crate::session::recorded::Annotation;
use crate::session::{Cursor, ModelSource};
use crate::tensor::Tensor;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What the UI asks of the debugger.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    Step,
    /// Up to N ops, stopping at the end of the run (`:step N`; Esc cancels).
    Steps(usize),
    NextLayer,
    Continue,
    Restart,
    /// `:set KEY VALUE`: a flag (`inject` replaces the faults; `+NAME` adds one), or the
    /// schedule (`tokens`, `prefill`, `decode`).
    SetFlag(String, String),
    ToggleBreakpoint(Breakpoint),
    AddBreakpoint(Breakpoint),
    RemoveBreakpoint(Breakpoint),
    ClearBreakpoints,
    Goto(Goto),
    /// Compute the comparison runs of the current run: every phase on the other MLA path, and a
    /// whole-sequence prefill.
    Compare,
    /// Find the first op of the current run that differs from the comparison run.
    Bisect,
    Save {
        path: PathBuf,
        cursor: Option<Cursor>,
        notes: Vec<String>,
        /// Also write every output in full to a companion safetensors file.
        tensors: bool,
        /// An autosave: a failure is logged as such and never interrupts anything.
        autosave: bool,
    },
    Load(PathBuf),
    /// A note typed now: the host places it in the timeline (the current run, after its ops so
    /// far) for the saved session.
    Note(String),
}

/// Where `:goto` goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Goto {
    /// Op N of the current run (run forward to it when it has not executed yet).
    Op(usize),
    /// The first op that differs from the comparison run.
    FirstDivergent,
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
    /// The schedule changed (`:set tokens|prefill|decode`).
    Schedule(Schedule),
    /// The flags that had nothing to act on (see [`crate::debug::idle`]).
    Idle(Vec<Idle>),
    Aux {
        run: usize,
        kind: AuxKind,
        record: Arc<RunRecord>,
    },
    /// Move the selection to op `index` of the current run.
    Select(usize),
    Log(String),
    /// The notes of a loaded session: they become the UI's notes, so the next save keeps them.
    Notes(Vec<String>),
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
}

impl AuxKind {
    /// The name sessions record.
    pub fn name(self) -> &'static str {
        match self {
            AuxKind::OtherPath => "other-path",
            AuxKind::WholePrefill => "whole-prefill",
        }
    }

    pub fn from_name(name: &str) -> Option<AuxKind> {
        match name {
            "other-path" => Some(AuxKind::OtherPath),
            "whole-prefill" => Some(AuxKind::WholePrefill),
            _ => None,
        }
    }
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

    fn log(&self, msg: impl Into<String>) {
        (self.send)(Update::Log(msg.into()));
    }

    /// Runs one command, sending what it does; errors become `Update::Error`.
    pub fn handle(&mut self, command: Command) {
        (self.send)(Update::Busy(Some(describe(&command))));
        if let Err(e) = self.run(command) {
            (self.send)(Update::Error(e.to_string()));
        }
        self.report_idle();
        (self.send)(Update::Busy(None));
    }

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
            Command::ClearBreakpoints => {
                let n = c.clear_breakpoints();
                self.log(format!("{n} breakpoint(s) deleted"));
                (self.send)(Update::Breakpoints(Vec::new()));
            }
            Command::Goto(to) => self.goto(to)?,
            Command::Compare => self.compare()?,
            Command::Bisect => {
                let diffs = c.diff_runs();
                if diffs.is_empty() {
                    return Err(Error::invalid(
                        "bisect needs an earlier run to compare with: change a flag first",
                    ));
                }
                let (line, select) = bisect_report(&diffs);
                self.log(line);
                if let Some(index) = select {
                    (self.send)(Update::Select(index));
                }
            }
            Command::Save {
                path,
                cursor,
                notes,
                tensors,
                autosave,
            } => {
                let result = self.save(&path, cursor, notes, tensors);
                match (result, autosave) {
                    (Ok(()), false) => self.log(format!("saved session to {}", path.display())),
                    (Ok(()), true) => {
                        crate::tui::logfile::write(&format!("autosaved to {}", path.display()))
                    }
                    (Err(e), false) => return Err(e),
                    (Err(e), true) => self.log(format!("autosave failed: {e}")),
                }
            }
            Command::Load(path) => self.load(path)?,
            Command::Note(text) => {
                let c = &self.controller;
                self.annotations.push(Annotation {
                    run: c.run_number(),
                    op: c.current().len(),
                    text,
                });
            }
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

fn describe(c: &Command) -> String {
    match c {
        Command::Step | Command::Steps(_) => "step".into(),
        Command::NextLayer => "next layer".into(),
        Command::Continue => "continue".into(),
        Command::Restart => "restart".into(),
        Command::SetFlag(k, v) => format!("set {k} {v}"),
        Command::Goto(_) => "goto".into(),
        Command::Compare => "comparison runs".into(),
        Command::Bisect => "bisect".into(),
        Command::Save { .. } => "save".into(),
        Command::Load(_) => "load".into(),
        Command::Note(_) => "note".into(),
        _ => "breakpoints".into(),
    }
}

/// What bisect tells the user about per-op comparisons, and the op to select: the first that
/// differs beyond its tolerance (live and replayed sessions report it alike).
pub fn bisect_report(diffs: &[crate::debug::compare::OpComparison]) -> (String, Option<usize>) {
    match first_divergence(diffs) {
        Some(d) => {
            let figures = d.diff.as_ref().map(|x| x.summary()).unwrap_or_default();
            (
                format!(
                    "bisect: first divergent op #{} {} {}: {figures} ({})",
                    d.index,
                    d.phase,
                    d.name,
                    d.tolerance_text()
                ),
                Some(d.index),
            )
        }
        None => (
            format!(
                "bisect: no op differs beyond its tolerance ({} compared)",
                diffs.len()
            ),
            None,
        ),
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
