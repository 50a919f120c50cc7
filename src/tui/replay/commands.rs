//! What a replay does besides stepping: jumps, bisect over recorded outputs, saving, and the
//! report of flags that had nothing to act on (judged from the recorded ops as live).

use super::ReplayHost;
use crate::debug::compare::compare_runs;
use crate::debug::controller::Stop;
use crate::debug::idle::idle_flags;
use crate::debug::RunRecord;
use crate::error::{Error, Result};
use crate::session::Cursor;
use crate::tensor::Tensor;
use crate::tui::host::Update;
use std::path::Path;
use std::sync::Arc;

impl ReplayHost {
    /// `:goto N`: op N of the run shown, delivering the recorded ops up to it.
    pub(super) fn goto(&mut self, index: usize) -> Result<()> {
        let len = self.current().len();
        if index >= len {
            return Err(Error::invalid(format!(
                "goto {index}: this run recorded ops #0..#{}",
                len.saturating_sub(1)
            )));
        }
        if index >= self.shown {
            while self.shown <= index && self.deliver() {}
            (self.send)(Update::Stopped(Stop::Stepped));
        }
        let e = &self.current().events[index];
        self.log(format!("goto #{index}: {} {}", e.phase, e.name));
        (self.send)(Update::Select(index));
        Ok(())
    }

    pub(super) fn bisect(&self) {
        let Some(c) = self.current_run().compared_with else {
            return self.log("bisect needs an earlier run to compare with: this run has none");
        };
        if !self.full {
            return self.refuse("bisect over sampled values");
        }
        let mut partial = RunRecord::new(self.current().flags);
        for i in 0..self.shown {
            partial.push(
                self.current().events[i].clone(),
                self.current().outputs[i].clone(),
            );
        }
        let other = &self.records[self.timeline[c]];
        let tolerances = crate::debug::tolerance::Tolerances::Table(partial.flags.dtype);
        let diffs = compare_runs(&partial, other, self.info.layout.num_heads, &tolerances);
        let (line, select) = crate::tui::host::bisect_report(&diffs);
        self.log(line);
        if let Some(index) = select {
            (self.send)(Update::Select(index));
        }
    }

    /// The session as recorded, with the cursor, notes and breakpoints of now.
    pub(super) fn save(
        &self,
        path: &Path,
        cursor: Option<Cursor>,
        notes: Vec<String>,
        tensors: bool,
    ) -> Result<()> {
        let mut s = self.session.clone();
        s.cursor = cursor;
        s.breakpoints = self.breakpoints.clone();
        s.tensors = None;
        for n in notes {
            let placed = self.annotations.iter().any(|a| a.text == n);
            if !placed && !s.notes.contains(&n) {
                s.notes.push(n);
            }
        }
        s.annotations.extend(self.annotations.iter().cloned());
        if tensors || self.full {
            if !self.full {
                return Err(Error::invalid(
                    "this replay holds sampled values only: it cannot write full tensors",
                ));
            }
            let outputs: Vec<Vec<Arc<Tensor>>> =
                self.records.iter().map(|r| r.outputs.clone()).collect();
            s.save_with_tensors(path, &outputs)
        } else {
            s.save(path)
        }
    }

    /// Tells the UI which flags of the run shown had nothing to act on, as the live debugger
    /// does: judged once the run's recorded ops have all been shown.
    pub(super) fn report_idle(&mut self) {
        let run = self.current_run();
        let finished = self.exhausted() && run.outcome.is_some();
        let events = &self.current().events[..self.shown];
        let idle = idle_flags(&run.flags, &self.kv_b, events, finished);
        if idle == self.idle {
            return;
        }
        for i in idle.iter().filter(|i| !self.idle.contains(i)) {
            self.log(format!("note: {i}"));
        }
        (self.send)(Update::Idle(idle.clone()));
        self.idle = idle;
    }
}
