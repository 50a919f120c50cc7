//! The one-line summary of each layer row: its largest difference from the comparison run and
//! how many NaN/Inf and unwritten elements its ops produced. A full-size model has thousands of
//! ops per phase, so each op is folded in once, in the update step, and drawing only reads the
//! totals.

use super::App;
use crate::engine::trace::{OpEvent, Phase};
use crate::engine::OpKind;
use std::collections::HashMap;

/// What an op's statistics and buffers say is wrong with it (the tree's `x`, `?` and `!`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Health {
    /// The kernel wrote another buffer than the one handed on.
    pub disconnected: bool,
    /// Elements still holding the poison pattern.
    pub unwritten: usize,
    /// NaN and infinite elements, the unwritten ones left out (they are counted as NaN too).
    pub non_finite: usize,
}

/// The health of one op, from its trace event.
pub fn op_health(e: &OpEvent) -> Health {
    let s = &e.stats;
    // Index scores hold -inf where a key is masked out: expected, not a fault.
    let neg_inf = if e.kind == OpKind::IndexScores {
        0
    } else {
        s.neg_inf
    };
    Health {
        disconnected: e.kernel_wrote.is_some_and(|k| k.id != e.output.id),
        unwritten: s.unwritten,
        non_finite: s.nan.saturating_sub(s.unwritten) + s.pos_inf + neg_inf,
    }
}

/// One layer of one phase, summed up over its ops so far.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerSummary {
    /// Some op of it was compared with the comparison run.
    pub compared: bool,
    /// The largest relative L2 difference of its compared ops from the comparison run; NaN
    /// when one of them differs by NaN (a NaN output on one side).
    pub max_error: f64,
    /// Some op differs beyond its tolerance.
    pub diverges: bool,
    pub non_finite: usize,
    pub unwritten: usize,
}

impl Default for LayerSummary {
    fn default() -> LayerSummary {
        LayerSummary {
            compared: false,
            max_error: 0.0,
            diverges: false,
            non_finite: 0,
            unwritten: 0,
        }
    }
}

/// The summaries of one run against one comparison run (or none), with how many ops each
/// source has been folded in from.
#[derive(Default)]
pub struct Summaries {
    stats_done: usize,
    errors_done: usize,
    layers: HashMap<(Phase, usize), LayerSummary>,
}

impl Summaries {
    pub fn get(&self, phase: Phase, layer: usize) -> Option<&LayerSummary> {
        self.layers.get(&(phase, layer))
    }
}

impl App {
    /// Folds the ops of the current run not folded yet into their layer's summary: statistics
    /// as ops arrive, differences as the comparison marks them (see `refresh_marks`).
    pub(super) fn refresh_summaries(&mut self) {
        let m = &self.mirror;
        let Some(run) = m.current() else { return };
        let key = (m.current_number(), m.comparison);
        let marks = m.comparison.and_then(|c| self.mark_cache.get(&(key.0, c)));
        let s = self.summary_cache.entry(key).or_default();
        let events = &run.events;
        while s.stats_done < events.len() {
            let e = &events[s.stats_done];
            s.stats_done += 1;
            let Some(l) = e.layer else { continue };
            let h = op_health(e);
            let sum = s.layers.entry((e.phase, l)).or_default();
            sum.non_finite += h.non_finite;
            sum.unwritten += h.unwritten;
        }
        let Some(marks) = marks else { return };
        let judged = marks.errors.len().min(events.len());
        while s.errors_done < judged {
            let i = s.errors_done;
            s.errors_done += 1;
            let e = &events[i];
            let Some(l) = e.layer else { continue };
            let (diverges, tolerance) = marks.verdicts[i];
            if tolerance.is_nan() {
                continue; // not compared
            }
            let sum = s.layers.entry((e.phase, l)).or_default();
            let error = marks.errors[i];
            // A NaN difference is the worst there is: once in, nothing compares above it.
            if error.is_nan() || error > sum.max_error {
                sum.max_error = error;
            }
            sum.compared = true;
            sum.diverges |= diverges;
        }
    }

    /// The summary of layer `layer` of `phase` in the current run, as far as it has run.
    pub fn layer_summary(&self, phase: Phase, layer: usize) -> Option<&LayerSummary> {
        let m = &self.mirror;
        self.summary_cache
            .get(&(m.current_number(), m.comparison))?
            .get(phase, layer)
    }
}
