//! How the UI reaches the debugger service: it sends commands and polls updates, never waiting.
//! The real UI runs the live host on a worker thread; tests, and replays (nothing a replay does
//! takes long), run the service inline, so a key press is fully handled when `send` returns and
//! no test sleeps.

use crate::error::Result;
use crate::service::{Command, DebugService, Host, HostSpec, ReplayHost, Send, Update};
use crate::session::Session;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

pub trait Driver {
    /// Queues a command (the inline driver runs it at once).
    fn send(&mut self, command: Command);
    /// Updates that arrived since the last poll; never blocks.
    fn poll(&mut self) -> Vec<Update>;
    /// Asks a running command to stop between two ops.
    fn cancel(&self);
}

/// The host on a worker thread.
pub struct ThreadDriver {
    commands: Option<Sender<Command>>,
    updates: Receiver<Update>,
    cancel: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl ThreadDriver {
    pub fn start(spec: HostSpec) -> Result<ThreadDriver> {
        let (command_tx, command_rx) = channel::<Command>();
        let (update_tx, update_rx) = channel::<Update>();
        let cancel = Arc::new(AtomicBool::new(false));
        let thread_cancel = cancel.clone();
        let handle = std::thread::Builder::new()
            .name("mladb-debugger".into())
            .spawn(move || {
                let tx = Mutex::new(update_tx);
                let send: Send = Arc::new(move |u| {
                    let _ = tx.lock().unwrap_or_else(|p| p.into_inner()).send(u);
                });
                let mut host = match Host::new(spec, send.clone(), thread_cancel) {
                    Ok(h) => h,
                    Err(e) => {
                        send(Update::Error(e.to_string()));
                        return;
                    }
                };
                while let Ok(command) = command_rx.recv() {
                    host.handle(command);
                }
            })
            .map_err(|e| crate::Error::invalid(format!("cannot start the debugger thread: {e}")))?;
        Ok(ThreadDriver {
            commands: Some(command_tx),
            updates: update_rx,
            cancel,
            handle: Some(handle),
        })
    }
}

impl Driver for ThreadDriver {
    fn send(&mut self, command: Command) {
        if let Some(tx) = &self.commands {
            let _ = tx.send(command);
        }
    }

    fn poll(&mut self) -> Vec<Update> {
        self.updates.try_iter().collect()
    }

    fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Drop for ThreadDriver {
    fn drop(&mut self) {
        // Stop whatever runs, close the command queue, and wait for the thread.
        self.cancel.store(true, Ordering::Relaxed);
        self.commands = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// A service on the caller's thread: commands complete inside `send`.
pub struct Inline<S> {
    host: S,
    queue: Arc<Mutex<Vec<Update>>>,
    cancel: Arc<AtomicBool>,
}

/// The live host on the caller's thread.
pub type InlineDriver = Inline<Host>;
/// A recorded session on the caller's thread.
pub type ReplayDriver = Inline<ReplayHost>;

/// The queue updates go to, and what sends to it.
fn queue() -> (Arc<Mutex<Vec<Update>>>, Send) {
    let queue = Arc::new(Mutex::new(Vec::new()));
    let q = queue.clone();
    let send: Send = Arc::new(move |u| q.lock().unwrap_or_else(|p| p.into_inner()).push(u));
    (queue, send)
}

impl InlineDriver {
    pub fn new(spec: HostSpec) -> Result<InlineDriver> {
        let (queue, send) = queue();
        let cancel = Arc::new(AtomicBool::new(false));
        let host = Host::new(spec, send, cancel.clone())?;
        Ok(InlineDriver {
            host,
            queue,
            cancel,
        })
    }
}

impl ReplayDriver {
    pub fn open(path: &Path) -> Result<ReplayDriver> {
        ReplayDriver::new(Session::load(path)?, path)
    }

    /// The replay of a session already loaded from `path` (where its companion tensors are).
    pub fn new(session: Session, path: &Path) -> Result<ReplayDriver> {
        let (queue, send) = queue();
        let host = ReplayHost::new(session, path, send)?;
        Ok(Inline {
            host,
            queue,
            cancel: Arc::new(AtomicBool::new(false)),
        })
    }
}

impl<S> Inline<S> {
    pub fn host(&self) -> &S {
        &self.host
    }
}

impl<S: DebugService> Driver for Inline<S> {
    fn send(&mut self, command: Command) {
        self.host.handle(command);
    }

    fn poll(&mut self) -> Vec<Update> {
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

/// Updates fed from elsewhere (a live attachment: the engine drives the run, not the
/// debugger's keys); commands that would step or change the run are answered with a note.
pub struct FeedDriver {
    updates: Receiver<Update>,
    local: Vec<Update>,
    /// What a command is answered with.
    why: String,
}

impl FeedDriver {
    pub fn new(updates: Receiver<Update>, why: impl Into<String>) -> FeedDriver {
        FeedDriver {
            updates,
            local: Vec::new(),
            why: why.into(),
        }
    }
}

impl Driver for FeedDriver {
    fn send(&mut self, _command: Command) {
        self.local.push(Update::Error(self.why.clone()));
    }

    fn poll(&mut self) -> Vec<Update> {
        let mut out = std::mem::take(&mut self.local);
        out.extend(self.updates.try_iter());
        out
    }

    fn cancel(&self) {}
}
