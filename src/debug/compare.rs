//! Comparing op outputs: relative L2 error, max abs error with its position, cosine similarity,
//! and per-head figures for attention ops. Three pairings of runs are built on it: run A vs run
//! B (ops matched by phase and name, which also covers absorbed vs naive), prefill vs decode (a
//! decoded token's outputs vs the same row of a whole-sequence prefill), and a run vs an external
//! dump.

use super::record::RunRecord;
use super::sample::{holds_all, is_sampled, numel, sample_indices, NEEDS_TENSORS};
use crate::engine::trace::{OpEvent, OpKind, Phase};
use serde::{Deserialize, Serialize};

/// How one op's output differs from a reference.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Diff {
    /// ‖a − ref‖ / ‖ref‖; NaN when either side holds NaN.
    pub rel_l2: f64,
    pub max_abs: f64,
    /// Multi-index of the largest absolute difference.
    pub max_abs_at: Vec<usize>,
    pub cosine: f64,
    /// Relative L2 error per attention head (empty for ops without heads).
    pub per_head: Vec<f64>,
}

impl Diff {
    /// The difference exceeds `tolerance` (NaN always does).
    pub fn exceeds(&self, tolerance: f64) -> bool {
        self.rel_l2.is_nan() || self.rel_l2 > tolerance
    }

    /// The head with the largest error.
    pub fn worst_head(&self) -> Option<(usize, f64)> {
        self.per_head
            .iter()
            .copied()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(&b.1))
    }

    pub fn summary(&self) -> String {
        let mut s = format!(
            "rel L2 {:.3e}, max |Δ| {:.3e} at {:?}, cosine {:.6}",
            self.rel_l2, self.max_abs, self.max_abs_at, self.cosine
        );
        if let Some((h, e)) = self.worst_head() {
            s.push_str(&format!(", worst head {h} ({e:.3e})"));
        }
        s
    }
}

/// How an op's output splits into heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heads {
    /// Heads along this axis of the shape.
    Axis(usize),
    /// The last dimension holds the heads side by side.
    Packed(usize),
}

/// Where the heads of an attention op are, if it has any.
pub fn heads_of(event: &OpEvent, num_heads: usize) -> Option<Heads> {
    let s = &event.shape;
    match event.kind {
        OpKind::AttentionProbs => Some(Heads::Axis(0)),
        OpKind::AttentionLatent | OpKind::AbsorbQuery | OpKind::Rope
            if s.len() == 3 && s[1] == num_heads =>
        {
            Some(Heads::Axis(1))
        }
        OpKind::Attention | OpKind::Decompress if s.last().is_some_and(|c| c % num_heads == 0) => {
            Some(Heads::Packed(num_heads))
        }
        _ => None,
    }
}

/// Compares `a` with the reference `b`, both laid out as `shape`. Equal elements agree even
/// when infinite (masked scores are −∞ on both sides); any NaN makes the error NaN.
pub fn diff(a: &[f32], b: &[f32], shape: &[usize], heads: Option<Heads>) -> Diff {
    assert_eq!(a.len(), b.len(), "compared tensors differ in size");
    let (mut d2, mut b2, mut a2, mut ab) = (0f64, 0f64, 0f64, 0f64);
    let (mut max_abs, mut at) = (0f64, 0usize);
    let mut nan = false;
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        if x.is_nan() || y.is_nan() {
            nan = true;
            continue;
        }
        if x == y && !x.is_finite() {
            continue;
        }
        let (x, y) = (x as f64, y as f64);
        let d = x - y;
        d2 += d * d;
        b2 += y * y;
        a2 += x * x;
        ab += x * y;
        if d.abs() > max_abs {
            max_abs = d.abs();
            at = i;
        }
    }
    let rel_l2 = if nan { f64::NAN } else { ratio(d2, b2) };
    let cosine = if a2 == 0.0 || b2 == 0.0 {
        if a2 == b2 {
            1.0
        } else {
            0.0
        }
    } else {
        ab / (a2.sqrt() * b2.sqrt())
    };
    let per_head = match heads {
        None => Vec::new(),
        Some(h) => per_head(a, b, shape, h),
    };
    Diff {
        rel_l2,
        max_abs,
        max_abs_at: unravel(at, shape),
        cosine,
        per_head,
    }
}

/// sqrt(d2 / r2), 0 when both are 0, +Inf when only the reference is 0.
fn ratio(d2: f64, r2: f64) -> f64 {
    if r2 == 0.0 || !r2.is_finite() {
        if d2 == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (d2 / r2).sqrt()
    }
}

fn per_head(a: &[f32], b: &[f32], shape: &[usize], heads: Heads) -> Vec<f64> {
    let (count, head_of): (usize, Box<dyn Fn(usize) -> usize>) = match heads {
        Heads::Axis(axis) if axis < shape.len() => {
            let inner: usize = shape[axis + 1..].iter().product();
            let n = shape[axis];
            (n, Box::new(move |i| i / inner % n))
        }
        Heads::Packed(n) if shape.last().is_some_and(|c| c % n == 0) => {
            let cols = *shape.last().expect("checked");
            let width = cols / n;
            (n, Box::new(move |i| i % cols / width))
        }
        _ => return Vec::new(),
    };
    let mut acc = vec![(0f64, 0f64, false); count];
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        let slot = &mut acc[head_of(i)];
        if x.is_nan() || y.is_nan() {
            slot.2 = true;
        } else if x != y || x.is_finite() {
            slot.0 += (x as f64 - y as f64).powi(2);
            slot.1 += (y as f64).powi(2);
        }
    }
    acc.into_iter()
        .map(|(d, r, nan)| if nan { f64::NAN } else { ratio(d, r) })
        .collect()
}

/// Two samples of outputs of `shape` (the same elements, see [`sample_indices`]) compared value
/// for value; the largest difference is placed at its element of the output.
fn sampled_diff(a: &[f32], b: &[f32], shape: &[usize]) -> Diff {
    let mut d = diff(a, b, &[a.len()], None);
    let at = numel(shape).and_then(|n| sample_indices(n).get(d.max_abs_at[0]).copied());
    if let Some(at) = at {
        d.max_abs_at = unravel(at, shape);
    }
    d
}

fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (d, &n) in shape.iter().enumerate().rev() {
        if n > 0 {
            idx[d] = flat % n;
            flat /= n;
        }
    }
    idx
}

/// One op compared across two runs (or a run and a reference).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpComparison {
    pub phase: Phase,
    pub name: String,
    /// Index of the op in the run being examined.
    pub index: usize,
    /// The figures, or why there are none.
    pub diff: Result<Diff, String>,
}

impl OpComparison {
    pub fn exceeds(&self, tolerance: f64) -> bool {
        matches!(&self.diff, Ok(d) if d.exceeds(tolerance))
    }
}

/// Compares every op of `a` with the op of the same phase and name in `b` (the reference), in
/// `a`'s execution order. Ops `b` lacks are left out.
pub fn compare_runs(a: &RunRecord, b: &RunRecord, num_heads: usize) -> Vec<OpComparison> {
    a.events
        .iter()
        .enumerate()
        .filter_map(|(i, e)| {
            let j = b.find(e.phase, &e.name)?;
            Some(compare_outputs(
                e,
                i,
                a.outputs[i].data(),
                &b.events[j].shape,
                b.outputs[j].data(),
                num_heads,
            ))
        })
        .collect()
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
        index,
        diff,
    }
}

/// Compares every decode-step op of `stepped` with the row of the same token in `whole`, a run
/// that prefilled the whole sequence at once. Ops whose outputs are not laid out by token
/// (top-k listings) are left out.
pub fn prefill_vs_decode(
    stepped: &RunRecord,
    whole: &RunRecord,
    num_heads: usize,
) -> Vec<OpComparison> {
    let mut out = Vec::new();
    for (i, e) in stepped.events.iter().enumerate() {
        if !matches!(e.phase, Phase::Decode(_)) || e.kind == OpKind::IndexTopK {
            continue;
        }
        let Some(j) = whole.find(Phase::Prefill, &e.name) else {
            continue;
        };
        let (w, we) = (&whole.outputs[j], &whole.events[j]);
        let pos = e.positions.0;
        let failed = |why: String| OpComparison {
            phase: e.phase,
            name: e.name.clone(),
            index: i,
            diff: Err(why),
        };
        // A token's row cannot be cut from a sample of the prefill's output.
        if is_sampled(e, &stepped.outputs[i]) || is_sampled(we, w) {
            out.push(failed(NEEDS_TENSORS.to_string()));
            continue;
        }
        out.push(match token_row(e, we, w.data(), pos) {
            Some(row) => {
                compare_outputs(e, i, stepped.outputs[i].data(), &e.shape, &row, num_heads)
            }
            None => failed(format!("no row {pos} in the prefill's {:?}", we.shape)),
        });
    }
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

/// The first comparison over `tolerance`, in execution order.
pub fn first_divergence(comparisons: &[OpComparison], tolerance: f64) -> Option<&OpComparison> {
    comparisons.iter().find(|c| c.exceeds(tolerance))
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
}
