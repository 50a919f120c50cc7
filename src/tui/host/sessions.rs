//! The host's sessions: the session as it stands (everything recorded), saving it, and loading
//! one in place of the current debugger.

use super::{Host, HostSpec, Update};
use crate::debug::controller::Stop;
use crate::debug::RunRecord;
use crate::engine::generate::Schedule;
use crate::error::{Error, Result};
use crate::model::{Layout, Model};
use crate::session::recorded::{RecordedRun, RecordedSchedule, RunRole};
use crate::session::{Cursor, ModelSource, Session};
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

    pub(super) fn save(
        &self,
        path: &std::path::Path,
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
            Arc::new(load_model(&session.model)?)
        };
        if session.layers.1 > model.layout.num_layers || session.layers.0 >= session.layers.1 {
            return Err(Error::parse(
                &path,
                format!("layers {:?} do not fit the model", session.layers),
            ));
        }
        // A prompt too long for memory is refused before anything is recomputed.
        crate::memory::check(
            &model.layout,
            session.prompt.len().saturating_add(session.decode),
            &(session.layers.0..session.layers.1),
            8 << 30,
            None,
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
