//! The debugger as a service to its UIs: commands in, updates out. Two serve it: [`live`] drives
//! a [`crate::debug::controller::Controller`] over a model, [`replay`] shows what a session
//! recorded without computing. Both implement [`DebugService`], whose provided methods hold the
//! commands that do not depend on which one serves them (breakpoints, bisect, notes, saving, the
//! report of idle flags), so each host adds only what differs: stepping and what it computes.
//! No UI code lives here; the TUI reaches a service through its driver (`crate::tui::driver`).

pub mod live;
pub mod replay;

pub use live::{inject, Host, SCHEDULE_KEYS};
pub use replay::ReplayHost;

use crate::debug::breakpoint::{self, Breakpoint};
use crate::debug::compare::{first_divergence, OpComparison};
use crate::debug::controller::Stop;
use crate::debug::idle::Idle;
use crate::debug::{Flags, RunRecord};
use crate::engine::generate::{Outcome, Schedule};
use crate::engine::trace::{OpEvent, Phase};
use crate::error::{Error, Result};
use crate::model::{Layout, Model};
use crate::session::recorded::{Annotation, Pane};
use crate::session::{Cursor, ModelSource};
use crate::setup::{FlagOptions, RunSpec};
use crate::tensor::Tensor;
use std::ops::Range;
use std::path::{Path, PathBuf};
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
    /// far) for the saved session, with the op selected and the pane shown as it was typed.
    Note {
        text: String,
        about: Option<Cursor>,
        pane: Option<Pane>,
    },
    /// Go to note N of the session's tour: its place in the timeline, its op selected.
    GotoNote(usize),
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
    /// A reference dump (another engine's tensors, `--reference`), aligned with the run.
    Reference,
}

impl AuxKind {
    /// The name sessions record.
    pub fn name(self) -> &'static str {
        match self {
            AuxKind::OtherPath => "other-path",
            AuxKind::WholePrefill => "whole-prefill",
            AuxKind::Reference => "reference",
        }
    }

    pub fn from_name(name: &str) -> Option<AuxKind> {
        match name {
            "other-path" => Some(AuxKind::OtherPath),
            "whole-prefill" => Some(AuxKind::WholePrefill),
            "reference" => Some(AuxKind::Reference),
            _ => None,
        }
    }
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
    /// Op `event.index` of run `run` computed again (an attached engine's choice imposed on
    /// mladb's reference): it replaces the op the run holds there.
    Recomputed {
        run: usize,
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
        /// Each generated token as text, when the run has a tokenizer.
        text: Option<Vec<String>>,
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
    /// An autosave's result: the path saved to (worth a line in the log file, not on the
    /// screen), or why it failed. Quitting waits for it to say where the session went.
    Autosaved(std::result::Result<PathBuf, String>),
    /// The notes of a loaded session: they become the UI's notes, so the next save keeps them.
    Notes(Vec<String>),
    /// The notes placed in a replayed session's timeline, in the order a tour visits them.
    Tour(Vec<Annotation>),
    /// The replay reached note `index` of the tour: `moved` when it went there for `GotoNote`
    /// (the UI then shows the note's pane), not when a step merely passed it.
    NoteReached {
        index: usize,
        moved: bool,
    },
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
    pub backend: Arc<dyn crate::backend::Backend>,
    pub schedule: Schedule,
    pub layers: Range<usize>,
    pub flags: Flags,
    /// The most memory a run may need, in GB, for `:set tokens` and `:load` as for the first
    /// run (`--max-memory-gb`; none: what the machine has available).
    pub max_memory_gb: Option<f64>,
    /// The tokenizer, when the model has one: generated tokens shown as text.
    pub text: Option<Arc<crate::model::tokenizer::TextCodec>>,
    /// A reference dump (`--reference`): each finished run is compared with it.
    pub reference: Option<Arc<crate::debug::external::ExternalDump>>,
}

impl HostSpec {
    /// Loads the model of `run` and checks `flags` against it (`VLLM_MLA_DISABLE` included);
    /// errors here end the program before a UI starts.
    pub fn prepare(run: &RunSpec, flags: &FlagOptions) -> Result<HostSpec> {
        let flags = flags.flags(run.device)?;
        let p = run.prepare(&flags)?;
        let source = run.source()?;
        flags.engine_options(p.layers.clone(), true)?;
        Ok(HostSpec {
            model: Arc::new(p.model),
            source,
            backend: Arc::from(p.backend),
            schedule: p.schedule,
            layers: p.layers,
            flags,
            max_memory_gb: run.max_memory_gb,
            text: p.text.map(Arc::new),
            reference: None,
        })
    }
}

/// The debugger as a UI drives it. The provided methods are the commands both hosts share;
/// the required ones are what each holds or does differently.
pub trait DebugService {
    /// Where updates go.
    fn sender(&self) -> &Send;

    /// Runs a command whose meaning depends on the host: stepping, flag and schedule changes,
    /// comparison runs, `:goto N`, restart and load.
    fn execute(&mut self, command: Command) -> Result<()>;

    /// The breakpoints, which both hosts keep.
    fn breakpoints_mut(&mut self) -> &mut Vec<Breakpoint>;

    /// Where a note typed now goes: the run shown, and how many of its ops are shown.
    fn place(&self) -> (usize, usize);

    /// The notes placed in the timeline so far.
    fn annotations_mut(&mut self) -> &mut Vec<Annotation>;

    /// The current run compared op by op with the run it is compared with, for `what`
    /// (`bisect` or `goto first-divergent`); an error in the host's words when there is none.
    fn op_comparisons(&self, what: &str) -> Result<Vec<OpComparison>>;

    /// Writes the session to `path` with this cursor and these notes.
    fn save(
        &self,
        path: &Path,
        cursor: Option<Cursor>,
        notes: Vec<String>,
        tensors: bool,
    ) -> Result<()>;

    /// The flags that have had nothing to act on so far.
    fn idle_now(&self) -> Vec<Idle>;

    /// The idle flags last reported to the UI.
    fn reported_idle(&mut self) -> &mut Vec<Idle>;

    fn log(&self, msg: impl Into<String>) {
        (self.sender())(Update::Log(msg.into()));
    }

    /// Runs one command, sending what it does; errors become `Update::Error`.
    fn handle(&mut self, command: Command) {
        (self.sender())(Update::Busy(Some(describe(&command))));
        if let Err(e) = self.dispatch(command) {
            (self.sender())(Update::Error(e.to_string()));
        }
        self.report_idle();
        (self.sender())(Update::Busy(None));
    }

    /// The shared commands, here; the rest to [`DebugService::execute`].
    fn dispatch(&mut self, command: Command) -> Result<()> {
        match command {
            Command::ToggleBreakpoint(bp) => {
                let on = breakpoint::toggle(self.breakpoints_mut(), bp.clone());
                let state = if on { "set" } else { "removed" };
                self.log(format!("breakpoint {bp} {state}"));
                self.send_breakpoints();
            }
            Command::AddBreakpoint(bp) => {
                breakpoint::add(self.breakpoints_mut(), bp.clone());
                self.log(format!("breakpoint {bp} set"));
                self.send_breakpoints();
            }
            Command::RemoveBreakpoint(bp) => {
                let was = breakpoint::remove(self.breakpoints_mut(), &bp);
                let state = if was { "removed" } else { "was not set" };
                self.log(format!("breakpoint {bp} {state}"));
                self.send_breakpoints();
            }
            Command::ClearBreakpoints => {
                let n = std::mem::take(self.breakpoints_mut()).len();
                self.log(format!("{n} breakpoint(s) deleted"));
                self.send_breakpoints();
            }
            Command::Bisect => {
                let (line, select) = bisect_report(&self.op_comparisons("bisect")?);
                self.log(line);
                self.select(select);
            }
            Command::Goto(Goto::FirstDivergent) => {
                let diffs = self.op_comparisons("goto first-divergent")?;
                let (line, select) = bisect_report(&diffs);
                self.log(line.replacen("bisect", "goto", 1));
                self.select(select);
            }
            Command::Save {
                path,
                cursor,
                notes,
                tensors,
                autosave,
            } => match (self.save(&path, cursor, notes, tensors), autosave) {
                (Ok(()), false) => self.log(format!("saved session to {}", path.display())),
                (Ok(()), true) => (self.sender())(Update::Autosaved(Ok(path))),
                (Err(e), false) => return Err(e),
                (Err(e), true) => (self.sender())(Update::Autosaved(Err(e.to_string()))),
            },
            Command::Note { text, about, pane } => {
                let (run, op) = self.place();
                self.annotations_mut().push(Annotation {
                    run,
                    op,
                    text,
                    about,
                    pane,
                });
            }
            other => self.execute(other)?,
        }
        Ok(())
    }

    /// Tells the UI where a command stopped, naming the breakpoint hit.
    fn report_stop(&mut self, stop: Stop) {
        if let Stop::Breakpoint(b) = &stop {
            if let Some(bp) = self.breakpoints_mut().get(*b).cloned() {
                self.log(format!("breakpoint {bp} hit"));
            }
        }
        (self.sender())(Update::Stopped(stop));
    }

    fn send_breakpoints(&mut self) {
        let list = self.breakpoints_mut().clone();
        (self.sender())(Update::Breakpoints(list));
    }

    fn select(&self, index: Option<usize>) {
        if let Some(index) = index {
            (self.sender())(Update::Select(index));
        }
    }

    /// Tells the UI which flags had nothing to act on (once the run has finished; before, what
    /// no later op could change), logging each newly found.
    fn report_idle(&mut self) {
        let idle = self.idle_now();
        let before = self.reported_idle().clone();
        if idle == before {
            return;
        }
        for i in idle.iter().filter(|i| !before.contains(i)) {
            self.log(format!("note: {i}"));
        }
        (self.sender())(Update::Idle(idle.clone()));
        *self.reported_idle() = idle;
    }
}

/// A command in a word or two, for the busy gauge.
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
        Command::Note { .. } => "note".into(),
        Command::GotoNote(_) => "note".into(),
        _ => "breakpoints".into(),
    }
}

/// What bisect tells the user about per-op comparisons, and the op to select: the first that
/// differs beyond its tolerance (live and replayed sessions report it alike).
pub fn bisect_report(diffs: &[OpComparison]) -> (String, Option<usize>) {
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

/// What a host says when there is no earlier run to compare with.
fn no_comparison(what: &str, why: &str) -> Error {
    Error::invalid(format!(
        "{what} needs an earlier run to compare with: {why}"
    ))
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

#[cfg(test)]
mod tests;
