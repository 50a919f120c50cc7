//! `mladb attach --tui`: the debugger on a live attachment. The engine drives the run: each
//! sequence it runs is a run in the debugger, whose ops are mladb's reference ops as the
//! comparison makes them, with the engine's values at those ops beside them (the tree's `ref`
//! column and the Compare pane's reference section, as `tui --reference` shows a dump), and
//! the comparison's findings and notes in the log.

use std::sync::mpsc::Receiver;
use std::sync::Arc;

use crate::attach::live::{Comparator, Live};
use crate::engine::generate::Schedule;
use crate::service::{AuxKind, Info, Send, Update};
use crate::setup::Prepared;

/// What the comparison hands the debugger, kept in step with it.
pub struct Feed {
    send: Send,
    /// The sequence shown (the comparator's count), and how many of its ops were sent.
    sequence: usize,
    sent: usize,
    /// The engine's values sent for the sequence so far (their count).
    engine_sent: usize,
    /// The comparator's re-runs of the sequence already reflected in what was sent.
    reruns: usize,
}

impl Feed {
    /// Tells the debugger what is loaded.
    pub fn new(send: Send, p: &Prepared) -> Feed {
        send(Update::Loaded(Box::new(Info {
            layout: p.model.layout.clone(),
            source: format!(
                "{} (attached: the engine drives the run)",
                p.model.weights.describe()
            ),
            schedule: Schedule {
                prompt: Vec::new(),
                prefill_len: 0,
                decode_steps: 0,
            },
            layers: p.layers.clone(),
        })));
        Feed {
            send,
            sequence: 0,
            sent: 0,
            engine_sent: 0,
            reruns: 0,
        }
    }

    /// Sends what changed: findings and notes to the log, mladb's new ops, and, when a step
    /// ended, the engine's values so far.
    pub fn sync(&mut self, comparator: &Comparator, lives: &[Live], step_ended: bool) {
        for live in lives {
            let line = match live {
                Live::Finding {
                    step,
                    rank,
                    finding,
                } => format!(
                    "finding at step {step}{}: {} {} {}: {}",
                    rank.map_or(String::new(), |r| format!(", rank {r}")),
                    finding.kind,
                    finding.phase,
                    finding.op,
                    finding.detail
                ),
                Live::Note { text, .. } => format!("note: {text}"),
                _ => continue,
            };
            (self.send)(Update::Log(line));
        }
        let Some((run, engine)) = comparator.runs() else {
            return;
        };
        // A new sequence is a new run.
        let number = comparator.sequences.saturating_sub(1);
        if number != self.sequence {
            self.sequence = number;
            self.sent = 0;
            self.engine_sent = 0;
            self.reruns = 0;
        }
        // mladb re-ran the sequence with the engine's choice imposed: the ops sent from the
        // choice on hold other values now (those it let go of stay as the debugger has them).
        if let Some((reruns, from)) = comparator.recomputed() {
            if reruns != self.reruns {
                self.reruns = reruns;
                for i in from..self.sent.min(run.len()) {
                    if run.outputs[i].numel() > 0 {
                        (self.send)(Update::Recomputed {
                            run: number,
                            event: Box::new(run.events[i].clone()),
                            output: run.outputs[i].clone(),
                        });
                    }
                }
            }
        }
        for i in self.sent..run.len() {
            (self.send)(Update::Op {
                run: number,
                flags: run.flags,
                event: Box::new(run.events[i].clone()),
                output: run.outputs[i].clone(),
            });
        }
        self.sent = run.len();
        if step_ended && engine.len() != self.engine_sent {
            self.engine_sent = engine.len();
            (self.send)(Update::Aux {
                run: number,
                kind: AuxKind::Reference,
                record: Arc::new(engine.clone()),
            });
        }
    }
}

/// The debugger over the updates the comparison sends, until the user quits.
pub fn show(updates: Receiver<Update>) -> crate::error::Result<()> {
    use crate::tui::{app::App, driver::FeedDriver, keys::Keymap, term, theme::Theme};
    let driver = FeedDriver::new(
        updates,
        "attach: the engine drives this run (stepping, flags and restarts are off)",
    );
    let keymap = match Keymap::default_path() {
        Some(path) => Keymap::with_overrides(&path)?,
        None => Keymap::default(),
    };
    let mut app = App::new(Box::new(driver), keymap, Theme::from_env());
    app.say("attached: each step the engine runs appears as mladb runs its reference; q quits");
    term::run_terminal(app)
}
