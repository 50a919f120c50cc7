//! Discrete choices of a run: the experts MoE routing picks for a token and the keys the DSA
//! indexer keeps for a query. Two correct runs can choose differently when two candidates score
//! within rounding noise of each other (bf16 moves near-ties; exact ties are broken differently
//! by different engines), and everything after the choice then differs. So choices are compared
//! as choices, with their margins:
//!
//! * a [`Ranking`] is what a row's choice was made from: a score per candidate (higher wins; for
//!   routing the biased sigmoid score, for DSA the indexer score) and, for group-limited routing,
//!   the group stage before it;
//! * a row is **ambiguous** when the gap between its k-th and (k+1)-th candidate is within the
//!   dtype's noise (an exact tie included): [`ambiguous_selections`];
//! * two runs **flip** at a row when they chose different sets; the flip is noise when each run's
//!   own scores prefer its choice over the other's by no more than the noise
//!   ([`SelectionDiff::within_noise`]), else it is a real difference.

pub use super::ranking::{Boundary, GroupStage, Ranking};
use super::record::RunRecord;
use super::tolerance::Tolerances;
use crate::engine::trace::{OpEvent, OpKind, Phase};
use crate::model::Model;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// Whether the op's output is a choice (a listing of chosen candidates per row).
pub fn is_selection(e: &OpEvent) -> bool {
    e.kind == OpKind::IndexTopK || (e.kind == OpKind::Router && e.name.ends_with(".topk_indices"))
}

/// The kind of the op a selection's scores come from (indexer scores, router logits).
pub fn scores_kind(selection: &OpEvent) -> OpKind {
    if selection.kind == OpKind::IndexTopK {
        OpKind::IndexScores
    } else {
        OpKind::Linear
    }
}

/// The op whose output a selection op's choice was made from: the indexer's scores for the DSA
/// top-k, the router logits for MoE routing.
pub fn scores_op(selection: &str) -> Option<String> {
    if let Some(prefix) = selection.strip_suffix(".indexer.topk") {
        return Some(format!("{prefix}.indexer.scores"));
    }
    selection
        .strip_suffix(".gate.topk_indices")
        .map(|prefix| format!("{prefix}.gate"))
}

/// One row of a selection op: what was chosen and, when the scores are known, from what.
#[derive(Debug, Clone, PartialEq)]
pub struct RowChoice {
    /// Sorted by index.
    pub chosen: Vec<usize>,
    /// In the order the op lists them (routing: by score, which orders its weights too).
    pub listed: Vec<usize>,
    pub ranking: Option<Ranking>,
}

/// Reads the choices of selection op `index` of `run`, with their rankings (the scores op of
/// the same phase must be in the run).
pub fn run_choices(run: &RunRecord, index: usize, model: &Model) -> Option<Vec<RowChoice>> {
    let e = &run.events[index];
    let listing = run.outputs[index].data();
    let scores = scores_op(&e.name).and_then(|n| run.output_for(e, &n));
    choices_of(
        e,
        (&e.shape, listing),
        scores.map(|t| (t.shape(), t.data())),
        model,
    )
}

/// Choices of selection op `e` from a listing of shape `[rows, k]` (one row per token; −1 pads;
/// another engine's DSA listing may name masked future keys, which are left out) and the scores
/// they were made from (`[rows, candidates]`).
pub fn choices_of(
    e: &OpEvent,
    (shape, listing): (&[usize], &[f32]),
    scores: Option<(&[usize], &[f32])>,
    model: &Model,
) -> Option<Vec<RowChoice>> {
    Some(
        listed_rows(e, (shape, listing))?
            .into_iter()
            .enumerate()
            .map(|(r, listed)| {
                let mut chosen = listed.clone();
                chosen.sort_unstable();
                let ranking = scores.and_then(|(shape, data)| ranking_of(e, r, shape, data, model));
                RowChoice {
                    chosen,
                    listed,
                    ranking,
                }
            })
            .collect(),
    )
}

/// Each row of a selection op's listing `[rows, k]` as it lists it, without padding (−1) and,
/// for the DSA top-k, without keys after the row's own token (see [`choices_of`]).
fn listed_rows(e: &OpEvent, (shape, listing): (&[usize], &[f32])) -> Option<Vec<Vec<usize>>> {
    let cols = *shape.last()?;
    if cols == 0 || listing.len() % cols != 0 {
        return None;
    }
    let rows = listing.len() / cols;
    Some(
        (0..rows)
            .map(|r| {
                let causal =
                    |v: &f32| e.kind != OpKind::IndexTopK || *v <= (e.positions.0 + r) as f32;
                listing[r * cols..(r + 1) * cols]
                    .iter()
                    .filter(|v| **v >= 0.0 && causal(v))
                    .map(|&v| v as usize)
                    .collect()
            })
            .collect(),
    )
}

/// The first selection op of `a` (in its order) whose choice differs from the op of the same
/// phase, rank and name in `b` (as sets: the order a listing gives is not a choice), with the
/// number of its rows that differ. What a plain comparison of two runs must say beside its
/// first divergent op: a later difference may follow from the choice rather than a fault (a
/// flip within the scores' noise is not one; `check` weighs it and forces it).
pub fn first_choice_difference(a: &RunRecord, b: &RunRecord) -> Option<(usize, usize)> {
    a.events.iter().enumerate().find_map(|(i, e)| {
        if !is_selection(e) {
            return None;
        }
        let j = b.find_for(e, &e.name)?;
        let rows = |run: &RunRecord, k: usize| {
            // A replay's sample of a listing is no listing.
            let (e, out) = (&run.events[k], &run.outputs[k]);
            if out.shape() != e.shape.as_slice() {
                return None;
            }
            let mut rows = listed_rows(e, (&e.shape, out.data()))?;
            rows.iter_mut().for_each(|r| r.sort_unstable());
            Some(rows)
        };
        let (ours, theirs) = (rows(a, i)?, rows(b, j)?);
        let differ = ours.len().abs_diff(theirs.len())
            + ours.iter().zip(&theirs).filter(|(x, y)| x != y).count();
        (differ > 0).then_some((i, differ))
    })
}

/// The ranking of row `r` of selection op `e` from its scores op's output.
fn ranking_of(
    e: &OpEvent,
    r: usize,
    shape: &[usize],
    data: &[f32],
    model: &Model,
) -> Option<Ranking> {
    let cols = *shape.last()?;
    let row = data.get(r * cols..(r + 1) * cols)?;
    let layout = &model.layout;
    match e.kind {
        OpKind::IndexTopK => {
            let pos = e.positions.0 + r;
            let ix = layout.indexer.as_ref()?;
            Some(Ranking::keys(row.get(..=pos)?, ix.topk))
        }
        _ => {
            let moe = layout.moe.as_ref()?;
            let layer = e.layer?;
            let bias = model
                .weights
                .get(&format!(
                    "{}.mlp.gate.e_score_correction_bias",
                    crate::model::catalog::layer_prefix(layer)
                ))
                .ok()?;
            (row.len() == moe.n_routed_experts && bias.numel() == row.len())
                .then(|| Ranking::routing(row, bias.data(), moe))
        }
    }
}

/// Routing weights listed in another run's order of experts (`ids`, `k` per row) laid out in
/// the order of `ours`, 0 for an expert the other run did not choose: each run lists its
/// experts by its own choice scores, so two runs that chose the same experts in another order
/// compare equal. `None` when the lengths do not line up.
pub fn align_weights(ours: &[f32], ids: &[f32], weights: &[f32], k: usize) -> Option<Vec<f32>> {
    if k == 0
        || ours.len() != ids.len()
        || ids.len() != weights.len()
        || !ours.len().is_multiple_of(k)
    {
        return None;
    }
    Some(
        ours.chunks(k)
            .zip(ids.chunks(k).zip(weights.chunks(k)))
            .flat_map(|(mine, (theirs, w))| {
                mine.iter()
                    .map(|x| theirs.iter().position(|y| y == x).map_or(0.0, |s| w[s]))
                    .collect::<Vec<f32>>()
            })
            .collect(),
    )
}

/// The experts op a routing-weights op goes with.
pub fn weights_ids_op(name: &str) -> Option<String> {
    name.strip_suffix(".topk_weights")
        .map(|p| format!("{p}.topk_indices"))
}

/// A row where two runs chose differently.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SelectionDiff {
    pub phase: Phase,
    pub op: String,
    /// Index of the op in the examined run (A).
    pub index: usize,
    /// Row of A's op (its token within the phase) and the token's position.
    pub row: usize,
    pub position: usize,
    /// Where the other run (B) made the choice: its phase, op name and row.
    pub other_phase: Phase,
    pub other_row: usize,
    pub only_a: Vec<usize>,
    pub only_b: Vec<usize>,
    /// A's whole choice as A lists it (B is forced to it when the flip is noise).
    pub chosen_a: Vec<usize>,
    /// B's whole choice as B lists it (A is forced to it when B is a reference).
    pub chosen_b: Vec<usize>,
    /// The change of each run's own scores that makes it choose as the other did (see
    /// [`Ranking::change_to_choose`]); `None` where a side's scores are unknown.
    pub gap_a: Option<f32>,
    pub gap_b: Option<f32>,
    /// How far the noise of each side's scores may move a score.
    pub noise_a: f32,
    pub noise_b: f32,
}

impl SelectionDiff {
    /// The flip is explained by noise: each run's scores could have chosen as the other did
    /// with a change within their noise (a side without scores is judged by the other side).
    pub fn within_noise(&self) -> bool {
        let ok = |gap: Option<f32>, noise: f32| gap.map(|g| g <= noise);
        match (ok(self.gap_a, self.noise_a), ok(self.gap_b, self.noise_b)) {
            (Some(a), Some(b)) => a && b,
            (Some(x), None) | (None, Some(x)) => x,
            (None, None) => false,
        }
    }

    /// `row 9 (position 9): A chose {3, 7}, B {4, 5}; margins A 1.2e-3, B 4.0e-4 (noise 8e-3)`.
    pub fn describe(&self) -> String {
        let gap = |g: Option<f32>| g.map_or("unknown".to_string(), |g| format!("{g:.3e}"));
        format!(
            "row {} (position {}): A chose {:?} where B chose {:?}; score change to swap A {} (noise {:.1e}), B {} (noise {:.1e})",
            self.row,
            self.position,
            self.only_a,
            self.only_b,
            gap(self.gap_a),
            self.noise_a,
            gap(self.gap_b),
            self.noise_b
        )
    }
}

/// How far the noise of a row's scores may move one score: its op's relative tolerance times
/// the row's largest score.
pub fn noise_of(ranking: &Ranking, scores_tolerance: f64) -> f32 {
    scores_tolerance as f32 * ranking.scale()
}

/// Where B's choice of a row was made, for [`diff_row`].
pub struct OtherRow {
    pub phase: Phase,
    pub row: usize,
}

/// Compares one row's choices: `None` when they agree. `scores_tolerance` is the relative
/// tolerance of the scores the choices were made from (their comparison's judged tolerance).
pub fn diff_row(
    e: &OpEvent,
    (index, row): (usize, usize),
    a: &RowChoice,
    other: OtherRow,
    b: &RowChoice,
    scores_tolerance: f64,
) -> Option<SelectionDiff> {
    if a.chosen == b.chosen {
        return None;
    }
    let set = |v: &[usize]| v.iter().copied().collect::<BTreeSet<usize>>();
    let (sa, sb) = (set(&a.chosen), set(&b.chosen));
    let noise = |r: &Option<Ranking>| r.as_ref().map_or(0.0, |r| noise_of(r, scores_tolerance));
    Some(SelectionDiff {
        phase: e.phase,
        op: e.name.clone(),
        index,
        row,
        position: e.positions.0 + row,
        other_phase: other.phase,
        other_row: other.row,
        only_a: sa.difference(&sb).copied().collect(),
        only_b: sb.difference(&sa).copied().collect(),
        chosen_a: a.listed.clone(),
        chosen_b: b.listed.clone(),
        gap_a: a.ranking.as_ref().map(|r| gap_from(r, a, b)),
        gap_b: b.ranking.as_ref().map(|r| gap_from(r, b, a)),
        noise_a: noise(&a.ranking),
        noise_b: noise(&b.ranking),
    })
}

/// The change of `mine`'s scores (`ranking`) that makes them choose as `theirs` did, and at
/// least the change that makes them choose as `mine` itself listed: a listing its own scores
/// do not choose (a top-k that wrote other keys) is no near tie, however close the other
/// side's choice is to what the scores would choose.
fn gap_from(ranking: &Ranking, mine: &RowChoice, theirs: &RowChoice) -> f32 {
    ranking
        .change_to_choose(&theirs.chosen)
        .max(ranking.change_to_choose(&mine.chosen))
}

/// A selection op whose boundary is an exact or near tie in some rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AmbiguousSelection {
    pub phase: Phase,
    pub op: String,
    pub index: usize,
    pub rows: Vec<AmbiguousRow>,
    pub noise: f32,
}

/// One row whose top-k boundary is within noise.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AmbiguousRow {
    pub row: usize,
    pub position: usize,
    pub margin: f32,
    /// Chosen candidates near the boundary, and candidates left out near it.
    pub kept_near: Vec<usize>,
    pub dropped_near: Vec<usize>,
}

impl AmbiguousSelection {
    /// Whether `position` is one of the ambiguous rows.
    pub fn covers(&self, position: usize) -> bool {
        self.rows.iter().any(|r| r.position == position)
    }

    pub fn describe(&self) -> String {
        let exact = self.rows.iter().filter(|r| r.margin == 0.0).count();
        let shown: Vec<String> = self
            .rows
            .iter()
            .take(3)
            .map(|r| {
                format!(
                    "row {} (position {}): margin {:.2e}, kept {:?} vs left out {:?}",
                    r.row, r.position, r.margin, r.kept_near, r.dropped_near
                )
            })
            .collect();
        format!(
            "{} row(s) with the top-k boundary within noise {:.1e} ({exact} exact ties): {}{}",
            self.rows.len(),
            self.noise,
            shown.join("; "),
            if self.rows.len() > 3 { "; …" } else { "" }
        )
    }
}

/// Every selection op of `run` with rows whose boundary is within the noise of its scores (the
/// floor of their op kind: what two correct runs may differ by at the least).
pub fn ambiguous_selections(
    run: &RunRecord,
    model: &Model,
    tolerances: &Tolerances,
) -> Vec<AmbiguousSelection> {
    let mut out = Vec::new();
    for (i, e) in run.events.iter().enumerate() {
        if !is_selection(e) {
            continue;
        }
        let Some(rows) = run_choices(run, i, model) else {
            continue;
        };
        let mut tied = Vec::new();
        let mut worst_noise = 0f32;
        for (r, choice) in rows.iter().enumerate() {
            let Some(ranking) = choice.ranking.as_ref().filter(|r| r.decides()) else {
                continue;
            };
            let noise = noise_of(ranking, tolerances.row(scores_kind(e)).0);
            // Two candidates each moved by the noise close a gap of twice it.
            let b = ranking.boundary(&choice.chosen, 2.0 * noise);
            if b.margin <= 2.0 * noise {
                worst_noise = worst_noise.max(noise);
                tied.push(AmbiguousRow {
                    row: r,
                    position: e.positions.0 + r,
                    margin: b.margin,
                    kept_near: b.kept_near,
                    dropped_near: b.dropped_near,
                });
            }
        }
        if !tied.is_empty() {
            out.push(AmbiguousSelection {
                phase: e.phase,
                op: e.name.clone(),
                index: i,
                rows: tied,
                noise: worst_noise,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flips_within_noise_and_beyond() {
        let e = OpEvent {
            index: 0,
            phase: Phase::Prefill,
            layer: Some(1),
            rank: None,
            name: "model.layers.1.self_attn.indexer.topk".into(),
            kind: OpKind::IndexTopK,
            shape: vec![1, 2],
            dtype: crate::tensor::DType::I32,
            stats: crate::stats::TensorStats::of(&[]),
            output: crate::engine::trace::BufferRef::cache(crate::tensor::BufferId(0), 0, 0),
            kernel_wrote: None,
            inputs: vec![],
            positions: (4, 5),
            replayed: false,
            kernel: None,
        };
        let choice = |chosen: Vec<usize>, scores: &[f32]| RowChoice {
            listed: chosen.clone(),
            chosen,
            ranking: Some(Ranking::keys(scores, 2)),
        };
        let a = choice(vec![0, 1], &[1.0, 0.5001, 0.1, 0.5, 0.0]);
        let b = choice(vec![0, 3], &[1.0, 0.5, 0.1, 0.5002, 0.0]);
        let other = || OtherRow {
            phase: Phase::Prefill,
            row: 4,
        };
        let d = diff_row(&e, (0, 0), &a, other(), &b, 1e-2).unwrap();
        assert_eq!((d.only_a.clone(), d.only_b.clone()), (vec![1], vec![3]));
        assert!(d.within_noise(), "{}", d.describe());
        let far = choice(vec![0, 4], &[1.0, 0.5, 0.1, 0.5, 0.0]);
        let d = diff_row(&e, (0, 0), &a, other(), &far, 1e-2).unwrap();
        assert!(
            !d.within_noise(),
            "B's own scores prefer A's keys: {}",
            d.describe()
        );
        assert!(diff_row(&e, (0, 0), &a, other(), &a, 1e-2).is_none());
        // A listed keys its own scores do not choose (its top-k wrote key 4 for key 1), and B,
        // a dump without scores (HF's indexer listing alone), chose what A's scores choose:
        // the flip is not noise, though A's scores are one tie-break from B's choice.
        let wrong = RowChoice {
            listed: vec![0, 4],
            chosen: vec![0, 4],
            ranking: Some(Ranking::keys(&[1.0, 0.5001, 0.1, 0.5, 0.0], 2)),
        };
        let b = RowChoice {
            ranking: None,
            ..choice(vec![0, 1], &[])
        };
        let d = diff_row(&e, (0, 0), &wrong, other(), &b, 1e-2).unwrap();
        assert!(!d.within_noise(), "{}", d.describe());
        assert!(d.gap_a.unwrap() > 0.2, "{}", d.describe());
    }
}
