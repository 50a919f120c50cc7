//! Samples of op outputs: the bounded set of values a session records of each output (the first
//! and last few and some spread between), and how to tell a sample from a whole output. A run
//! replayed without its full tensors holds samples; everything that compares or draws outputs
//! must check which it has.

use crate::engine::trace::OpEvent;
use crate::tensor::Tensor;

/// Why a figure that needs every value of an output cannot be had from a sample.
pub const NEEDS_TENSORS: &str = "only a sample of the values was recorded: this needs the full tensors (`:save --tensors FILE`, `--record-tensors`)";

/// Values kept from the start and from the end of every output.
pub const SAMPLE_EDGE: usize = 8;
/// Evenly spaced values kept from the middle.
pub const SAMPLE_SPREAD: usize = 16;

/// Which elements of an output of `numel` values a sample holds, in increasing order: all of
/// them for a small tensor, else the first and last [`SAMPLE_EDGE`] and [`SAMPLE_SPREAD`]
/// evenly spaced ones between.
pub fn sample_indices(numel: usize) -> Vec<usize> {
    let full = 2 * SAMPLE_EDGE + SAMPLE_SPREAD;
    if numel <= full {
        return (0..numel).collect();
    }
    let mut idx: Vec<usize> = (0..SAMPLE_EDGE).collect();
    let (lo, hi) = (SAMPLE_EDGE, numel - SAMPLE_EDGE);
    for k in 0..SAMPLE_SPREAD {
        // In u128: a damaged file may claim an output of nearly usize::MAX values.
        let step = (hi - lo) as u128 * (2 * k + 1) as u128 / (2 * SAMPLE_SPREAD) as u128;
        idx.push(lo + step as usize);
    }
    idx.extend(hi..numel);
    idx
}

/// The sampled values of an output.
pub fn sample_of(values: &[f32]) -> Vec<f32> {
    sample_indices(values.len())
        .into_iter()
        .map(|i| values[i])
        .collect()
}

/// Whether `output` is only a sample of the values of op `event` (a replay without full
/// tensors), not the whole output.
pub fn is_sampled(event: &OpEvent, output: &Tensor) -> bool {
    !holds_all(&event.shape, output.numel())
}

/// Whether `len` values are all the values of a tensor of `shape` (false for a sample).
pub fn holds_all(shape: &[usize], len: usize) -> bool {
    numel(shape) == Some(len)
}

/// The number of elements of a tensor of `shape`; `None` when it does not fit a `usize` (a
/// damaged or hostile file).
pub fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_bounded_sorted_and_whole_when_small() {
        assert_eq!(sample_indices(5), vec![0, 1, 2, 3, 4]);
        assert_eq!(sample_indices(32).len(), 32);
        for n in [33, 100, 1 << 20, usize::MAX] {
            let idx = sample_indices(n);
            assert_eq!(idx.len(), 32);
            assert!(idx.windows(2).all(|w| w[0] < w[1]), "{idx:?}");
            assert_eq!(idx[0], 0);
            assert_eq!(*idx.last().unwrap(), n - 1);
        }
    }
}
