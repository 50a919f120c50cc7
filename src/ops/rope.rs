//! Rotary position embeddings: frequencies (default and YaRN), and the two pair layouts.
//!
//! Frequencies follow HF's `compute_default_rope_parameters` / `_compute_yarn_parameters`,
//! including YaRN's attention factor, which multiplies cos and sin (and so q_pe·k_pe).
//!
//! Layouts: *interleaved* rotates pairs (x0,x1),(x2,x3),.. in place, as vLLM and FlashMLA do;
//! HF's helper returns the same rotated pairs de-interleaved (evens then odds). Dot products are
//! equal, so attention outputs agree, but the element order of a stored k_pe differs.
//! *Split-half* pairs x[j] with x[j + d/2] (`rotate_half`).

use crate::model::layout::{yarn_mscale, RopeLayout, RopeScaling};

/// Inverse frequencies and the cos/sin scale for one rotary dimension.
#[derive(Debug, Clone)]
pub struct RopeTable {
    /// One frequency per rotated pair, as f32 like HF's buffer.
    pub inv_freq: Vec<f32>,
    /// Multiplies cos and sin (YaRN's attention factor; 1 otherwise).
    pub attention_factor: f32,
}

impl RopeTable {
    /// Frequencies for rotating `dim` elements (qk_rope_head_dim).
    pub fn new(rope: &RopeLayout, dim: usize) -> RopeTable {
        let base = rope.theta;
        let exponents: Vec<f64> = (0..dim / 2).map(|j| (2 * j) as f64 / dim as f64).collect();
        match &rope.scaling {
            RopeScaling::None => RopeTable {
                inv_freq: exponents
                    .iter()
                    .map(|e| (1.0 / base.powf(*e)) as f32)
                    .collect(),
                attention_factor: 1.0,
            },
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let factor = *factor;
                let attention_factor =
                    attention_factor.unwrap_or_else(|| match (mscale, mscale_all_dim) {
                        (Some(m), Some(all)) if *m != 0.0 && *all != 0.0 => {
                            yarn_mscale(factor, *m) / yarn_mscale(factor, *all)
                        }
                        _ => yarn_mscale(factor, 1.0),
                    });
                let d = dim as f64;
                let max_pos = *original_max_position_embeddings as f64;
                let correction_dim = |rotations: f64| {
                    d * (max_pos / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let high = high.min(d - 1.0);
                let span = if low == high { 0.001 } else { high - low };
                let inv_freq = exponents
                    .iter()
                    .enumerate()
                    .map(|(j, e)| {
                        let pos_freq = base.powf(*e);
                        let extrapolation = 1.0 / pos_freq;
                        let interpolation = 1.0 / (factor * pos_freq);
                        let ramp = ((j as f64 - low) / span).clamp(0.0, 1.0);
                        let extrapolation_weight = 1.0 - ramp;
                        (interpolation * (1.0 - extrapolation_weight)
                            + extrapolation * extrapolation_weight) as f32
                    })
                    .collect();
                RopeTable {
                    inv_freq,
                    attention_factor: attention_factor as f32,
                }
            }
        }
    }

    /// cos and sin of pair `j` at `position`, scaled by the attention factor. The angle is formed
    /// in f32 as HF does, so positions far out round the same way.
    #[inline]
    pub fn cos_sin(&self, position: usize, j: usize) -> (f32, f32) {
        let angle = self.inv_freq[j] * position as f32;
        let (s, c) = (angle as f64).sin_cos();
        (
            (c as f32) * self.attention_factor,
            (s as f32) * self.attention_factor,
        )
    }

    /// Rotates the first `2 * inv_freq.len()` elements of `x` for `position`, in place.
    pub fn rotate(&self, x: &mut [f32], position: usize, interleaved: bool) {
        let half = self.inv_freq.len();
        for j in 0..half {
            let (c, s) = self.cos_sin(position, j);
            let (a, b) = if interleaved {
                (2 * j, 2 * j + 1)
            } else {
                (j, j + half)
            };
            let (x0, x1) = (x[a], x[b]);
            x[a] = x0 * c - x1 * s;
            x[b] = x1 * c + x0 * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(interleaved: bool, scaling: RopeScaling) -> RopeLayout {
        RopeLayout {
            theta: 10000.0,
            interleaved,
            scaling,
        }
    }

    #[test]
    fn rotation_preserves_dot_products_of_equal_positions_and_depends_on_offset() {
        let table = RopeTable::new(&layout(true, RopeScaling::None), 8);
        let q: Vec<f32> = (0..8).map(|i| (i as f32 * 0.37).sin()).collect();
        let k: Vec<f32> = (0..8).map(|i| (i as f32 * 0.91).cos()).collect();
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        for interleaved in [true, false] {
            // q at m, k at n: the score depends only on m - n.
            let rot = |v: &[f32], p| {
                let mut v = v.to_vec();
                table.rotate(&mut v, p, interleaved);
                v
            };
            let s1 = dot(&rot(&q, 7), &rot(&k, 3));
            let s2 = dot(&rot(&q, 14), &rot(&k, 10));
            assert!((s1 - s2).abs() < 1e-5, "{s1} vs {s2}");
            let s3 = dot(&rot(&q, 7), &rot(&k, 4));
            assert!((s1 - s3).abs() > 1e-4);
        }
    }

    #[test]
    fn yarn_matches_hand_computed_deepseek_numbers() {
        let yarn = RopeScaling::Yarn {
            factor: 40.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: Some(1.0),
            mscale_all_dim: Some(1.0),
            attention_factor: None,
            truncate: true,
        };
        let t = RopeTable::new(&layout(true, yarn), 64);
        assert_eq!(t.attention_factor, 1.0);
        // Fast dimensions keep their frequency, slow ones are divided by the factor.
        assert_eq!(t.inv_freq[0], 1.0);
        let slow = 1.0 / 10000f64.powf(62.0 / 64.0);
        assert!(((t.inv_freq[31] as f64) - slow / 40.0).abs() < 1e-12);
    }
}
