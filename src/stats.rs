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
