//! How far a running command has got through the run, and about how long it has left. The
//! clock is the app's, so tests can move it by hand instead of sleeping.

use super::App;
use crate::engine::trace::Phase;
use std::time::{Duration, Instant};

/// Where the app reads the time: the system clock, or a test's.
pub type Clock = Box<dyn Fn() -> Instant + Send>;

/// The system clock.
pub fn system_clock() -> Clock {
    Box::new(Instant::now)
}

/// When the running command started, and the lowest fraction of the run seen since (a restart
/// or a flag change starts a new run from the beginning).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Started {
    pub at: Instant,
    pub from: f64,
}

/// No estimate before the command has covered this much of the run, or run this long: the
/// first ops say little about the rate.
const MIN_DONE: f64 = 0.05;
const MIN_ELAPSED: Duration = Duration::from_secs(1);

impl App {
    /// Fraction of the run done, while a command runs (for the gauge).
    pub fn progress(&self) -> Option<f64> {
        self.mirror.busy.as_ref()?;
        self.fraction()
    }

    /// Fraction of the run up to the execution position: phases, then layers within a phase.
    fn fraction(&self) -> Option<f64> {
        let info = self.mirror.info.as_ref()?;
        let e = self.mirror.position()?;
        let s = &info.schedule;
        let phases = (if s.prefill_len > 0 { 1 } else { 0 }) + s.prompt.len() - s.prefill_len
            + s.decode_steps;
        let phase_index = match e.phase {
            Phase::Prefill => 0,
            Phase::Decode(k) => k + usize::from(s.prefill_len > 0),
        };
        let layers = info.layers.len().max(1) as f64;
        let within = match e.layer {
            Some(l) => (l.saturating_sub(info.layers.start) + 1) as f64 / (layers + 1.0),
            None if e.name == "model.embed_tokens" => 0.0,
            None => 1.0,
        };
        Some(((phase_index as f64 + within) / phases.max(1) as f64).clamp(0.0, 1.0))
    }

    /// The busy state changed: a command started (its clock starts) or ended.
    pub(super) fn busy_changed(&mut self, busy: bool) {
        self.started = match (busy, self.started) {
            (true, None) => Some(Started {
                at: (self.clock)(),
                from: self.fraction().unwrap_or(0.0),
            }),
            (true, s) => s,
            (false, _) => None,
        };
    }

    /// An op arrived: a run started over lowers where the command started from.
    pub(super) fn progress_op(&mut self) {
        if self.started.is_none() {
            return;
        }
        let f = self.fraction();
        if let (Some(s), Some(f)) = (self.started.as_mut(), f) {
            s.from = s.from.min(f);
        }
    }

    /// About how long the running command has left, from its rate so far; `None` until it has
    /// covered 5% of the run and run for a second.
    pub fn time_left(&self) -> Option<Duration> {
        let p = self.progress()?;
        let s = self.started?;
        let elapsed = (self.clock)().saturating_duration_since(s.at);
        let done = p - s.from;
        if done < MIN_DONE || elapsed < MIN_ELAPSED {
            return None;
        }
        Duration::try_from_secs_f64(elapsed.as_secs_f64() * (1.0 - p) / done).ok()
    }

    /// `about 42s left`, `about 12m left`, `about 2.5h left`; `None` while there is no estimate.
    pub fn time_left_text(&self) -> Option<String> {
        let secs = self.time_left()?.as_secs_f64().round();
        Some(if secs < 90.0 {
            format!("about {secs:.0}s left")
        } else if secs < 90.0 * 60.0 {
            format!("about {:.0}m left", secs / 60.0)
        } else {
            format!("about {:.1}h left", secs / 3600.0)
        })
    }
}
