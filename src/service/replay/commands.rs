//! What a replay does besides stepping: jumps, and its side of the shared commands (bisect over
//! recorded outputs, saving, the flags that had nothing to act on, judged from the recorded ops
//! as live).

use super::ReplayHost;
use crate::debug::breakpoint::Breakpoint;
use crate::debug::compare::{compare_runs, OpComparison};
use crate::debug::controller::Stop;
use crate::debug::idle::{idle_flags, Idle};
use crate::debug::RunRecord;
use crate::error::{Error, Result};
use crate::service::{no_comparison, Command, DebugService, Send, Update};
use crate::session::recorded::Annotation;
use crate::session::Cursor;
use crate::tensor::Tensor;
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
}

impl DebugService for ReplayHost {
    fn sender(&self) -> &Send {
        &self.send
    }

    fn execute(&mut self, command: Command) -> Result<()> {
        self.run(command)
    }

    fn breakpoints_mut(&mut self) -> &mut Vec<Breakpoint> {
        &mut self.breakpoints
    }

    fn place(&self) -> (usize, usize) {
        (self.at, self.shown)
    }

    fn annotations_mut(&mut self) -> &mut Vec<Annotation> {
        &mut self.annotations
    }

    /// The ops shown so far against the recorded comparison run; needs the full tensors.
    fn op_comparisons(&self, what: &str) -> Result<Vec<OpComparison>> {
        let Some(c) = self.current_run().compared_with else {
            return Err(no_comparison(what, "this run has none"));
        };
        if !self.full {
            return Err(Error::invalid(
                self.refusal(&format!("{what} over sampled values")),
            ));
        }
        let mut partial = RunRecord::new(self.current().flags);
        for i in 0..self.shown {
            partial.push(
                self.current().events[i].clone(),
                self.current().outputs[i].clone(),
            );
        }
        let other = &self.records[self.timeline[c]];
        let tolerances =
            crate::debug::tolerance::Tolerances::table_for(partial.flags.dtype, other.flags.dtype);
        Ok(compare_runs(
            &partial,
            other,
            self.info.layout.num_heads,
            &tolerances,
        ))
    }

    /// The session as recorded, with the cursor, notes and breakpoints of now.
    fn save(
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

    /// Judged as the live debugger does, once the run's recorded ops have all been shown.
    fn idle_now(&self) -> Vec<Idle> {
        let run = self.current_run();
        let finished = self.exhausted() && run.outcome.is_some();
        let events = &self.current().events[..self.shown];
        idle_flags(&run.flags, &self.kv_b, events, finished)
    }

    fn reported_idle(&mut self) -> &mut Vec<Idle> {
        &mut self.idle
    }
}
