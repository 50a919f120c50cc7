//! MoE routing as GLM-5 and DeepSeek-V3 do it (`noaux_tc`):
//!
//! s = sigmoid(router logits) in f32; choice = s + e_score_correction_bias (the bias steers the
//! choice only); each group of experts is scored by the sum of its two best choices and only the
//! best `topk_group` groups stay eligible; the top-k experts by choice are picked; their weights
//! are the *unbiased* s, divided by their sum (+1e-20) when `norm_topk_prob`, times
//! `routed_scaling_factor`.

use crate::model::layout::MoeLayout;
use crate::tensor::Tensor;

/// The experts chosen for each token and their weights (already normalised and scaled).
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// [tokens][top_k] expert ids, in order of choice score.
    pub experts: Vec<Vec<usize>>,
    /// [tokens][top_k] weights.
    pub weights: Vec<Vec<f32>>,
}

/// Indices of the `k` largest values, largest first; ties go to the lower index.
pub fn top_k_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

pub fn route(logits: &Tensor, bias: &[f32], moe: &MoeLayout) -> Routing {
    let e = moe.n_routed_experts;
    let per_group = e / moe.n_group;
    let mut experts = Vec::new();
    let mut weights = Vec::new();
    for row in logits.data().chunks(e) {
        let scores = expert_scores(row);
        let choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
        let group_scores: Vec<f32> = choice
            .chunks(per_group)
            .map(|g| top_k_indices(g, 2).iter().map(|&i| g[i]).sum())
            .collect();
        let kept_groups = top_k_indices(&group_scores, moe.topk_group);
        let masked: Vec<f32> = choice
            .iter()
            .enumerate()
            .map(|(j, &c)| {
                if kept_groups.contains(&(j / per_group)) {
                    c
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let chosen = top_k_indices(&masked, moe.num_experts_per_tok);
        weights.push(weights_of(&scores, &chosen, moe));
        experts.push(chosen);
    }
    Routing { experts, weights }
}

/// sigmoid of one row of router logits: the unbiased expert scores. A NaN logit scores the
/// positive NaN (the arithmetic may leave it with either sign), so it ranks above every expert
/// under `total_cmp` here and on the GPU alike.
pub fn expert_scores(logits: &[f32]) -> Vec<f32> {
    logits
        .iter()
        .map(|&x| match x.is_nan() {
            true => f32::NAN,
            false => 1.0 / (1.0 + (-x).exp()),
        })
        .collect()
}

/// The routing weights of the `chosen` experts from their unbiased `scores`: normalised to sum 1
/// when `norm_topk_prob`, times `routed_scaling_factor`.
pub fn weights_of(scores: &[f32], chosen: &[usize], moe: &MoeLayout) -> Vec<f32> {
    let mut w: Vec<f32> = chosen.iter().map(|&j| scores[j]).collect();
    if moe.norm_topk_prob {
        let denom = w.iter().sum::<f32>() + 1e-20;
        for v in &mut w {
            *v /= denom;
        }
    }
    for v in &mut w {
        *v *= moe.routed_scaling_factor as f32;
    }
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(n_group: usize, topk_group: usize, k: usize) -> MoeLayout {
        MoeLayout {
            n_routed_experts: 8,
            num_experts_per_tok: k,
            n_shared_experts: 1,
            moe_intermediate_size: 4,
            n_group,
            topk_group,
            routed_scaling_factor: 2.5,
            norm_topk_prob: true,
        }
    }

    fn logit(p: f32) -> f32 {
        (p / (1.0 - p)).ln()
    }

    #[test]
    fn bias_steers_the_choice_but_not_the_weights() {
        let probs = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2];
        let logits = Tensor::from_vec(&[1, 8], probs.iter().map(|&p| logit(p)).collect());
        let mut bias = [0.0f32; 8];
        bias[7] = 1.0; // lifts the weakest expert into the top 2
        let r = route(&logits, &bias, &moe(1, 1, 2));
        assert_eq!(r.experts[0], vec![7, 0]);
        let (w7, w0) = (0.2f32, 0.9f32);
        let expected = [w7 / (w7 + w0) * 2.5, w0 / (w7 + w0) * 2.5];
        for (a, b) in r.weights[0].iter().zip(expected) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
    }

    #[test]
    fn group_limit_excludes_experts_of_dropped_groups() {
        // Groups of 2: {0,1} {2,3} {4,5} {6,7}. Expert 0 alone is strongest, but its group's
        // top-2 sum is weak, so with one group kept the pick comes from group {2,3}.
        let probs = [0.99, 0.01, 0.9, 0.9, 0.5, 0.5, 0.4, 0.4];
        let logits = Tensor::from_vec(&[1, 8], probs.iter().map(|&p| logit(p)).collect());
        let r = route(&logits, &[0.0; 8], &moe(4, 1, 2));
        let mut chosen = r.experts[0].clone();
        chosen.sort();
        assert_eq!(chosen, vec![2, 3]);
        let r = route(&logits, &[0.0; 8], &moe(4, 4, 2));
        assert_eq!(r.experts[0][0], 0);
    }
}
