//! The host's sessions: the session as it stands (everything recorded), saving it, and loading
//! one in place of the current debugger.

use super::Host;
use crate::debug::controller::Stop;
use crate::debug::RunRecord;
use crate::engine::generate::Schedule;
use crate::error::{Error, Result};
use crate::model::tokenizer::TextCodec;
use crate::service::{DebugService, HostSpec, Update};
use crate::session::recorded::{RecordedRun, RecordedSchedule, RunRole};
use crate::session::{Cursor, Session};
use crate::tensor::Tensor;
use std::path::PathBuf;
use std::sync::Arc;

impl Host {
    /// The session as it stands: what it is (v1's fields) and everything recorded: every run of
    /// the controller's history and the current one, the comparison runs computed, the notes'
    /// places.
    pub fn session(&self, cursor: Option<Cursor>, notes: Vec<String>) -> Session {
        let c = &self.controller;
        let mut s = Session::new(self.source.clone(), c.schedule());
        s.layers = (c.layers().start, c.layers().end);
        s.describe_model(c.model());
        s.flags = c.flags();
        s.breakpoints = c.breakpoints().to_vec();
        s.cursor = cursor;
        s.notes = notes
            .into_iter()
            .filter(|n| !self.annotations.iter().any(|a| &a.text == n))
            .collect();
        s.annotations = self.annotations.clone();
        let mut records: Vec<&RunRecord> = c.history().iter().map(|r| &**r).collect();
        records.push(c.current());
        for (n, record) in records.into_iter().enumerate() {
            let mut run = RecordedRun::of(record, RunRole::Main, true);
            let (started_at, first, compared) =
                self.starts.get(n).copied().unwrap_or((1, None, None));
            run.started_at = started_at;
            run.first_affected = first;
            run.compared_with = compared;
            // A run from before a schedule change (`:set decode N`) records its own.
            if c.schedule_of(n) != c.schedule() {
                run.schedule = Some(RecordedSchedule::of(c.schedule_of(n)));
            }
            s.runs.push(run);
            for (of, kind, schedule, record) in self.aux.iter().filter(|a| a.0 == n) {
                let mut run = RecordedRun::of(
                    record,
                    RunRole::Aux {
                        of: *of,
                        kind: kind.name().to_string(),
                    },
                    true,
                );
                run.schedule = Some(RecordedSchedule::of(schedule));
                s.runs.push(run);
            }
        }
        s
    }

    /// The outputs of every recorded run, in the session's order.
    pub(super) fn outputs(&self) -> Vec<Vec<Arc<Tensor>>> {
        let c = &self.controller;
        let mut out = Vec::new();
        let mut records: Vec<&RunRecord> = c.history().iter().map(|r| &**r).collect();
        records.push(c.current());
        for (n, record) in records.into_iter().enumerate() {
            out.push(record.outputs.clone());
            for (_, _, _, r) in self.aux.iter().filter(|a| a.0 == n) {
                out.push(r.outputs.clone());
            }
        }
        out
    }

    /// Reads a session file on a thread of its own, so that Esc cancels a long read (a large
    /// file parses at about 5 MB/s): the read is abandoned, and its result dropped when it ends.
    fn read_session(&self, path: &std::path::Path) -> Result<Session> {
        use std::sync::atomic::Ordering;
        use std::sync::mpsc::RecvTimeoutError;
        let cancel = self.cancel.clone();
        cancel.store(false, Ordering::Relaxed);
        let (tx, rx) = std::sync::mpsc::channel();
        let owned = path.to_path_buf();
        std::thread::Builder::new()
            .name("mladb-load".into())
            .spawn(move || {
                let _ = tx.send(Session::load(&owned));
            })
            .map_err(|e| Error::invalid(format!("cannot start a thread to load: {e}")))?;
        loop {
            match rx.recv_timeout(std::time::Duration::from_millis(20)) {
                Ok(result) => return result,
                Err(RecvTimeoutError::Timeout) => {
                    if cancel.swap(false, Ordering::Relaxed) {
                        return Err(Error::invalid(format!(
                            "load {}: cancelled",
                            path.display()
                        )));
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::invalid(format!("load {}: failed", path.display())))
                }
            }
        }
    }

    /// Replaces the debugger with a saved session and runs it to its cursor.
    pub(super) fn load(&mut self, path: PathBuf) -> Result<()> {
        let session = self.read_session(&path)?;
        let backend = self.controller.backend().clone();
        let model = if session.model == self.source {
            self.controller.model_arc()
        } else {
            Arc::new(crate::setup::load_model(&session.model)?)
        };
        if session.layers.1 > model.layout.num_layers || session.layers.0 >= session.layers.1 {
            return Err(Error::parse(
                &path,
                format!("layers {:?} do not fit the model", session.layers),
            ));
        }
        // A prompt too long for memory is refused before anything is recomputed.
        crate::memory::check(
            &model,
            session.prompt.len().saturating_add(session.decode),
            &(session.layers.0..session.layers.1),
            self.max_memory_gb,
        )?;
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
            max_memory_gb: self.max_memory_gb,
            reference: None,
            text: match &session.model {
                crate::session::ModelSource::Checkpoint { path, .. } if path.is_dir() => {
                    TextCodec::find(None, Some(path))?.map(Arc::new)
                }
                _ => None,
            },
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
        // Placed notes keep their op and pane; the timeline they were placed in is not
        // recomputed (only the last run is, to the cursor), so they are placed where the
        // loaded debugger stands.
        let (run, op) = next.place();
        next.annotations = session
            .annotations
            .iter()
            .map(|a| crate::session::recorded::Annotation {
                run,
                op,
                ..a.clone()
            })
            .collect();
        let placed = session.annotations.iter().map(|a| &a.text);
        let notes: Vec<String> = session.notes.iter().chain(placed).cloned().collect();
        for note in &notes {
            next.log(format!("note: {note}"));
        }
        (self.send)(Update::Notes(notes));
        next.log(format!("loaded session {}", path.display()));
        *self = next;
        Ok(())
    }
}
