//! A replay's tour: the notes placed in its timeline, visited in order, each moving the replay
//! to where the note was typed and selecting the op it is about.

use super::ReplayHost;
use crate::debug::controller::Stop;
use crate::error::{Error, Result};
use crate::service::{DebugService, Update};
use crate::session::recorded::Annotation;
use crate::session::Session;

/// The session's notes in timeline order; notes typed at one place keep the order they were
/// typed in (a stable sort).
pub(super) fn stops(session: &Session) -> Vec<Annotation> {
    let mut stops = session.annotations.clone();
    stops.sort_by_key(|a| (a.run, a.op));
    stops
}

impl ReplayHost {
    /// Goes to note `index`: the replay moves to the note's place (back to the start first when
    /// that lies behind), the op it is about is selected, and the UI is told which note it is.
    pub(super) fn goto_note(&mut self, index: usize) -> Result<()> {
        let Some(note) = self.tour.get(index).cloned() else {
            return Err(Error::invalid(match self.tour.len() {
                0 => {
                    "this session has no notes placed in its timeline: nothing to tour".to_string()
                }
                n => format!("there is no note {}: this session has {n}", index + 1),
            }));
        };
        self.go_to_place(note.run, note.op);
        let mut about = String::new();
        if let Some(c) = &note.about {
            match self.current().find(c.phase, &c.op) {
                Some(i) if i < self.shown => {
                    (self.send)(Update::Select(i));
                    about = format!(" · {} {}", c.phase, c.op);
                }
                _ => self.log(format!(
                    "note {} is about {} {}, which run {} had not run where the note was typed",
                    index + 1,
                    c.phase,
                    c.op,
                    note.run
                )),
            }
        }
        let pane = note
            .pane
            .map_or(String::new(), |p| format!(" · {} pane", p.name()));
        self.log(format!(
            "tour: note {} of {}{about}{pane}",
            index + 1,
            self.tour.len()
        ));
        (self.send)(Update::NoteReached { index, moved: true });
        Ok(())
    }

    /// Moves the replay to run `run` (an index of the timeline) after its first `op` ops, as the
    /// stepping commands would: ends of runs passed report their outcome and comparison runs.
    fn go_to_place(&mut self, run: usize, op: usize) {
        let run = run.min(self.timeline.len() - 1);
        if (run, op) < (self.at, self.shown) {
            self.reset();
        }
        while self.at < run {
            while self.deliver() {}
            self.pass_end();
            self.next_run();
        }
        let op = op.min(self.current().len());
        while self.shown < op && self.deliver() {}
        (self.send)(Update::Stopped(Stop::Stepped));
        if self.exhausted() {
            self.pass_end();
        }
    }
}
