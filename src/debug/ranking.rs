//! What one row's discrete choice was made from (a [`Ranking`]: a score per candidate, and for
//! group-limited routing the group stage before it), and its margins: the gap at the top-k
//! boundary, and the smallest change of scores that makes it choose another set.

use std::collections::BTreeSet;

/// The group stage of group-limited routing: experts in groups of `size`, each group scored by
/// the sum of its two best candidates, only the best `kept` groups eligible.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupStage {
    pub size: usize,
    pub scores: Vec<f32>,
    pub kept: usize,
}

/// What one row's choice was made from.
#[derive(Debug, Clone, PartialEq)]
pub struct Ranking {
    /// A score per candidate; higher wins, lower index on a tie.
    pub scores: Vec<f32>,
    pub groups: Option<GroupStage>,
    /// How many candidates are chosen.
    pub k: usize,
}

/// Indices of the `k` largest values, largest first, ties to the lower index (as the engine).
fn top(values: &[f32], k: usize) -> Vec<usize> {
    crate::engine::moe::top_k_indices(values, k)
}

impl Ranking {
    /// Routing's ranking of one row of router logits: sigmoid + bias, with the group stage when
    /// routing is group-limited.
    pub fn routing(logits: &[f32], bias: &[f32], moe: &crate::model::layout::MoeLayout) -> Self {
        let scores: Vec<f32> = crate::engine::moe::expert_scores(logits)
            .iter()
            .zip(bias)
            .map(|(s, b)| s + b)
            .collect();
        let groups = (moe.n_group > moe.topk_group && moe.n_group > 1).then(|| {
            let size = moe.n_routed_experts / moe.n_group;
            GroupStage {
                size,
                scores: group_scores(&scores, size),
                kept: moe.topk_group,
            }
        });
        Ranking {
            scores,
            groups,
            k: moe.num_experts_per_tok,
        }
    }

    /// The DSA ranking of one query row: its causal scores, `topk` kept.
    pub fn keys(causal_scores: &[f32], topk: usize) -> Self {
        Ranking {
            scores: causal_scores.to_vec(),
            groups: None,
            k: topk.min(causal_scores.len()),
        }
    }

    /// Whether the row makes a choice at all (a DSA row with no more keys than top-k keeps all).
    pub fn decides(&self) -> bool {
        self.k < self.scores.len()
    }

    /// The groups this ranking keeps (all of them without a group stage).
    fn kept_groups(&self) -> Option<Vec<usize>> {
        self.groups.as_ref().map(|g| top(&g.scores, g.kept))
    }

    /// The choice this ranking makes, sorted by index.
    pub fn choose(&self) -> Vec<usize> {
        let masked: Vec<f32> = match (&self.groups, self.kept_groups()) {
            (Some(g), Some(kept)) => self
                .scores
                .iter()
                .enumerate()
                .map(|(j, &s)| {
                    if kept.contains(&(j / g.size)) {
                        s
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect(),
            _ => self.scores.clone(),
        };
        let mut chosen = top(&masked, self.k);
        chosen.sort_unstable();
        chosen
    }

    /// The largest absolute finite score: the scale the noise is measured against.
    pub fn scale(&self) -> f32 {
        let experts = self.scores.iter().copied().filter(|s| s.is_finite());
        let groups = self
            .groups
            .iter()
            .flat_map(|g| g.scores.iter().copied().filter(|s| s.is_finite()));
        experts.chain(groups).map(f32::abs).fold(0.0, f32::max)
    }

    /// The smallest change of scores that makes this ranking choose `theirs` instead of its
    /// own choice: every candidate `theirs` holds raised by δ and every other lowered by δ
    /// (group scores follow), δ found by bisection: 0 for an exact tie the tie-break decided,
    /// +∞ when `theirs` is no choice this ranking could make (wrong size, out of range).
    pub fn change_to_choose(&self, theirs: &[usize]) -> f32 {
        let mine = self.choose();
        let mut target = theirs.to_vec();
        target.sort_unstable();
        if mine == target {
            return 0.0;
        }
        let b: BTreeSet<usize> = target.iter().copied().collect();
        let flips_at = |delta: f32| {
            let mut moved = self.clone();
            for (i, s) in moved.scores.iter_mut().enumerate() {
                *s += if b.contains(&i) { delta } else { -delta };
            }
            if let Some(g) = moved.groups.as_mut() {
                g.scores = group_scores(&moved.scores, g.size);
            }
            moved.choose() == target
        };
        let mut hi = 2.0 * self.scale() + 1.0;
        if !flips_at(hi) {
            return f32::INFINITY;
        }
        let mut lo = 0.0;
        for _ in 0..40 {
            let mid = 0.5 * (lo + hi);
            if flips_at(mid) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        // What bisection leaves of an exact tie is rounding: call it one.
        if flips_at(0.0) || hi <= 1e-6 * self.scale().max(1.0) {
            0.0
        } else {
            hi
        }
    }

    fn score(&self, i: usize) -> f32 {
        self.scores.get(i).copied().unwrap_or(f32::NEG_INFINITY)
    }

    /// The gap at the boundary of `chosen` (its weakest member against the strongest eligible
    /// candidate left out; for group-limited routing the smaller of that and the gap between
    /// the weakest kept and the strongest dropped group), with the candidates on each side
    /// that lie within `noise` of the boundary.
    pub fn boundary(&self, chosen: &[usize], noise: f32) -> Boundary {
        let kept_groups = self.kept_groups();
        let eligible = |j: usize| match (&self.groups, &kept_groups) {
            (Some(g), Some(kept)) => kept.contains(&(j / g.size)),
            _ => true,
        };
        let chosen_set: BTreeSet<usize> = chosen.iter().copied().collect();
        let weakest = chosen
            .iter()
            .map(|&i| self.score(i))
            .fold(f32::INFINITY, f32::min);
        let strongest_left = (0..self.scores.len())
            .filter(|j| !chosen_set.contains(j) && eligible(*j))
            .map(|j| self.score(j))
            .fold(f32::NEG_INFINITY, f32::max);
        let mut margin = finite_gap(weakest, strongest_left);
        if let (Some(g), Some(kept)) = (&self.groups, &kept_groups) {
            let weakest_kept = kept
                .iter()
                .map(|&k| g.scores[k])
                .fold(f32::INFINITY, f32::min);
            let strongest_dropped = (0..g.scores.len())
                .filter(|grp| !kept.contains(grp))
                .map(|grp| g.scores[grp])
                .fold(f32::NEG_INFINITY, f32::max);
            margin = margin.min(finite_gap(weakest_kept, strongest_dropped));
        }
        let near = |j: usize| {
            let s = self.score(j);
            let within = |edge: f32| (s - edge).abs() <= noise.max(0.0);
            s.is_finite() && (within(weakest) || within(strongest_left))
        };
        Boundary {
            margin,
            kept_near: chosen.iter().copied().filter(|&j| near(j)).collect(),
            dropped_near: (0..self.scores.len())
                .filter(|j| !chosen_set.contains(j) && eligible(*j) && near(*j))
                .collect(),
        }
    }
}

/// Each group's score: the sum of its two best candidates (as routing scores groups).
fn group_scores(scores: &[f32], size: usize) -> Vec<f32> {
    scores
        .chunks(size)
        .map(|g| top(g, 2).iter().map(|&i| g[i]).sum())
        .collect()
}

/// a − b, where an infinite side (no candidate, a masked one) makes the gap infinite.
fn finite_gap(a: f32, b: f32) -> f32 {
    if a.is_finite() && b.is_finite() {
        a - b
    } else if a == b {
        0.0
    } else {
        f32::INFINITY
    }
}

/// The boundary of one row's choice.
#[derive(Debug, Clone, PartialEq)]
pub struct Boundary {
    /// Score gap between the weakest chosen and the strongest eligible candidate left out.
    pub margin: f32,
    /// Chosen candidates within the noise of the boundary.
    pub kept_near: Vec<usize>,
    /// Candidates left out within the noise of the boundary.
    pub dropped_near: Vec<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layout::MoeLayout;

    #[test]
    fn key_margins_ties_and_preferences() {
        // Keys 1 and 3 tie exactly for the second place of a top-2.
        let r = Ranking::keys(&[0.9, 0.5, 0.1, 0.5, 0.0], 2);
        assert!(r.decides());
        assert_eq!(r.choose(), vec![0, 1]);
        let b = r.boundary(&[0, 1], 1e-3);
        assert_eq!(b.margin, 0.0);
        assert_eq!((b.kept_near, b.dropped_near), (vec![1], vec![3]));
        // The other tie-break costs nothing; choosing key 4 needs it raised and keys 1 and 3
        // lowered until they meet: each score moved by 0.25.
        assert!(r.change_to_choose(&[0, 3]) < 1e-6);
        assert!((r.change_to_choose(&[0, 4]) - 0.25).abs() < 1e-5);
        assert_eq!(r.change_to_choose(&[0, 1]), 0.0);
        assert!(!Ranking::keys(&[1.0, 2.0], 2).decides());
    }

    #[test]
    fn group_stage_counts_in_margins() {
        let moe = MoeLayout {
            n_routed_experts: 8,
            num_experts_per_tok: 2,
            n_shared_experts: 0,
            moe_intermediate_size: 4,
            n_group: 4,
            topk_group: 1,
            routed_scaling_factor: 1.0,
            norm_topk_prob: true,
        };
        let logit = |p: f32| (p / (1.0 - p)).ln();
        // Group {2,3} wins on its pair sum (1.8 vs 1.0 for {0,1}) though expert 0 is strongest.
        let logits: Vec<f32> = [0.99, 0.01, 0.9, 0.9, 0.5, 0.5, 0.4, 0.4]
            .iter()
            .map(|&p| logit(p))
            .collect();
        let r = Ranking::routing(&logits, &[0.0; 8], &moe);
        assert_eq!(r.choose(), vec![2, 3]);
        // Choosing {0, 1} instead needs group {0,1} (1.0) to overtake {2,3} (1.8): each of the
        // four experts moved by 0.2.
        let change = r.change_to_choose(&[0, 1]);
        assert!((change - 0.2).abs() < 1e-4, "{change}");
        // {0, 2} spans two groups where one is kept: no change of scores gets there.
        assert_eq!(r.change_to_choose(&[0, 2]), f32::INFINITY);
        // No other expert of the kept group is left, so the margin is the group stage's: the
        // kept group's 1.8 against 1.0 for the best dropped ones.
        let b = r.boundary(&[2, 3], 1e-3);
        assert!((b.margin - 0.8).abs() < 1e-4, "{b:?}");
    }
}
