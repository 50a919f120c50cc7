//! Selection-aware comparison of the examined run (A) with a second run (B) that differs from
//! it in one thing: the MLA path, prefill against decode, the kv_b_proj route, two flag sets.
//!
//! Numbers are compared op by op (selection ops excluded), choices row by row. When B chooses
//! differently from A at a row and both runs' margins are within the dtype's noise (a near-tie
//! that rounding moved), the flip is noted and B is re-run from that op with A's choice forced
//! (teacher forcing), so that one flip does not cascade into every later op. Flips are resolved
//! in execution order up to the first real difference (an op over its tolerance, or a flip at a
//! clear margin), since what follows a real difference may be its consequence.

use super::compare::{compare_outputs, compare_runs, prefill_vs_decode, OpComparison};
use super::external::{ExternalDump, ReferenceComparison};
use super::flags::Flags;
use super::record::{ReplayPrefix, RunRecord};
use super::runner::Job;
use super::selection::{
    align_weights, choices_of, diff_row, is_selection, run_choices, scores_kind, scores_op,
    OtherRow, SelectionDiff,
};
use super::tolerance::Tolerances;
use crate::engine::generate::Schedule;
use crate::engine::trace::Phase;
use crate::engine::ForcedSelections;
use crate::error::Result;
use std::sync::Arc;

/// How B's ops line up with A's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pairing {
    /// The same schedule: ops matched by phase and name, rows by row.
    SameSchedule,
    /// B prefilled the whole sequence: A's decode-step ops against the row of the same token
    /// in B's prefill.
    DecodeRows,
    /// A ran on `tp` tensor-parallel ranks and B on one: each rank's op against its part of
    /// B's op (see [`super::tp`]).
    Ranks { tp: usize },
}

/// The most re-runs one comparison makes before it stops forcing (and says so).
pub const MAX_RERUNS: usize = 64;

/// A comparison of A with B after forcing B's noise-level flips.
pub struct Paired {
    /// Numeric comparisons of every paired op but the selections, in A's order.
    pub comparisons: Vec<OpComparison>,
    /// Flips within noise, each forced in B.
    pub flips: Vec<SelectionDiff>,
    /// Choices that differ at a clear margin (real differences), or that could not be resolved.
    pub clear: Vec<SelectionDiff>,
    /// B as last run.
    pub other: RunRecord,
    /// Ops computed by B's runs.
    pub ops_executed: usize,
    /// Runs of B made to force flips.
    pub reruns: usize,
    /// Set when forcing stopped at [`MAX_RERUNS`].
    pub gave_up: bool,
}

impl Paired {
    /// The index in A of the first real difference: an op over its tolerance or a clear flip.
    pub fn first_difference(&self) -> Option<usize> {
        let numeric = self
            .comparisons
            .iter()
            .find(|c| c.diverges())
            .map(|c| c.index);
        let clear = self.clear.first().map(|d| d.index);
        numeric.into_iter().chain(clear).min()
    }
}

/// Compares `a` with B, a run of `schedule_b` under `flags_b`, paired as `pairing`.
pub fn compare_paired(
    job: &Job,
    a: &RunRecord,
    flags_b: Flags,
    schedule_b: &Schedule,
    pairing: Pairing,
    tolerances: &Tolerances,
) -> Result<Paired> {
    let mut forced = ForcedSelections::default();
    let mut b = job.run_forced(flags_b, schedule_b, &Arc::new(forced.clone()), None)?;
    let mut ops = b.counts.executed;
    let mut flips = Vec::new();
    let mut reruns = 0;
    loop {
        let comparisons = numeric(a, &b, pairing, &job.model.layout, tolerances);
        let diffs = selection_diffs(job, a, &b, pairing, &comparisons, tolerances);
        let to_force = flips_to_force(&comparisons, &diffs);
        let done = |gave_up, b, flips, clear| Paired {
            comparisons,
            flips,
            clear,
            other: b,
            ops_executed: ops,
            reruns,
            gave_up,
        };
        if to_force.is_empty() || reruns == MAX_RERUNS {
            let gave_up = !to_force.is_empty();
            // A flip still standing is a difference the comparison could not explain away.
            let clear: Vec<SelectionDiff> = diffs
                .into_iter()
                .filter(|d| !d.within_noise() || gave_up)
                .collect();
            return Ok(done(gave_up, b, flips, clear));
        }
        let mut until = usize::MAX;
        for d in &to_force {
            forced.force(d.other_phase, &d.op, d.other_row, d.chosen_a.clone());
            if let Some(j) = b.find(d.other_phase, &d.op) {
                until = until.min(j);
            }
        }
        let replay = ReplayPrefix {
            record: &b,
            until: until.min(b.len()),
        };
        let rerun = job.run_forced(flags_b, schedule_b, &Arc::new(forced.clone()), Some(replay))?;
        ops += rerun.counts.executed;
        reruns += 1;
        flips.extend(to_force);
        b = rerun;
    }
}

/// The flips within noise to force next: those before the first real difference (an op over
/// its tolerance, a flip at a clear margin), since what follows one may be its consequence.
fn flips_to_force(comparisons: &[OpComparison], diffs: &[SelectionDiff]) -> Vec<SelectionDiff> {
    let first_numeric = comparisons
        .iter()
        .find(|c| c.diverges())
        .map_or(usize::MAX, |c| c.index);
    let first_clear = diffs
        .iter()
        .find(|d| !d.within_noise())
        .map_or(usize::MAX, |d| d.index);
    diffs
        .iter()
        .filter(|d| d.within_noise() && d.index < first_numeric && d.index <= first_clear)
        .cloned()
        .collect()
}

/// The examined run against a reference dump, selection-aware: where the dump's choices (its
/// listing, or its router logits) differ from the run's within noise, the run is made again
/// with the reference's choice forced, until no such flip is left before the first real
/// difference. `Paired::other` is the run as last made; its comparison with the dump is
/// returned beside.
pub fn compare_reference(
    job: &Job,
    a: &RunRecord,
    dump: &ExternalDump,
    tolerances: &Tolerances,
) -> Result<(Paired, ReferenceComparison)> {
    let heads = job.model.layout.num_heads;
    let schedule = Schedule {
        prompt: a
            .outcome
            .as_ref()
            .map(|o| o.tokens.clone())
            .unwrap_or_default(),
        prefill_len: job.schedule.prefill_len,
        decode_steps: 0,
    };
    let mut forced = ForcedSelections::default();
    let mut run = a.clone();
    let (mut ops, mut reruns) = (0, 0);
    let mut flips = Vec::new();
    loop {
        // Choices are compared as choices below; the numbers are the rest.
        let reference = dump.compare(&run, heads)?;
        let mut numeric: Vec<OpComparison> = reference
            .comparisons
            .iter()
            .filter(|c| !is_selection(&run.events[c.index]))
            .cloned()
            .collect();
        for c in numeric.iter_mut() {
            if let Some(aligned) = aligned_dump_router_weights(&run, c.index, dump) {
                let e = &run.events[c.index];
                *c = compare_outputs(
                    e,
                    c.index,
                    run.outputs[c.index].data(),
                    &e.shape,
                    &aligned,
                    heads,
                );
            }
        }
        tolerances.judge(&run, &mut numeric);
        let diffs = dump_selection_diffs(job, &run, dump, &numeric, tolerances);
        let to_force = flips_to_force(&numeric, &diffs);
        if to_force.is_empty() || reruns == MAX_RERUNS {
            let gave_up = !to_force.is_empty();
            let clear = diffs
                .into_iter()
                .filter(|d| !d.within_noise() || gave_up)
                .collect();
            let paired = Paired {
                comparisons: numeric,
                flips,
                clear,
                other: run,
                ops_executed: ops,
                reruns,
                gave_up,
            };
            return Ok((paired, reference));
        }
        let mut until = usize::MAX;
        for d in &to_force {
            forced.force(d.phase, &d.op, d.row, d.chosen_b.clone());
            until = until.min(d.index);
        }
        let replay = ReplayPrefix {
            record: &run,
            until: until.min(run.len()),
        };
        let rerun = job.run_forced(
            run.flags,
            &schedule,
            &Arc::new(forced.clone()),
            Some(replay),
        )?;
        ops += rerun.counts.executed;
        reruns += 1;
        flips.extend(to_force);
        run = rerun;
    }
}

/// Every row where the dump's choice differs from the run's. The dump's choice is its listing
/// of the op, or, for routing, the choice its router logits make (a dump of another engine
/// records the logits, not the experts).
fn dump_selection_diffs(
    job: &Job,
    a: &RunRecord,
    dump: &ExternalDump,
    comparisons: &[OpComparison],
    tolerances: &Tolerances,
) -> Vec<SelectionDiff> {
    let mut out = Vec::new();
    for (i, e) in a.events.iter().enumerate() {
        if !is_selection(e) {
            continue;
        }
        let Some(ours) = run_choices(a, i, job.model) else {
            continue;
        };
        let scores_name = scores_op(&e.name);
        let scores = scores_name
            .as_ref()
            .and_then(|n| dump.tensors.get(&(e.phase, n.clone())))
            .map(|(shape, data)| (shape.as_slice(), data.as_slice()));
        let theirs = match dump.tensors.get(&(e.phase, e.name.clone())) {
            Some((shape, listing)) => choices_of(e, (shape, listing), scores, job.model),
            None => {
                // Only the scores: the choice they make.
                let empty = vec![-1.0; ours.len()];
                choices_of(e, (&[1], &empty), scores, job.model).map(|rows| {
                    rows.into_iter()
                        .map(|mut r| {
                            if let Some(k) = &r.ranking {
                                r.chosen = k.choose();
                                r.listed = r.chosen.clone();
                            }
                            r
                        })
                        .filter(|r| r.ranking.is_some())
                        .collect()
                })
            }
        };
        let Some(theirs) = theirs.filter(|t| t.len() == ours.len()) else {
            continue;
        };
        let scores_tolerance = scores_name
            .and_then(|name| {
                comparisons
                    .iter()
                    .find(|c| c.phase == e.phase && c.name == name && !c.tolerance.is_nan())
            })
            .map_or(tolerances.row(scores_kind(e)).0, |c| c.tolerance);
        for (r, (mine, other_choice)) in ours.iter().zip(&theirs).enumerate() {
            let other = OtherRow {
                phase: e.phase,
                row: r,
            };
            if let Some(d) = diff_row(e, (i, r), mine, other, other_choice, scores_tolerance) {
                out.push(d);
            }
        }
    }
    out
}

/// For a routing-weights op: the dump's weights laid out in the run's expert order (see
/// [`aligned_router_weights`]); `None` when the dump lacks the weights or the experts.
fn aligned_dump_router_weights(a: &RunRecord, i: usize, dump: &ExternalDump) -> Option<Vec<f32>> {
    let e = &a.events[i];
    let ids_name = e.name.strip_suffix(".topk_weights")?.to_string() + ".topk_indices";
    let (_, ids) = dump.tensors.get(&(e.phase, ids_name.clone()))?;
    let (_, weights) = dump.tensors.get(&(e.phase, e.name.clone()))?;
    let ours = a.output_for(e, &ids_name)?;
    align_weights(ours.data(), ids, weights, *e.shape.last()?)
}

/// Numeric comparisons of A's ops with B's (choices are compared as choices, see
/// [`selection_diffs`]).
fn numeric(
    a: &RunRecord,
    b: &RunRecord,
    pairing: Pairing,
    layout: &crate::model::Layout,
    tolerances: &Tolerances,
) -> Vec<OpComparison> {
    let heads = layout.num_heads;
    match pairing {
        Pairing::SameSchedule => compare_runs(a, b, heads, tolerances),
        Pairing::DecodeRows => prefill_vs_decode(a, b, heads, tolerances),
        Pairing::Ranks { tp } => super::tp::compare_ranks(a, b, tp, layout, tolerances),
    }
}

/// Every row where B chose differently from A, in A's order. Each flip is held against the
/// noise of the scores it was made from: their comparison's judged tolerance (`comparisons`),
/// or their kind's floor where they were not compared.
pub fn selection_diffs(
    job: &Job,
    a: &RunRecord,
    b: &RunRecord,
    pairing: Pairing,
    comparisons: &[OpComparison],
    tolerances: &Tolerances,
) -> Vec<SelectionDiff> {
    let mut out = Vec::new();
    for (i, e) in a.events.iter().enumerate() {
        if !is_selection(e) {
            continue;
        }
        let other_phase = match (pairing, e.phase) {
            (Pairing::SameSchedule | Pairing::Ranks { .. }, p) => p,
            (Pairing::DecodeRows, Phase::Decode(_)) => Phase::Prefill,
            (Pairing::DecodeRows, Phase::Prefill) => continue,
        };
        // Every rank's choices against the one rank's (they are replicated).
        let other_rank = match pairing {
            Pairing::Ranks { .. } => None,
            _ => e.rank,
        };
        let Some(j) = b.find_at(other_phase, other_rank, &e.name) else {
            continue;
        };
        let (Some(ca), Some(cb)) = (run_choices(a, i, job.model), run_choices(b, j, job.model))
        else {
            continue;
        };
        let scores_tolerance = scores_op(&e.name)
            .and_then(|name| {
                comparisons
                    .iter()
                    .find(|c| c.phase == e.phase && c.name == name && !c.tolerance.is_nan())
            })
            .map_or(tolerances.row(scores_kind(e)).0, |c| c.tolerance);
        for (r, choice) in ca.iter().enumerate() {
            let other_row = match pairing {
                Pairing::SameSchedule | Pairing::Ranks { .. } => r,
                Pairing::DecodeRows => e.positions.0 + r,
            };
            let Some(theirs) = cb.get(other_row) else {
                continue;
            };
            let other = OtherRow {
                phase: other_phase,
                row: other_row,
            };
            if let Some(d) = diff_row(e, (i, r), choice, other, theirs, scores_tolerance) {
                out.push(d);
            }
        }
    }
    out
}
