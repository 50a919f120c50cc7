//! The DSA indexer's scores recomputed from the run's own query, head weights and key rows, for
//! two questions the verdicts ask of them. Each score is Σ_h w_h·ReLU(q_h·k), a sum whose terms
//! may cancel and whose ReLU may zero it:
//! * is an all-zero output what the ReLU gives (every head's dot ≤ 0)? [`relu_explains_zero`];
//! * how far may the scores move, relative, per unit of their inputs' relative error?
//!   [`conditioning`], which scales their tolerance.

use super::record::RunRecord;
use super::sample::holds_all;
use crate::engine::trace::Phase;

/// The most multiply-adds one recomputation spends: a full-size prefill's scores would take
/// billions, so beyond it the scores recomputed are a sample, evenly spread.
const BUDGET: usize = 1 << 20;

/// What the scores at op `i` were computed from, as the run kept it.
struct Terms<'a> {
    /// [n, heads, width], [n, heads], [context, width].
    q: &'a [f32],
    w: &'a [f32],
    keys: Vec<f32>,
    scores: &'a [f32],
    heads: usize,
    width: usize,
    context: usize,
    /// Every `stride`-th score (row-major) is recomputed.
    stride: usize,
}

impl<'a> Terms<'a> {
    /// The inputs of scores op `i`: its phase's `indexer.q_rope` and `indexer.weights_proj` and
    /// every `indexer.key_cache` write before it, of the same rank; `None` where one is missing
    /// or held only as a sample (a replay), or the shapes do not agree.
    fn of(run: &'a RunRecord, i: usize) -> Option<Terms<'a>> {
        let e = run.events.get(i)?;
        let prefix = e.name.strip_suffix("scores")?;
        let whole = |j: usize| {
            let t = run.outputs[j].data();
            holds_all(&run.events[j].shape, t.len()).then_some(t)
        };
        let q = whole(run.find_at(e.phase, e.rank, &format!("{prefix}q_rope"))?)?;
        let w = whole(run.find_at(e.phase, e.rank, &format!("{prefix}weights_proj"))?)?;
        let scores = whole(i)?;
        // The key rows each phase up to this one wrote (found by name, not by a scan of the run).
        let keys_name = format!("{prefix}key_cache");
        let phases = match e.phase {
            Phase::Prefill => 0,
            Phase::Decode(k) => k + 1,
        };
        let key_ops: Vec<usize> = std::iter::once(Phase::Prefill)
            .chain((0..phases).map(Phase::Decode))
            .filter_map(|p| run.find_at(p, e.rank, &keys_name))
            .collect();
        let width = *run.events[*key_ops.first()?].shape.last()?;
        let mut keys = Vec::new();
        for &k in &key_ops {
            keys.extend_from_slice(whole(k)?);
        }
        let (&[n, context], true) = (&e.shape[..], width > 0) else {
            return None;
        };
        let heads = w.len().checked_div(n)?;
        let fits = keys.len() == context * width && q.len() == n * heads * width;
        if !fits || heads == 0 {
            return None;
        }
        let kept = (BUDGET / (heads * width)).max(1);
        let stride = (n * context).div_ceil(kept).max(1);
        Some(Terms {
            q,
            w,
            keys,
            scores,
            heads,
            width,
            context,
            stride,
        })
    }

    /// Calls `f` with the heads of each unmasked score recomputed: per head (dot, reach, w),
    /// `reach` being ‖q_h‖·‖k‖, the most any change of direction can make of the dot.
    fn each(&self, mut f: impl FnMut(&[(f32, f32, f32)])) {
        let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        let mut heads = Vec::with_capacity(self.heads);
        for p in (0..self.scores.len()).step_by(self.stride) {
            if !self.scores[p].is_finite() {
                continue;
            }
            let (t, j) = (p / self.context, p % self.context);
            let k = &self.keys[j * self.width..][..self.width];
            let k_norm = norm(k);
            heads.clear();
            for h in 0..self.heads {
                let q = &self.q[(t * self.heads + h) * self.width..][..self.width];
                let dot = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>();
                heads.push((dot, norm(q) * k_norm, self.w[t * self.heads + h]));
            }
            f(&heads);
        }
    }
}

/// Whether the scores at op `i` of `run`, all zero, are what the ReLU gives: every head's dot
/// with every key at most a rounding's hair above zero. A single query over a few keys with few
/// indexer heads meets it often (one time in 16 with 4 heads and one key); all-zero scores with
/// a dot clearly above zero are a kernel that wrote nothing. `false` where the inputs cannot be
/// recomputed, or not every score within the budget.
pub fn relu_explains_zero(run: &RunRecord, i: usize) -> bool {
    let Some(terms) = Terms::of(run, i) else {
        return false;
    };
    let mut positive = false;
    terms.each(|heads| positive |= heads.iter().any(|&(dot, reach, _)| dot > 1e-5 * reach));
    terms.stride == 1 && !positive
}

/// How far the scores at op `i` of `run` may move, relative, per unit of relative error in
/// their inputs: ‖E‖ / ‖S‖ over the unmasked scores, S = Σ_h w_h·ReLU(d_h) recomputed and
/// E² = Σ_h w_h²·(ReLU(d_h)² + 2·(‖q_h‖·‖k‖)² / width), what errors of relative size 1 in w
/// and in q and k (each of random direction) would move a score by. A sum whose terms cancel
/// (weights of both signs) or that is made of dots small beside their vectors (a dot of 0.2
/// where the others are 5 to 9) moves far more, relative, than its inputs: a fixed gain cannot
/// cover the few-head, few-key scores of a short context. The factor is at least 1; it is 1
/// where the inputs cannot be recomputed, and large (every score may move) where every score
/// is zero by the ReLU.
pub fn conditioning(run: &RunRecord, i: usize) -> f64 {
    let Some(terms) = Terms::of(run, i) else {
        return 1.0;
    };
    let dot_noise = 2.0 / terms.width as f64;
    let (mut net_sq, mut reach_sq) = (0f64, 0f64);
    terms.each(|heads| {
        let mut net = 0f64;
        for &(dot, reach, w) in heads {
            let (dot, reach, w) = (dot.max(0.0) as f64, reach as f64, w as f64);
            net += w * dot;
            reach_sq += w * w * (dot * dot + dot_noise * reach * reach);
        }
        net_sq += net * net;
    });
    match (net_sq > 0.0, reach_sq > 0.0) {
        (true, _) => (reach_sq / net_sq).sqrt().clamp(1.0, MOST),
        (false, true) => MOST,
        (false, false) => 1.0,
    }
}

/// The largest factor [`conditioning`] gives: scores that are zero where their terms are not.
const MOST: f64 = 1e6;
