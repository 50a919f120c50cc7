//! What the panes show that takes computing: each op's verdict against the comparison run (the
//! tree's marks) and the first divergent op of each whole-run comparison (the Compare pane).
//! They are brought up to date in the update step, after the run or the view changes, so that
//! drawing only reads them.

use super::{App, Tab};
use crate::debug::compare::OpComparison;
use crate::debug::compare::{compare_outputs, compare_runs, first_divergence, prefill_vs_decode};
use crate::debug::selection::first_choice_difference;
use crate::debug::tolerance::{Judge, Tolerances};
use crate::engine::trace::Phase;
use crate::service::AuxKind;
use std::collections::HashMap;

/// The verdicts of one run against its comparison run, extended op by op as the run streams
/// in: whether each op diverges beyond its tolerance, and that tolerance.
pub struct Marks {
    pub judge: Judge,
    /// Per op: (diverges, tolerance); the tolerance is NaN where the op was not compared.
    pub verdicts: Vec<(bool, f64)>,
    /// Per op: the relative L2 difference; NaN where the op was not compared.
    pub errors: Vec<f64>,
}

impl Marks {
    fn new(tolerances: Tolerances, run: &crate::debug::RunRecord) -> Marks {
        Marks {
            judge: Judge::new(tolerances).with_kv_cache(run.flags.kv_cache),
            verdicts: Vec::new(),
            errors: Vec::new(),
        }
    }

    /// Judges the ops of `run` not judged yet against `other`, in execution order.
    fn extend(
        &mut self,
        run: &crate::debug::RunRecord,
        other: &crate::debug::RunRecord,
        heads: usize,
    ) {
        while self.verdicts.len() < run.len() {
            let i = self.verdicts.len();
            let e = &run.events[i];
            // Samples of a replay compare where both sides hold the same elements; a comparison
            // that could not be made judges nothing.
            let mut compared = other
                .find_for(e, &e.name)
                .map(|j| {
                    let (a, b) = (run.outputs[i].data(), other.outputs[j].data());
                    let heads = crate::debug::compare::rank_heads(run, e, heads);
                    compare_outputs(e, i, a, &other.events[j].shape, b, heads)
                })
                .filter(|c| c.diff.is_ok());
            self.judge.next_of(run, i, compared.as_mut());
            self.errors.push(
                compared
                    .as_ref()
                    .and_then(|c| c.diff.as_ref().ok())
                    .map_or(f64::NAN, |d| d.rel_l2),
            );
            self.verdicts.push(match compared {
                Some(c) => (c.diverges(), c.tolerance),
                None => (false, f64::NAN),
            });
        }
    }
}

/// The tolerances of `run` against `other`: the bf16 table when either side is bf16.
fn tolerances_of(run: &crate::debug::RunRecord, other: &crate::debug::RunRecord) -> Tolerances {
    Tolerances::table_for(run.flags.dtype, other.flags.dtype)
}

/// The first op over tolerance in a comparison, how many ops were compared, and how many could
/// not be, with the first reason (a replay of samples, say).
#[derive(Debug, Clone, PartialEq)]
pub struct Divergence {
    pub first: Option<(usize, Phase, String)>,
    pub compared: usize,
    /// Ops over their tolerance only through NaN / ±Inf alike on both sides (not differences).
    pub alike: usize,
    /// The judged tolerance of each compared op, by index.
    pub tolerances: HashMap<usize, f64>,
    pub not_compared: Option<(usize, String)>,
    /// The first choice (DSA top-k, MoE routing) the two runs made differently: its index, phase
    /// and name, and how many of its rows differ.
    pub choice: Option<(usize, Phase, String, usize)>,
}

impl Divergence {
    fn of(list: &[OpComparison], choice: Option<(usize, Phase, String, usize)>) -> Divergence {
        let failed: Vec<&String> = list.iter().filter_map(|c| c.diff.as_ref().err()).collect();
        Divergence {
            choice,
            first: first_divergence(list).map(|c| (c.index, c.phase, c.name.clone())),
            compared: list.len() - failed.len(),
            alike: list.iter().filter(|c| c.fails_only_alike()).count(),
            tolerances: list.iter().map(|c| (c.index, c.tolerance)).collect(),
            not_compared: failed.first().map(|why| (failed.len(), why.to_string())),
        }
    }
}

/// The whole-run comparisons the Compare pane names the first divergent op of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Against {
    /// The run before the last flag change.
    Comparison,
    /// The comparison run of this kind.
    Aux(AuxKind),
}

impl App {
    /// Brings the derived comparisons up to date: the marks of the current run, the layer
    /// summaries made from them, and, while the Compare pane shows an op, the first divergent
    /// op of each comparison it shows. Each is computed once per state of the runs.
    pub fn refresh_comparisons(&mut self) {
        self.refresh_marks();
        self.refresh_summaries();
        if self.tab == Tab::Compare && self.selected_op().is_some() {
            for against in [
                Against::Comparison,
                Against::Aux(AuxKind::OtherPath),
                Against::Aux(AuxKind::WholePrefill),
                Against::Aux(AuxKind::Reference),
            ] {
                self.refresh_divergence(against);
            }
        }
    }

    /// The key of the current run's state against `against`.
    pub fn divergence_key(&self, against: Against) -> (usize, usize, Against) {
        let len = self.mirror.current().map_or(0, |r| r.len());
        (self.mirror.current_number(), len, against)
    }

    fn refresh_divergence(&mut self, against: Against) {
        let key = self.divergence_key(against);
        if self.divergence_cache.contains_key(&key) {
            return;
        }
        let m = &self.mirror;
        let (Some(run), Some(layout)) = (m.current(), m.layout()) else {
            return;
        };
        let heads = layout.num_heads;
        let tolerances = Tolerances::Table(run.flags.dtype);
        // Runs of one schedule are also compared choice by choice (a decode row against the
        // whole prefill's is `check`'s to pair).
        let (list, same_schedule) = match against {
            Against::Comparison => match (m.comparison, m.comparison_run()) {
                (Some(_), Some(other)) => (
                    compare_runs(run, other, heads, &tolerances_of(run, other)),
                    Some(other),
                ),
                _ => return,
            },
            Against::Aux(AuxKind::OtherPath) => match m.aux(AuxKind::OtherPath) {
                Some(other) => (compare_runs(run, other, heads, &tolerances), Some(other)),
                None => return,
            },
            Against::Aux(AuxKind::WholePrefill) => match m.aux(AuxKind::WholePrefill) {
                Some(whole) => (prefill_vs_decode(run, whole, heads, &tolerances), None),
                None => return,
            },
            Against::Aux(AuxKind::Reference) => match m.aux(AuxKind::Reference) {
                Some(r) => (compare_runs(run, r, heads, &tolerances_of(run, r)), Some(r)),
                None => return,
            },
        };
        let choice = same_schedule
            .and_then(|other| first_choice_difference(run, other))
            .map(|(i, rows)| {
                let e = &run.events[i];
                (i, e.phase, e.name.clone(), rows)
            });
        self.divergence_cache
            .insert(key, Divergence::of(&list, choice));
    }

    /// Judges the ops of the current run not judged yet against the comparison run and the
    /// reference dump, in execution order, each once.
    fn refresh_marks(&mut self) {
        let m = &self.mirror;
        let (Some(run), Some(layout)) = (m.current(), m.layout()) else {
            return;
        };
        let heads = layout.num_heads;
        if let (Some(c), Some(other)) = (m.comparison, m.comparison_run()) {
            self.mark_cache
                .entry((m.current_number(), c))
                .or_insert_with(|| Marks::new(tolerances_of(run, other), run))
                .extend(run, other, heads);
        }
        if let Some(reference) = m.aux(AuxKind::Reference) {
            self.reference_marks
                .entry(m.current_number())
                .or_insert_with(|| Marks::new(tolerances_of(run, reference), run))
                .extend(run, reference, heads);
        }
    }

    /// Op `index` of the current run against the reference dump: whether it diverges beyond
    /// its tolerance, and its relative L2 difference; `None` where it was not compared.
    pub fn judged_against_reference(&self, index: usize) -> Option<(bool, f64)> {
        let marks = self.reference_marks.get(&self.mirror.current_number())?;
        let (diverges, tolerance) = *marks.verdicts.get(index)?;
        (!tolerance.is_nan()).then(|| (diverges, marks.errors[index]))
    }

    /// Op `index` of the current run against the comparison run: whether it diverges beyond its
    /// tolerance, and that tolerance (floor + gain × the error of what it read).
    pub fn judged_against_comparison(&self, index: usize) -> Option<(bool, f64)> {
        let m = &self.mirror;
        let key = (m.current_number(), m.comparison?);
        self.mark_cache.get(&key)?.verdicts.get(index).copied()
    }
}
