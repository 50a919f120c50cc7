//! Comparing op outputs: relative L2 error, max abs error with its position, cosine similarity,
//! and per-head figures for attention ops. Three pairings of runs are built on it: run A vs run
//! B (ops matched by phase and name, which also covers absorbed vs naive), prefill vs decode (a
//! decoded token's outputs vs the same row of a whole-sequence prefill), and a run vs an external
//! dump.

use super::diff::sampled_diff;
pub use super::diff::{diff, heads_of, Diff, Heads, NonFinite};
use super::record::RunRecord;
use super::sample::{holds_all, is_sampled, numel, NEEDS_TENSORS};
use super::selection::{align_weights, is_selection, weights_ids_op};
use super::tolerance::Tolerances;
use crate::engine::trace::{OpEvent, OpKind, Phase};
use serde::{Deserialize, Serialize};

/// One op compared across two runs (or a run and a reference).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpComparison {
    pub phase: Phase,
    pub name: String,
    /// The op's kind, which picks its tolerance.
    pub kind: OpKind,
    /// The largest error of what the op read, in the same comparison, and the tolerance that
    /// gives it (see [`Tolerances::judge`]); NaN until judged, which no error passes.
    pub input_error: f64,
    pub tolerance: f64,
    /// How far the op's own values may amplify its inputs' relative error beyond what its kind's
    /// gain allows (the indexer's scores, a projection's small output: `super::conditioning`); 1
    /// for other ops. The gain applies to `input_error × conditioning`.
    #[serde(default = "unconditioned")]
    pub conditioning: f64,
    /// Index of the op in the run being examined.
    pub index: usize,
    /// The figures, or why there are none.
    pub diff: Result<Diff, String>,
}

fn unconditioned() -> f64 {
    1.0
}

impl OpComparison {
    pub fn exceeds(&self, tolerance: f64) -> bool {
        matches!(&self.diff, Ok(d) if d.exceeds(tolerance) && !self.zero_within(d, tolerance))
    }

    /// A reference of zeros (relative error +∞) where the op's own values lie within their
    /// noise: its conditioning says rounding may move them by `tolerance` times their own size,
    /// and that is at least their size. The indexer's scores, when the other run's ReLU zeroed
    /// scores this run keeps small beside their terms.
    fn zero_within(&self, d: &Diff, tolerance: f64) -> bool {
        self.conditioning > 1.0
            && d.rel_l2 == f64::INFINITY
            && !d.has_non_finite()
            && tolerance >= 1.0
    }

    /// Over its judged tolerance.
    pub fn exceeds_its(&self) -> bool {
        self.exceeds(self.judged_tolerance())
    }

    /// A real difference between the two: over its tolerance, and not only through NaN / ±Inf
    /// alike on both sides. What every verdict of "these differ" asks.
    pub fn diverges(&self) -> bool {
        self.exceeds_its() && !self.fails_only_alike()
    }

    /// Over its tolerance only through NaN / ±Inf alike on both sides ([`Diff::fails_only_alike`]):
    /// the pair agrees wherever it can be compared, so the difference is not the comparison's to
    /// report (the NaN/Inf detector reports those values in the run examined).
    pub fn fails_only_alike(&self) -> bool {
        matches!(&self.diff, Ok(d) if d.fails_only_alike(self.judged_tolerance()))
    }

    /// The tolerance it is held to: an unjudged comparison passes nothing but exact agreement.
    fn judged_tolerance(&self) -> f64 {
        if self.tolerance.is_nan() {
            0.0
        } else {
            self.tolerance
        }
    }

    /// `tolerance 2.1e-2, for an input error of 5.0e-4` (`× 47.6 by its conditioning`).
    pub fn tolerance_text(&self) -> String {
        if self.input_error > 0.0 && self.conditioning > 1.0 {
            format!(
                "tolerance {:.1e}, for an input error of {:.1e} × {:.1} by its conditioning",
                self.tolerance, self.input_error, self.conditioning
            )
        } else if self.input_error > 0.0 {
            format!(
                "tolerance {:.1e}, for an input error of {:.1e}",
                self.tolerance, self.input_error
            )
        } else {
            format!("tolerance {:.1e}", self.tolerance)
        }
    }
}

/// Compares every op of `a` with the op of the same phase and name in `b` (the reference), in
/// `a`'s execution order, each judged against its tolerance. Ops `b` lacks are left out, and so
/// are choices (top-k listings), which are compared as choices (`super::paired`).
pub fn compare_runs(
    a: &RunRecord,
    b: &RunRecord,
    num_heads: usize,
    tolerances: &Tolerances,
) -> Vec<OpComparison> {
    let mut all: Vec<OpComparison> = a
        .events
        .iter()
        .enumerate()
        .filter(|(_, e)| !is_selection(e))
        .filter_map(|(i, e)| {
            let j = b.find_for(e, &e.name)?;
            let theirs = b.outputs[j].data();
            let aligned = aligned_router_weights(a, i, b, j);
            Some(compare_outputs(
                e,
                i,
                a.outputs[i].data(),
                &b.events[j].shape,
                aligned.as_deref().unwrap_or(theirs),
                rank_heads(a, e, num_heads),
            ))
        })
        .collect();
    tolerances.judge(a, &mut all);
    all
}

/// The attention heads in the output of `e`, an op of `run` of a model of `num_heads`: a
/// tensor-parallel rank holds its share.
pub fn rank_heads(run: &RunRecord, e: &OpEvent, num_heads: usize) -> usize {
    match e.rank {
        Some(_) => num_heads / run.flags.tp.max(1),
        None => num_heads,
    }
}

/// For a routing-weights op `i` of `a` paired with op `j` of `b`: B's weights laid out in A's
/// order of experts (whole outputs only: samples of the experts and the weights are not the
/// same rows); `None` for any other op.
pub fn aligned_router_weights(
    a: &RunRecord,
    i: usize,
    b: &RunRecord,
    j: usize,
) -> Option<Vec<f32>> {
    let (e, other_e) = (&a.events[i], &b.events[j]);
    let ids = weights_ids_op(&e.name)?;
    let (ours, other) = (a.output_for(e, &ids)?, b.output_for(other_e, &ids)?);
    let whole = |t: &crate::tensor::Tensor, shape: &[usize]| holds_all(shape, t.numel());
    let ids_shape = &a.events[a.find_for(e, &ids)?].shape;
    (whole(ours, ids_shape) && whole(other, ids_shape) && whole(&b.outputs[j], &e.shape))
        .then_some(())?;
    let theirs = b.outputs[j].data();
    align_weights(ours.data(), other.data(), theirs, *e.shape.last()?)
}

/// Compares one output with a reference of the given shape (same element count suffices).
/// Either may be a sample (a replay without full tensors): two samples of outputs of one size
/// hold the same elements and are compared value for value (no per-head figures; the position
/// of the largest difference is the element's); a sample cannot be compared with a whole output.
pub fn compare_outputs(
    e: &OpEvent,
    index: usize,
    a: &[f32],
    ref_shape: &[usize],
    b: &[f32],
    num_heads: usize,
) -> OpComparison {
    let same_size =
        numel(&e.shape).is_some_and(|n| Some(n) == numel(ref_shape)) && a.len() == b.len();
    let diff = match (holds_all(&e.shape, a.len()), holds_all(ref_shape, b.len())) {
        (true, true) if a.len() == b.len() => Ok(diff(a, b, &e.shape, heads_of(e, num_heads))),
        (false, false) if same_size => Ok(sampled_diff(a, b, &e.shape)),
        (true, false) | (false, true) => Err(NEEDS_TENSORS.to_string()),
        _ => Err(format!(
            "shapes differ: {:?} vs reference {:?}",
            e.shape, ref_shape
        )),
    };
    OpComparison {
        phase: e.phase,
        name: e.name.clone(),
        kind: e.kind,
        input_error: 0.0,
        tolerance: f64::NAN,
        conditioning: 1.0,
        index,
        diff,
    }
}

/// Compares every decode-step op of `stepped` with the row of the same token in `whole`, a run
/// that prefilled the whole sequence at once, each judged against its tolerance. Choices (top-k
/// listings) are left out: they are compared as choices (`super::paired`).
pub fn prefill_vs_decode(
    stepped: &RunRecord,
    whole: &RunRecord,
    num_heads: usize,
    tolerances: &Tolerances,
) -> Vec<OpComparison> {
    let mut out = Vec::new();
    for (i, e) in stepped.events.iter().enumerate() {
        if !matches!(e.phase, Phase::Decode(_)) || is_selection(e) {
            continue;
        }
        let Some(j) = whole.find_at(Phase::Prefill, e.rank, &e.name) else {
            continue;
        };
        let (w, we) = (&whole.outputs[j], &whole.events[j]);
        let pos = e.positions.0;
        let failed = |why: String| OpComparison {
            phase: e.phase,
            name: e.name.clone(),
            kind: e.kind,
            input_error: 0.0,
            tolerance: f64::NAN,
            conditioning: 1.0,
            index: i,
            diff: Err(why),
        };
        // A padded batch's rows belong to no token.
        if e.kind == OpKind::AttentionPadding {
            out.push(failed(
                "a padded batch's rows belong to no token".to_string(),
            ));
            continue;
        }
        // A token's row cannot be cut from a sample of the prefill's output.
        if is_sampled(e, &stepped.outputs[i]) || is_sampled(we, w) {
            out.push(failed(NEEDS_TENSORS.to_string()));
            continue;
        }
        // Routing weights: the prefill row's in this step's order of experts.
        let in_order = |row: Vec<f32>| {
            let ids = weights_ids_op(&e.name)?;
            let (ours, k) = (stepped.output_for(e, &ids)?, *e.shape.last()?);
            let (wi, theirs) = (
                whole.find_at(Phase::Prefill, e.rank, &ids)?,
                whole.output(Phase::Prefill, &ids)?,
            );
            let their_row = token_row(
                &stepped.events[stepped.find_for(e, &ids)?],
                &whole.events[wi],
                theirs.data(),
                pos,
            )?;
            align_weights(ours.data(), &their_row, &row, k)
        };
        let row = match e.kind {
            OpKind::Expert => expert_token_row(whole, e, we, w.data(), pos),
            _ => token_row(e, we, w.data(), pos),
        };
        out.push(match row {
            Some(row) => {
                let row = in_order(row.clone()).unwrap_or(row);
                compare_outputs(
                    e,
                    i,
                    stepped.outputs[i].data(),
                    &e.shape,
                    &row,
                    rank_heads(stepped, e, num_heads),
                )
            }
            None => failed(format!("no row {pos} in the prefill's {:?}", we.shape)),
        });
    }
    tolerances.judge(stepped, &mut out);
    out
}

/// The part of a whole-prefill output `w` that belongs to the token at `pos`, shaped like the
/// decode step's output `e`; `None` when `w` does not hold the whole output `we` describes.
fn token_row(e: &OpEvent, we: &OpEvent, w: &[f32], pos: usize) -> Option<Vec<f32>> {
    if !holds_all(&we.shape, w.len()) {
        return None;
    }
    match e.kind {
        // [heads, 1, context] from [heads, T, T]: row pos, the first `context` keys.
        OpKind::AttentionProbs => {
            let (&[heads, 1, ctx], &[wh, wt, wc]) = (&e.shape[..], &we.shape[..]) else {
                return None;
            };
            if heads != wh || pos >= wt || ctx > wc {
                return None;
            }
            Some(
                (0..heads)
                    .flat_map(|h| w[(h * wt + pos) * wc..][..ctx].to_vec())
                    .collect(),
            )
        }
        // [1, context] from [T, T].
        OpKind::IndexScores => {
            let (&[1, ctx], &[wt, wc]) = (&e.shape[..], &we.shape[..]) else {
                return None;
            };
            (pos < wt && ctx <= wc).then(|| w[pos * wc..][..ctx].to_vec())
        }
        _ => {
            let per_token: usize = e.shape.iter().skip(1).product();
            let rows = we.shape.first().copied()?;
            (e.shape.first() == Some(&1) && per_token * rows == w.len() && pos < rows)
                .then(|| w[pos * per_token..(pos + 1) * per_token].to_vec())
        }
    }
}

/// An expert's op (`….mlp.experts.E`) holds a row per token routed to it, in token order: the
/// row of the token at `pos` in `whole`'s prefill output `w` of it, found through that
/// prefill's router choice; `None` when the prefill did not route that token to the expert.
fn expert_token_row(
    whole: &RunRecord,
    e: &OpEvent,
    we: &OpEvent,
    w: &[f32],
    pos: usize,
) -> Option<Vec<f32>> {
    let (mlp, expert) = e.name.rsplit_once(".experts.")?;
    let expert: f32 = expert.parse::<u32>().ok()? as f32;
    let ids_name = format!("{mlp}.gate.topk_indices");
    let i = whole.find_at(we.phase, we.rank, &ids_name)?;
    let (ids, ids_shape) = (whole.outputs[i].data(), &whole.events[i].shape);
    let (&[tokens, k], Some(&cols)) = (&ids_shape[..], we.shape.get(1)) else {
        return None;
    };
    let token = pos.checked_sub(we.positions.0)?;
    let routed = |t: usize| ids[t * k..(t + 1) * k].contains(&expert);
    let fits = holds_all(ids_shape, ids.len()) && holds_all(&we.shape, w.len());
    if !fits || token >= tokens || !routed(token) {
        return None;
    }
    let row = (0..token).filter(|&t| routed(t)).count();
    w.get(row * cols..(row + 1) * cols).map(<[f32]>::to_vec)
}

/// The first comparison that diverges ([`OpComparison::diverges`]), in execution order.
pub fn first_divergence(comparisons: &[OpComparison]) -> Option<&OpComparison> {
    comparisons.iter().find(|c| c.diverges())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_and_positions() {
        let b = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut a = b;
        a[4] += 0.5;
        let d = diff(&a, &b, &[2, 3], Some(Heads::Packed(3)));
        assert!((d.rel_l2 - 0.5 / 91f64.sqrt()).abs() < 1e-12);
        assert_eq!(d.max_abs, 0.5);
        assert_eq!(d.max_abs_at, vec![1, 1]);
        assert!(d.cosine < 1.0 && d.cosine > 0.99);
        assert_eq!(d.per_head.len(), 3);
        assert_eq!(d.per_head[0], 0.0);
        assert!(d.per_head[1] > 0.0);
        assert_eq!(d.worst_head().unwrap().0, 1);
        a[0] = f32::NAN;
        assert!(diff(&a, &b, &[6], None).exceeds(1.0), "NaN never passes");
        assert!(!diff(&b, &b, &[6], None).exceeds(0.0));
        let masked = [f32::NEG_INFINITY, 1.0];
        assert_eq!(
            diff(&masked, &masked, &[2], None).rel_l2,
            0.0,
            "equal −∞ agree"
        );
        assert!(diff(&[0.0, 1.0], &masked, &[2], None).exceeds(1.0));
    }
    /// A pair holding the same NaN / ±Inf fails its tolerance (nothing vouches for those
    /// elements) but only through values alike on both sides, which the findings leave to the
    /// NaN/Inf detector; a one-sided or unlike value, or a finite part beyond the tolerance, is
    /// a difference.
    #[test]
    fn values_non_finite_alike_on_both_sides_are_told_apart() {
        let judged = |a: &[f32], b: &[f32]| OpComparison {
            phase: Phase::Prefill,
            name: "op".into(),
            kind: OpKind::Linear,
            input_error: 0.0,
            tolerance: 1e-3,
            conditioning: 1.0,
            index: 0,
            diff: Ok(diff(a, b, &[a.len()], None)),
        };
        let nan = f32::NAN;
        let alike = judged(&[nan, 1.0, f32::INFINITY], &[nan, 1.0, f32::INFINITY]);
        assert!(alike.exceeds_its() && alike.fails_only_alike());
        let all = judged(&[nan, nan], &[nan, nan]);
        assert!(all.exceeds_its() && all.fails_only_alike());
        for (a, b) in [
            ([nan, 1.0, 2.0], [1.0, 1.0, 2.0]),
            ([nan, 1.0, 2.0], [f32::INFINITY, 1.0, 2.0]),
            ([f32::INFINITY, 1.0, 2.0], [f32::NEG_INFINITY, 1.0, 2.0]),
            ([nan, 1.0, 2.0], [nan, 1.0, 2.5]),
        ] {
            let c = judged(&a, &b);
            assert!(c.exceeds_its() && !c.fails_only_alike(), "{a:?} vs {b:?}");
        }
    }

    /// A reference of zeros is +∞ apart, relative: a difference, unless the op's conditioning
    /// puts its own values within its noise (a tolerance of at least 1 once conditioned).
    #[test]
    fn a_zero_reference_passes_only_where_the_values_are_within_their_noise() {
        let judged = |conditioning: f64, tolerance: f64| OpComparison {
            phase: Phase::Prefill,
            name: "op".into(),
            kind: OpKind::IndexScores,
            input_error: 1e-2,
            tolerance,
            conditioning,
            index: 0,
            diff: Ok(diff(&[0.01, 0.02], &[0.0, 0.0], &[2], None)),
        };
        assert!(!judged(100.0, 16.0).diverges());
        assert!(
            judged(100.0, 0.5).diverges(),
            "noise below the values' size"
        );
        assert!(judged(1.0, 16.0).diverges(), "unconditioned");
        let nan = OpComparison {
            diff: Ok(diff(&[f32::NAN, 0.02], &[0.0, 0.0], &[2], None)),
            ..judged(100.0, 16.0)
        };
        assert!(nan.diverges());
    }

    /// NaN and ±Inf are counted per side and reported first; figures are over the elements
    /// finite on both sides, and none are given when there are none.
    #[test]
    fn non_finite_values_are_counted_and_never_pass() {
        let b = [1.0, 2.0, 3.0, 4.0];
        let nan_here = [f32::NAN, 2.0, 3.0, 4.0];
        let d = diff(&nan_here, &b, &[4], None);
        assert!(d.exceeds(1.0), "NaN on one side never passes");
        let s = d.summary();
        assert!(s.starts_with("non-finite values: NaN 1 vs 0"), "{s}");
        assert!(s.contains("first at [0]"), "{s}");
        assert!(
            s.contains("over the 3 elements finite on both sides"),
            "{s}"
        );

        let d = diff(&nan_here, &nan_here, &[4], None);
        assert!(d.exceeds(1.0), "NaN on both sides never passes");
        assert!(
            d.summary().starts_with("non-finite values: NaN 1 vs 1"),
            "{}",
            d.summary()
        );

        let inf_here = [1.0, f32::INFINITY, 3.0, 4.0];
        let d = diff(&inf_here, &b, &[4], None);
        assert!(d.exceeds(1.0), "+Inf vs finite never passes");
        let s = d.summary();
        assert!(s.starts_with("non-finite values: +Inf 1 vs 0"), "{s}");
        assert!(s.contains("first at [1]"), "{s}");

        let all_nan = [f32::NAN; 4];
        let d = diff(&all_nan, &b, &[2, 2], None);
        assert!(d.exceeds(1.0));
        let s = d.summary();
        assert!(s.contains("NaN 4 vs 0"), "{s}");
        assert!(s.contains("no element is finite on both sides"), "{s}");
        assert!(!s.contains("cosine") && !s.contains("max |Δ|"), "{s}");

        // Masked scores: −∞ on both sides agree and are not counted as non-finite.
        let masked = [f32::NEG_INFINITY, 1.0, f32::NEG_INFINITY, 2.0];
        let d = diff(&masked, &masked, &[4], None);
        assert!(!d.exceeds(0.0), "{}", d.summary());
        assert!(!d.summary().contains("non-finite"), "{}", d.summary());
        let unmasked = [0.0, 1.0, f32::NEG_INFINITY, 2.0];
        let d = diff(&unmasked, &masked, &[4], None);
        assert!(d.exceeds(1.0));
        assert!(
            d.summary().starts_with("non-finite values: -Inf 0 vs 1"),
            "{}",
            d.summary()
        );
    }
}
