//! How one output differs from a reference: relative L2 error, max abs error with its position,
//! cosine similarity over the elements finite on both sides, NaN and infinities counted per
//! side, and per-head figures for attention ops.

use super::sample::{numel, sample_indices};
use crate::engine::trace::{OpEvent, OpKind};
use serde::{Deserialize, Serialize};

/// NaN and infinities among the elements of one side of a comparison.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NonFinite {
    pub nan: usize,
    pub pos_inf: usize,
    pub neg_inf: usize,
}

impl NonFinite {
    pub fn total(&self) -> usize {
        self.nan + self.pos_inf + self.neg_inf
    }

    fn count(&mut self, x: f32) {
        if x.is_nan() {
            self.nan += 1;
        } else if x == f32::INFINITY {
            self.pos_inf += 1;
        } else if x == f32::NEG_INFINITY {
            self.neg_inf += 1;
        }
    }
}

/// How one op's output differs from a reference. The figures are over the elements finite on
/// both sides; NaN and ±Inf are counted per side instead, and any of them fails the comparison.
/// −∞ on both sides is the masking convention (the DSA indexer's scores of masked keys): such
/// elements agree and are counted as `masked`, not as non-finite.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Diff {
    /// ‖a − ref‖ / ‖ref‖ over the elements finite on both sides (NaN when there are none).
    pub rel_l2: f64,
    /// Largest |a − ref| over the same elements (NaN when there are none).
    pub max_abs: f64,
    /// Multi-index of the largest absolute difference.
    pub max_abs_at: Vec<usize>,
    /// Cosine similarity over the same elements (NaN when there are none).
    pub cosine: f64,
    /// Relative L2 error per attention head (empty for ops without heads); NaN for a head with
    /// non-finite elements.
    pub per_head: Vec<f64>,
    /// NaN / ±Inf in the output examined, outside the masked elements.
    #[serde(default)]
    pub here: NonFinite,
    /// NaN / ±Inf in the reference, outside the masked elements.
    #[serde(default)]
    pub reference: NonFinite,
    /// Multi-index of the first element non-finite on either side (outside the masked ones).
    #[serde(default)]
    pub first_non_finite_at: Option<Vec<usize>>,
    /// Elements finite on both sides: what the figures are computed over.
    #[serde(default)]
    pub finite: usize,
    /// Elements −∞ on both sides (masked scores), which agree.
    #[serde(default)]
    pub masked: usize,
    /// Elements non-finite alike on both sides (NaN and NaN, +Inf and +Inf; masked −∞ aside):
    /// counted in `here` and `reference` too, since they still fail the comparison.
    #[serde(default)]
    pub alike: usize,
}

impl Diff {
    /// Some element is NaN or infinite on either side (masked −∞ aside).
    pub fn has_non_finite(&self) -> bool {
        self.here.total() + self.reference.total() > 0
    }

    /// The error a tolerance is checked against: the relative L2 error, or NaN when any element
    /// is non-finite (NaN and infinities never agree within a tolerance).
    pub fn error(&self) -> f64 {
        if self.has_non_finite() {
            f64::NAN
        } else {
            self.rel_l2
        }
    }

    /// How far apart the two are, to pick the farther of two references: the relative L2 error
    /// over the elements finite on both sides, infinite when some value is non-finite on one side
    /// only (NaN or ±Inf alike on both sides agree here, as [`Diff::fails_only_alike`] says).
    pub fn severity(&self) -> f64 {
        let alike_only = self.here.total() == self.alike && self.reference.total() == self.alike;
        match (alike_only, self.finite) {
            (false, _) => f64::INFINITY,
            (true, 0) => 0.0,
            (true, _) if self.rel_l2.is_nan() => f64::INFINITY,
            (true, _) => self.rel_l2,
        }
    }

    /// The difference exceeds `tolerance` (non-finite values always do).
    pub fn exceeds(&self, tolerance: f64) -> bool {
        let e = self.error();
        e.is_nan() || e > tolerance
    }

    /// Fails only through values non-finite alike on both sides, the elements finite on both
    /// sides (if any) within `tolerance`: the two computations agree wherever they can be
    /// compared, and the non-finite values are the output's own (what the NaN/Inf detector
    /// reports where they arise), not a difference between the two.
    pub fn fails_only_alike(&self, tolerance: f64) -> bool {
        self.has_non_finite()
            && self.here.total() == self.alike
            && self.reference.total() == self.alike
            && (self.finite == 0 || self.rel_l2 <= tolerance)
    }

    /// The head with the largest error (NaN counts as largest; the first of equals).
    pub fn worst_head(&self) -> Option<(usize, f64)> {
        let mut worst: Option<(usize, f64)> = None;
        for (h, &e) in self.per_head.iter().enumerate() {
            if worst.is_none_or(|(_, w)| e.total_cmp(&w).is_gt()) {
                worst = Some((h, e));
            }
        }
        worst
    }

    /// NaN / ±Inf counts of both sides and where the first is, when there are any: what a
    /// display shows before any figure.
    pub fn non_finite_summary(&self) -> Option<String> {
        if !self.has_non_finite() {
            return None;
        }
        let (h, r) = (&self.here, &self.reference);
        let parts: Vec<String> = [
            ("NaN", h.nan, r.nan),
            ("+Inf", h.pos_inf, r.pos_inf),
            ("-Inf", h.neg_inf, r.neg_inf),
        ]
        .iter()
        .filter(|(_, a, b)| a + b > 0)
        .map(|(what, a, b)| format!("{what} {a} vs {b}"))
        .collect();
        let mut s = format!(
            "non-finite values: {} (here vs reference)",
            parts.join(", ")
        );
        if let Some(at) = &self.first_non_finite_at {
            s.push_str(&format!(", first at {at:?}"));
        }
        if self.masked > 0 {
            s.push_str(&format!(", {} masked (-Inf on both sides)", self.masked));
        }
        Some(s)
    }

    /// rel L2, max |Δ| and cosine, said to be over the finite elements when some are not; none
    /// when no element is finite on both sides.
    pub fn figures_summary(&self) -> String {
        if self.finite == 0 && self.has_non_finite() {
            return "no element is finite on both sides".to_string();
        }
        let figures = format!(
            "rel L2 {:.3e}, max |Δ| {:.3e} at {:?}, cosine {:.6}",
            self.rel_l2, self.max_abs, self.max_abs_at, self.cosine
        );
        if self.has_non_finite() {
            format!(
                "over the {} elements finite on both sides: {figures}",
                self.finite
            )
        } else {
            figures
        }
    }

    pub fn summary(&self) -> String {
        let mut s = match self.non_finite_summary() {
            Some(n) => format!("{n}; {}", self.figures_summary()),
            None => self.figures_summary(),
        };
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
        OpKind::AttentionLatent
        | OpKind::AttentionPadding
        | OpKind::AttentionMerge
        | OpKind::AbsorbQuery
        | OpKind::Rope
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

/// −∞ on both sides: a masked element, which agrees.
fn is_masked(x: f32, y: f32) -> bool {
    x == f32::NEG_INFINITY && y == f32::NEG_INFINITY
}

/// How far apart two tensors of one size are that should hold the same values (two names an
/// engine gives one op): `None` when they are the same bit for bit or within 1e-6 relative L2,
/// else their error (NaN where a non-finite value is not matched by the same bits).
pub fn apart(a: &[f32], b: &[f32]) -> Option<f64> {
    if a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()) {
        return None;
    }
    let error = diff(a, b, &[a.len()], None).error();
    (error.is_nan() || error > 1e-6).then_some(error)
}

/// Compares `a` with the reference `b`, both laid out as `shape` (see [`Diff`]).
pub fn diff(a: &[f32], b: &[f32], shape: &[usize], heads: Option<Heads>) -> Diff {
    assert_eq!(a.len(), b.len(), "compared tensors differ in size");
    let (mut d2, mut b2, mut a2, mut ab) = (0f64, 0f64, 0f64, 0f64);
    let (mut max_abs, mut at) = (0f64, 0usize);
    let (mut here, mut reference) = (NonFinite::default(), NonFinite::default());
    let (mut finite, mut masked, mut alike, mut first_bad) = (0usize, 0usize, 0usize, None);
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        if is_masked(x, y) {
            masked += 1;
            continue;
        }
        if !(x.is_finite() && y.is_finite()) {
            here.count(x);
            reference.count(y);
            first_bad.get_or_insert(i);
            if x.is_nan() && y.is_nan() || x == y {
                alike += 1;
            }
            continue;
        }
        finite += 1;
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
    // No element finite on both sides and some non-finite: there is nothing to measure.
    let none = finite == 0 && first_bad.is_some();
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
    let nan_if_none = |v: f64| if none { f64::NAN } else { v };
    Diff {
        rel_l2: nan_if_none(ratio(d2, b2)),
        max_abs: nan_if_none(max_abs),
        max_abs_at: unravel(at, shape),
        cosine: nan_if_none(cosine),
        per_head,
        here,
        reference,
        first_non_finite_at: first_bad.map(|i| unravel(i, shape)),
        finite,
        masked,
        alike,
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
        if is_masked(x, y) {
            continue;
        }
        if !(x.is_finite() && y.is_finite()) {
            slot.2 = true;
        } else {
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
pub(super) fn sampled_diff(a: &[f32], b: &[f32], shape: &[usize]) -> Diff {
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
