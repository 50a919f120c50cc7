//! The CPU matrix product: y = x·Wᵀ with W stored [out, in] (the layout of HF linear weights),
//! so every output element is a dot product of two contiguous rows.

use rayon::prelude::*;

/// Dot product with eight independent accumulators: vectorises without reassociating, and is
/// more accurate than one running sum.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// acc += a·x over a slice.
#[inline]
pub fn axpy(acc: &mut [f32], a: f32, x: &[f32]) {
    for (o, v) in acc.iter_mut().zip(x) {
        *o += a * v;
    }
}

/// y [n, out] = x [n, k] · wᵀ, w [out, k]. Work is split over blocks of output features so that
/// each weight row is read once for all tokens.
pub fn matmul_t(x: &[f32], n: usize, k: usize, w: &[f32], out: usize) -> Vec<f32> {
    debug_assert_eq!(x.len(), n * k);
    debug_assert_eq!(w.len(), out * k);
    // Transposed result [out, n]: each parallel block owns a contiguous range of it.
    let mut yt = vec![0f32; out * n];
    let block = (out / (rayon::current_num_threads() * 8)).clamp(16, 1024);
    let work = out * n * k;
    let kernel = |(b, chunk): (usize, &mut [f32])| {
        let first = b * block;
        for (r, ys) in chunk.chunks_mut(n).enumerate() {
            let wr = &w[(first + r) * k..(first + r + 1) * k];
            for (i, y) in ys.iter_mut().enumerate() {
                *y = dot(&x[i * k..(i + 1) * k], wr);
            }
        }
    };
    if work < 1 << 16 {
        yt.chunks_mut(block * n).enumerate().for_each(kernel);
    } else {
        yt.par_chunks_mut(block * n).enumerate().for_each(kernel);
    }
    if n == 1 {
        return yt;
    }
    let mut y = vec![0f32; n * out];
    for o in 0..out {
        for i in 0..n {
            y[i * out + o] = yt[o * n + i];
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_matches_the_definition_in_f64() {
        let (n, k, out) = (5, 37, 300);
        let x: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let w: Vec<f32> = (0..out * k)
            .map(|i| ((i * 104729) % 97) as f32 / 48.0 - 1.0)
            .collect();
        let y = matmul_t(&x, n, k, &w, out);
        for i in 0..n {
            for o in 0..out {
                let r: f64 = (0..k)
                    .map(|j| x[i * k + j] as f64 * w[o * k + j] as f64)
                    .sum();
                assert!((y[i * out + o] as f64 - r).abs() < 1e-4, "({i},{o})");
            }
        }
    }
}
