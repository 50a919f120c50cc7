//! Replay of a recorded session: the UI's updates rebuilt from the recorded events, with no model,
//! no weights and no computation. Stepping commands advance through the recorded ops of each run
//! in order and through the flag changes between runs, as they happened; commands that need
//! computing (a flag change, comparison runs not recorded) are refused with a log line.

use super::{AuxKind, Command, DebugService, Goto, Info, Send, Update};
use crate::debug::breakpoint::{first_hit, Breakpoint};
use crate::debug::compare::compare_outputs;
use crate::debug::controller::Stop;
use crate::debug::idle::{Idle, KvBStorage};
use crate::debug::RunRecord;
use crate::engine::generate::Schedule;
use crate::error::{Error, Result};
use crate::model::Layout;
use crate::session::recorded::RunRole;
use crate::session::{Cursor, ModelSource, Session};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod commands;
mod tour;

/// A recorded session, as the debugger host the UI talks to.
pub struct ReplayHost {
    session: Session,
    path: PathBuf,
    send: Send,
    info: Info,
    /// Every recorded run, by its index in `session.runs`.
    records: Vec<Arc<RunRecord>>,
    /// Full outputs from the companion file were loaded (else outputs are samples).
    full: bool,
    /// Indices into `session.runs` of the timeline's runs (main and check runs), in order.
    timeline: Vec<usize>,
    /// The run shown (an index into `timeline`, which is the UI's run number).
    at: usize,
    /// Ops of that run delivered so far.
    shown: usize,
    /// The end of the current run has been reported.
    end_shown: bool,
    breakpoints: Vec<Breakpoint>,
    /// Notes typed during the replay (saved with the session).
    annotations: Vec<crate::session::recorded::Annotation>,
    /// The session's notes in timeline order: the stops of a tour.
    tour: Vec<crate::session::recorded::Annotation>,
    /// How kv_b_proj was stored, and the flags last reported as having nothing to act on.
    kv_b: KvBStorage,
    idle: Vec<Idle>,
}

impl ReplayHost {
    /// Opens a recorded session, sends the first screen's updates and goes to its cursor.
    pub fn open(path: &Path, send: Send) -> Result<ReplayHost> {
        let session = Session::load(path)?;
        ReplayHost::new(session, path, send)
    }

    pub fn new(session: Session, path: &Path, send: Send) -> Result<ReplayHost> {
        let layout = match (&session.layout, &session.model) {
            (Some(l), _) => l.clone(),
            (None, ModelSource::Layout { layout, .. }) => Layout::resolve(layout)?,
            (None, ModelSource::Checkpoint { .. }) => {
                return Err(Error::parse(
                    path,
                    "the session records no layout of its checkpoint: replay needs a version 2 recording",
                ))
            }
        };
        let timeline: Vec<usize> = (0..session.runs.len())
            .filter(|&i| matches!(session.runs[i].role, RunRole::Main | RunRole::Check))
            .collect();
        if timeline.is_empty() {
            return Err(Error::parse(
                path,
                "nothing recorded to replay (a version 1 session: open it with `mladb tui` and `:load`, which recomputes it)",
            ));
        }
        let tensors = session.load_tensors(path)?;
        let full = tensors.is_some();
        let records = session
            .runs
            .iter()
            .enumerate()
            .map(|(n, r)| Arc::new(r.to_record(tensors.as_ref().map(|t| &t[n][..]))))
            .collect();
        let source = session
            .weights
            .clone()
            .unwrap_or_else(|| format!("{:?}", session.model));
        let info = Info {
            layout,
            source,
            schedule: session.schedule(),
            layers: session.layers.0..session.layers.1,
        };
        let session_kv_b = session.kv_b.clone().unwrap_or_else(KvBStorage::unknown);
        let tour = tour::stops(&session);
        let mut host = ReplayHost {
            tour,
            breakpoints: session.breakpoints.clone(),
            session,
            path: path.to_path_buf(),
            send,
            info,
            records,
            full,
            timeline,
            at: 0,
            shown: 0,
            end_shown: false,
            annotations: Vec::new(),
            kv_b: session_kv_b,
            idle: Vec::new(),
        };
        host.start();
        // A session with notes opens at the first: it was saved to be read from there.
        if host.tour.is_empty() {
            host.go_to_cursor();
        } else {
            host.goto_note(0)?;
        }
        host.report_idle();
        Ok(host)
    }

    /// Whether every output is whole (full tensors were recorded).
    pub fn full(&self) -> bool {
        self.full
    }

    /// The UI's state at the start of the timeline, saying what is replayed.
    fn start(&mut self) {
        self.reset();
        let s = &self.session;
        let ops: usize = self.timeline.iter().map(|&i| s.runs[i].ops.len()).sum();
        self.log(format!(
            "replaying {}: {} run(s), {ops} ops recorded{}; s/n/c step through them and their flag changes; nothing is recomputed",
            self.path.display(),
            self.timeline.len(),
            if self.full { ", full tensors" } else { ", sampled values" }
        ));
        for note in &s.notes {
            self.log(format!("note: {note}"));
        }
        if let Some(check) = &s.check {
            self.log(format!(
                "check recorded {} finding(s){}",
                check.findings.len(),
                check
                    .findings
                    .first()
                    .map(|f| format!(", first: {} at {} {}", f.kind, f.phase, f.op))
                    .unwrap_or_default()
            ));
        }
    }

    /// The UI's state at the start of the timeline.
    fn reset(&mut self) {
        (self.send)(Update::Loaded(Box::new(self.info.clone())));
        (self.send)(Update::Tour(self.tour.clone()));
        let first = &self.session.runs[self.timeline[0]];
        (self.send)(Update::Flags(first.flags));
        (self.send)(Update::Breakpoints(self.breakpoints.clone()));
        self.at = 0;
        self.shown = 0;
        self.end_shown = false;
        self.annotate();
        let until = first.started_at.max(1);
        while self.shown < until && self.deliver() {}
        (self.send)(Update::Stopped(Stop::Stepped));
    }

    /// Steps to the saved cursor: through the timeline to the last run, up to the cursor's op.
    fn go_to_cursor(&mut self) {
        let Some(cursor) = self.session.cursor.clone() else {
            return;
        };
        let last = self.timeline.len() - 1;
        loop {
            let here = self.position_matches(&cursor);
            if self.at == last && (here || self.exhausted()) {
                break;
            }
            if !self.exhausted() {
                self.deliver();
            } else if self.at < last {
                self.pass_end();
                self.next_run();
            } else {
                break;
            }
        }
        (self.send)(Update::Stopped(Stop::Stepped));
        if self.at == last && !self.position_matches(&cursor) {
            if let Some(i) = self.current().find(cursor.phase, &cursor.op) {
                if i < self.shown {
                    (self.send)(Update::Select(i));
                }
            }
        }
        if self.exhausted() && self.current_run().outcome.is_some() {
            self.finished();
        }
    }

    fn position_matches(&self, cursor: &Cursor) -> bool {
        self.shown > 0 && {
            let e = &self.current().events[self.shown - 1];
            e.phase == cursor.phase && e.name == cursor.op
        }
    }

    fn current(&self) -> &Arc<RunRecord> {
        &self.records[self.timeline[self.at]]
    }

    fn current_run(&self) -> &crate::session::recorded::RecordedRun {
        &self.session.runs[self.timeline[self.at]]
    }

    fn exhausted(&self) -> bool {
        self.shown >= self.current().len()
    }

    /// Sends the next recorded op of the current run; false when there is none.
    fn deliver(&mut self) -> bool {
        let record = self.current().clone();
        let Some(event) = record.events.get(self.shown) else {
            return false;
        };
        (self.send)(Update::Op {
            run: self.at,
            flags: record.flags,
            event: Box::new(event.clone()),
            output: record.outputs[self.shown].clone(),
        });
        self.shown += 1;
        self.annotate();
        true
    }

    /// Logs the notes placed at this point of the timeline, telling the UI which stops of the
    /// tour it passed.
    fn annotate(&self) {
        for (index, a) in self.tour.iter().enumerate() {
            if a.run == self.at && a.op == self.shown {
                self.log(format!("note: {}", a.text));
                (self.send)(Update::NoteReached {
                    index,
                    moved: false,
                });
            }
        }
        for a in &self.annotations {
            if a.run == self.at && a.op == self.shown {
                self.log(format!("note: {}", a.text));
            }
        }
    }

    /// At the end of a run's recording on the way to a later run: its outcome and comparison
    /// runs, which a finished run shows live (the Learn view's side-by-side needs them).
    fn pass_end(&mut self) {
        let run = self.current_run();
        if !self.end_shown && (run.outcome.is_some() || run.error.is_some()) {
            self.finished();
        }
    }

    /// The end of the current run: its outcome (or error) and the comparison runs recorded.
    fn finished(&mut self) {
        let run = self.current_run();
        let (outcome, error) = (
            run.outcome
                .as_ref()
                .map(crate::engine::generate::Outcome::from),
            run.error.clone(),
        );
        let text = run
            .outcome
            .as_ref()
            .and_then(|o| o.text.as_ref())
            .map(|t| t.generated.clone());
        (self.send)(Update::Finished {
            run: self.at,
            outcome,
            error,
            text,
        });
        self.end_shown = true;
        self.send_aux();
    }

    /// The comparison runs recorded for the current run; whether there were any.
    fn send_aux(&self) -> bool {
        let mut any = false;
        for (i, r) in self.session.runs.iter().enumerate() {
            if let RunRole::Aux { of, kind } = &r.role {
                if *of == self.at {
                    if let Some(kind) = AuxKind::from_name(kind) {
                        (self.send)(Update::Aux {
                            run: self.at,
                            kind,
                            record: self.records[i].clone(),
                        });
                        any = true;
                    }
                }
            }
        }
        any
    }

    /// Moves to the next run of the timeline: the flag change (or restart) that made it.
    fn next_run(&mut self) {
        let previous = self.current_run().flags;
        let previous_schedule = self.run_schedule(self.current_run());
        self.at += 1;
        self.shown = 0;
        self.end_shown = false;
        let run = self.current_run().clone();
        let until = run.started_at.max(1).min(run.ops.len());
        while self.shown < until && self.deliver() {}
        (self.send)(Update::Flags(run.flags));
        (self.send)(Update::Comparison(run.compared_with));
        let schedule = self.run_schedule(&run);
        let what = if run.flags != previous {
            format!("flags changed to {}", run.flags)
        } else if schedule != previous_schedule {
            let s = &schedule;
            let what = format!(
                "schedule changed to a {}-token prompt, prefill {}, decode {}",
                s.prompt.len(),
                s.prefill_len,
                s.decode_steps
            );
            (self.send)(Update::Schedule(schedule));
            what
        } else {
            "restarted".to_string()
        };
        let how = match run.first_affected {
            Some(i) => {
                let e = &run.ops[i].event;
                format!(
                    ": re-executed from op #{i} ({} {}), {} ops reused",
                    e.phase, e.name, i
                )
            }
            None => String::new(),
        };
        self.log(format!("replay: run {}: {what}{how}", self.at));
        if self.exhausted() && run.outcome.is_some() {
            self.finished();
        }
    }

    /// The schedule a recorded run ran.
    fn run_schedule(&self, run: &crate::session::recorded::RecordedRun) -> Schedule {
        run.schedule
            .as_ref()
            .map(|s| s.schedule())
            .unwrap_or_else(|| self.session.schedule())
    }

    /// At the end of the current run's recording: report the end, or go on to the next run.
    fn at_end(&mut self) {
        let finished = self.current_run().outcome.is_some() || self.current_run().error.is_some();
        if finished && !self.end_shown {
            let stop = match &self.current_run().error {
                Some(e) => Stop::Failed(e.clone()),
                None => Stop::End,
            };
            (self.send)(Update::Stopped(stop));
            self.finished();
        } else if self.at + 1 < self.timeline.len() {
            // A flag change (or restart) reports no stop, as in the live debugger.
            self.next_run();
        } else if finished {
            (self.send)(Update::Stopped(Stop::End));
            self.finished();
        } else {
            self.log("replay: the recording ends here");
        }
    }

    fn step(&mut self) {
        if self.deliver() {
            (self.send)(Update::Stopped(Stop::Stepped));
        } else {
            self.at_end();
        }
    }

    /// The first breakpoint the op just delivered hits.
    fn breakpoint_hit(&self) -> Option<usize> {
        let i = self.shown.checked_sub(1)?;
        let diff = |j: usize| self.op_diff(j);
        first_hit(
            &self.breakpoints,
            &self.current().events[..self.shown],
            i,
            &diff,
        )
    }

    /// rel L2 of op `i` against the comparison run: of the whole outputs, or of the recorded
    /// samples in a replay without tensors (as the Compare pane and the tree's marks show it).
    fn op_diff(&self, i: usize) -> Option<f64> {
        let other = &self.records[self.timeline[self.current_run().compared_with?]];
        let run = self.current();
        let e = &run.events[i];
        let j = other.find_for(e, &e.name)?;
        let (a, b) = (&run.outputs[i], &other.outputs[j]);
        let heads = self.info.layout.num_heads;
        let c = compare_outputs(e, i, a.data(), &other.events[j].shape, b.data(), heads);
        c.diff.ok().map(|d| d.error())
    }

    fn run_until(&mut self, next_layer: bool) {
        if self.exhausted() {
            return self.at_end();
        }
        let start = (self.shown > 0).then(|| {
            let e = &self.current().events[self.shown - 1];
            (e.phase, e.layer)
        });
        while self.deliver() {
            if let Some(b) = self.breakpoint_hit() {
                return self.report_stop(Stop::Breakpoint(b));
            }
            if next_layer {
                let e = &self.current().events[self.shown - 1];
                let moved = match start {
                    None => e.layer.is_some(),
                    Some((phase, layer)) => e.phase != phase || e.layer != layer,
                };
                if moved {
                    (self.send)(Update::Stopped(Stop::NextLayer));
                    return;
                }
            }
        }
        self.at_end();
    }

    fn refuse(&self, what: &str) {
        self.log(self.refusal(what));
    }

    /// Why a replay cannot do `what`, and where it can be done.
    fn refusal(&self, what: &str) -> String {
        format!(
            "replay: {what} needs recomputation, and a replay only shows what was recorded (`mladb replay FILE --verify` recomputes; `mladb tui` + `:load FILE` debugs it live)"
        )
    }

    /// What only a replay does: step through what was recorded, and refuse what would compute.
    fn run(&mut self, command: Command) -> Result<()> {
        match command {
            Command::Step => self.step(),
            Command::Steps(n) => {
                // Each step may cross into the next recorded run; stop once one changes nothing.
                for _ in 0..n.max(1) {
                    let before = (self.at, self.shown, self.end_shown);
                    self.step();
                    if (self.at, self.shown, self.end_shown) == before {
                        break;
                    }
                }
            }
            Command::NextLayer => self.run_until(true),
            Command::Continue => self.run_until(false),
            Command::Restart => {
                self.start();
                self.log("replay: back to the start");
            }
            Command::SetFlag(k, v) => self.refuse(&format!("set {k} {v}")),
            Command::Compare => {
                if !self.send_aux() {
                    self.refuse("computing the comparison runs (none were recorded for this run)");
                }
            }
            Command::Goto(Goto::Op(index)) => self.goto(index)?,
            Command::Load(path) => {
                let next = ReplayHost::open(&path, self.send.clone())?;
                *self = next;
            }
            Command::GotoNote(index) => self.goto_note(index)?,
            // The shared commands never reach here (see `DebugService::dispatch`).
            other => unreachable!("{other:?} is handled by DebugService::dispatch"),
        }
        Ok(())
    }
}
