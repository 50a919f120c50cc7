//! Tensor statistics: the numbers the trace carries for every op output.
//!
//! Min, max, mean, std, abs-max and L2 norm are taken over the finite elements, so one NaN does
//! not hide the rest of the picture; NaN, +Inf, -Inf and exact zeros are counted separately.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorStats {
    pub count: usize,
    pub min: f64,
    pub max: f64,
    pub mean: f64,
    pub std: f64,
    pub abs_max: f64,
    pub l2: f64,
    pub nan: usize,
    pub pos_inf: usize,
    pub neg_inf: usize,
    pub zeros: usize,
    /// Elements still holding the poison pattern: not written by the op (also counted as NaN).
    #[serde(default)]
    pub unwritten: usize,
}

impl TensorStats {
    /// One pass over the values, accumulating in f64.
    pub fn of(values: &[f32]) -> TensorStats {
        let mut s = TensorStats {
            count: values.len(),
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
            mean: 0.0,
            std: 0.0,
            abs_max: 0.0,
            l2: 0.0,
            nan: 0,
            pos_inf: 0,
            neg_inf: 0,
            zeros: 0,
            unwritten: 0,
        };
        let (mut sum, mut sum_sq, mut finite) = (0f64, 0f64, 0usize);
        for &v in values {
            if v.is_nan() {
                s.nan += 1;
                if v.to_bits() == crate::tensor::POISON_BITS {
                    s.unwritten += 1;
                }
                continue;
            }
            if v == f32::INFINITY {
                s.pos_inf += 1;
                continue;
            }
            if v == f32::NEG_INFINITY {
                s.neg_inf += 1;
                continue;
            }
            if v == 0.0 {
                s.zeros += 1;
            }
            let x = v as f64;
            finite += 1;
            sum += x;
            sum_sq += x * x;
            s.min = s.min.min(x);
            s.max = s.max.max(x);
            s.abs_max = s.abs_max.max(x.abs());
        }
        if finite == 0 {
            s.min = f64::NAN;
            s.max = f64::NAN;
            s.mean = f64::NAN;
            s.std = f64::NAN;
            return s;
        }
        s.mean = sum / finite as f64;
        s.std = (sum_sq / finite as f64 - s.mean * s.mean).max(0.0).sqrt();
        s.l2 = sum_sq.sqrt();
        s
    }

    /// The same statistics summed in eight interleaved lanes: several times faster than [`of`]
    /// (independent f64 chains the compiler can vectorize), but in another order, so the sums
    /// may differ from [`of`]'s in the last bits. For device runs, whose sessions are checked
    /// within a tolerance anyway; CPU runs keep [`of`], which a CPU replay reproduces bit for
    /// bit. Tensors with a NaN or an infinity take [`of`] (rare, and counted there).
    ///
    /// [`of`]: TensorStats::of
    pub fn of_unordered(values: &[f32]) -> TensorStats {
        const LANES: usize = 8;
        let (mut sum, mut sum_sq) = ([0f64; LANES], [0f64; LANES]);
        // Min and max of f32 values are exact in f32; comparisons (not f64::min) vectorize.
        let (mut min, mut max) = ([f32::INFINITY; LANES], [f32::NEG_INFINITY; LANES]);
        let (mut zeros, mut special) = ([0u32; LANES], [0u32; LANES]);
        let mut lane = |i: usize, v: f32| {
            let bits = v.to_bits();
            special[i] |= ((bits & 0x7f80_0000) == 0x7f80_0000) as u32;
            let x = v as f64;
            sum[i] += x;
            sum_sq[i] += x * x;
            min[i] = if v < min[i] { v } else { min[i] };
            max[i] = if v > max[i] { v } else { max[i] };
            zeros[i] += (bits << 1 == 0) as u32;
        };
        let chunks = values.chunks_exact(LANES);
        let rest = chunks.remainder();
        for c in chunks {
            for (i, &v) in c.iter().enumerate() {
                lane(i, v);
            }
        }
        for (i, &v) in rest.iter().enumerate() {
            lane(i, v);
        }
        let special = special.iter().any(|&s| s != 0);
        if special || values.is_empty() {
            return TensorStats::of(values);
        }
        let n = values.len() as f64;
        let (sum, sum_sq): (f64, f64) = (sum.iter().sum(), sum_sq.iter().sum());
        let min = min.iter().cloned().fold(f32::INFINITY, f32::min) as f64;
        let max = max.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let mean = sum / n;
        TensorStats {
            count: values.len(),
            min,
            max,
            mean,
            std: (sum_sq / n - mean * mean).max(0.0).sqrt(),
            abs_max: min.abs().max(max.abs()),
            l2: sum_sq.sqrt(),
            nan: 0,
            pos_inf: 0,
            neg_inf: 0,
            zeros: zeros.iter().map(|&z| z as usize).sum(),
            unwritten: 0,
        }
    }

    /// NaN or ±Inf present (tfdbg's `has_inf_or_nan`).
    pub fn has_inf_or_nan(&self) -> bool {
        self.nan + self.pos_inf + self.neg_inf > 0
    }

    /// Every element is exactly zero.
    pub fn all_zero(&self) -> bool {
        self.count > 0 && self.zeros == self.count
    }
}

/// Relative L2 error ‖a − b‖ / ‖b‖ (b is the reference), in f64. Returns +Inf when the reference
/// is zero and `a` is not, NaN when either holds a NaN.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "rel_l2 of tensors of different sizes");
    let (mut diff, mut norm) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let d = x as f64 - y as f64;
        diff += d * d;
        norm += (y as f64) * (y as f64);
    }
    if diff.is_nan() || norm.is_nan() {
        return f64::NAN;
    }
    if norm == 0.0 {
        return if diff == 0.0 { 0.0 } else { f64::INFINITY };
    }
    (diff / norm).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unordered_stats_agree_with_the_ordered_pass() {
        // Values of mixed magnitude and sign, a length that leaves a remainder, exact zeros.
        let values: Vec<f32> = (0..1003)
            .map(|i| {
                let x = ((i * 7919) % 1000) as f32 / 37.0 - 13.0;
                if i % 97 == 0 {
                    0.0
                } else {
                    x * (1.0 + (i % 5) as f32 * 100.0)
                }
            })
            .collect();
        let (a, b) = (TensorStats::of(&values), TensorStats::of_unordered(&values));
        assert_eq!((a.count, a.zeros, a.nan), (b.count, b.zeros, b.nan));
        assert_eq!((a.min, a.max, a.abs_max), (b.min, b.max, b.abs_max));
        for (x, y) in [(a.mean, b.mean), (a.std, b.std), (a.l2, b.l2)] {
            assert!((x - y).abs() <= 1e-12 * x.abs().max(1.0), "{x} vs {y}");
        }
        // With a NaN or an infinity it is the ordered pass, counts and all.
        let mut special = values.clone();
        special[500] = f32::NAN;
        special[3] = f32::NEG_INFINITY;
        assert_eq!(
            TensorStats::of_unordered(&special),
            TensorStats::of(&special)
        );
        // (NaN fields: compared as text.)
        let empty = |s: TensorStats| format!("{s:?}");
        assert_eq!(
            empty(TensorStats::of_unordered(&[])),
            empty(TensorStats::of(&[]))
        );
    }

    #[test]
    fn stats_count_specials_and_skip_them() {
        let s = TensorStats::of(&[
            1.0,
            -3.0,
            0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            2.0,
        ]);
        assert_eq!((s.nan, s.pos_inf, s.neg_inf, s.zeros), (1, 1, 1, 1));
        assert_eq!((s.min, s.max, s.abs_max), (-3.0, 2.0, 3.0));
        assert_eq!(s.mean, 0.0);
        assert!((s.l2 - 14f64.sqrt()).abs() < 1e-12);
        assert!((s.std - 3.5f64.sqrt()).abs() < 1e-12);
        assert!(s.has_inf_or_nan());
        assert!(!s.all_zero());
        assert!(TensorStats::of(&[0.0, 0.0]).all_zero());
        let poison = f32::from_bits(crate::tensor::POISON_BITS);
        let s = TensorStats::of(&[poison, f32::NAN, 1.0]);
        assert_eq!((s.nan, s.unwritten), (2, 1));
    }

    #[test]
    fn rel_l2_is_relative_to_the_reference() {
        assert_eq!(rel_l2(&[1.0, 1.0], &[1.0, 1.0]), 0.0);
        assert!((rel_l2(&[1.1, 0.0], &[1.0, 0.0]) - 0.1).abs() < 1e-6);
        assert!(rel_l2(&[f32::NAN], &[1.0]).is_nan());
        assert_eq!(rel_l2(&[1.0], &[0.0]), f64::INFINITY);
    }
}
