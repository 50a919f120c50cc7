//! Block-scaled FP8 as DeepSeek-V3's and GLM-5's official FP8 checkpoints store a projection:
//! each block of 128×128 weights (fewer at the matrix's edges) gets the scale s = amax / 448,
//! stored as `weight_scale_inv` (the loader multiplies by it), and each weight becomes the E4M3
//! byte nearest w / s.

use crate::model::weights::safetensors::fp8_e4m3_to_f32;
use rayon::prelude::*;

/// The largest finite E4M3 ("fn") magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// The E4M3 byte nearest `x`, ties to even (as a hardware or torch cast rounds), saturating at
/// ±448; NaN becomes 0x7F. Bit arithmetic rather than logarithms: an export rounds billions.
pub fn e4m3_from_f32(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let magnitude = bits & 0x7FFF_FFFF;
    if magnitude > 0x7F80_0000 {
        return 0x7F;
    }
    // 464 lies halfway between 448 and the 480 E4M3 lacks: from there on, saturate.
    if f32::from_bits(magnitude) >= 464.0 {
        return sign | 0x7E;
    }
    // Below 2^-6 E4M3 is subnormal, in steps of 2^-9. Adding 2^14 (whose f32 ulp is exactly
    // 2^-9) lets the FPU round to that grid; the low bits are then the count of steps, and a
    // count of 8 is the smallest normal's encoding (exponent 1, mantissa 0) as it should be.
    if magnitude < 121 << 23 {
        let shifted = f32::from_bits(magnitude) + 16384.0;
        return sign | (shifted.to_bits() - (141 << 23)) as u8;
    }
    // Normal: rebias the exponent (127 → 7) and round the 23-bit mantissa to 3 bits, ties to
    // even: add just under half a unit of the kept last bit, plus that bit.
    let odd = (magnitude >> 20) & 1;
    let rounded = magnitude
        .wrapping_sub(120 << 23)
        .wrapping_add(0x7_FFFF + odd);
    sign | (rounded >> 20) as u8
}

/// The scale of a block: its largest magnitude over 448. An all-zero block takes 1 (any scale
/// decodes its zeros exactly, and a zero scale would divide by zero).
pub fn block_scale(amax: f32) -> f32 {
    if amax > 0.0 {
        amax / E4M3_MAX
    } else {
        1.0
    }
}

/// Quantizes one band of up to `block[0]` rows × `cols` values: the E4M3 bytes into `bytes`
/// (the band's length) and the band's scales, one per `block[1]` columns, into `scales`.
pub fn quantize_band(values: &[f32], cols: usize, block_cols: usize, bytes: &mut [u8]) -> Vec<f32> {
    let blocks = cols.div_ceil(block_cols);
    let scales: Vec<f32> = (0..blocks)
        .into_par_iter()
        .map(|b| {
            let (c0, c1) = (b * block_cols, ((b + 1) * block_cols).min(cols));
            let amax = values
                .chunks_exact(cols)
                .flat_map(|row| row[c0..c1].iter())
                .fold(0f32, |m, v| m.max(v.abs()));
            block_scale(amax)
        })
        .collect();
    bytes
        .par_chunks_mut(cols)
        .zip(values.par_chunks(cols))
        .for_each(|(out, row)| {
            for (c, (o, &v)) in out.iter_mut().zip(row).enumerate() {
                *o = e4m3_from_f32(v / scales[c / block_cols]);
            }
        });
    scales
}

/// What the loader reads back for one quantized band: byte × its block's scale (the loader's
/// own decoder, through a table of its 256 values).
pub fn dequantize_band(bytes: &[u8], cols: usize, block_cols: usize, scales: &[f32]) -> Vec<f32> {
    let table: [f32; 256] = std::array::from_fn(|b| fp8_e4m3_to_f32(b as u8));
    let mut out = vec![0f32; bytes.len()];
    out.par_chunks_mut(cols)
        .zip(bytes.par_chunks(cols))
        .for_each(|(o, row)| {
            for (c, (v, &b)) in o.iter_mut().zip(row).enumerate() {
                *v = table[b as usize] * scales[c / block_cols];
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite code's value, for brute-force nearest searches.
    fn codes() -> Vec<(u8, f32)> {
        (0u8..=255)
            .map(|b| (b, fp8_e4m3_to_f32(b)))
            .filter(|(_, v)| v.is_finite())
            .collect()
    }

    /// The nearest code by search: the smaller distance, then the even mantissa.
    fn nearest(x: f32, codes: &[(u8, f32)]) -> f32 {
        let x = x.clamp(-E4M3_MAX, E4M3_MAX);
        let mut best = (f32::INFINITY, 0u8, 0f32);
        for &(b, v) in codes {
            let d = (v - x).abs();
            if d < best.0 || (d == best.0 && b & 1 == 0 && best.1 & 1 == 1) {
                best = (d, b, v);
            }
        }
        best.2
    }

    #[test]
    fn rounding_is_to_the_nearest_code_ties_to_even() {
        let codes = codes();
        let mut xs: Vec<f32> = Vec::new();
        // Every code, every midpoint between neighbours and values just beside them.
        let mut values: Vec<f32> = codes.iter().map(|c| c.1).filter(|v| *v >= 0.0).collect();
        values.sort_by(f32::total_cmp);
        values.dedup();
        for w in values.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            xs.extend([w[0], mid, mid.next_up(), mid.next_down()]);
        }
        // A sweep over the whole range, from below the smallest subnormal to past saturation.
        let mut x = 1e-5f32;
        while x < 600.0 {
            xs.push(x);
            x *= 1.0037;
        }
        xs.extend([0.0, 448.0, 463.9, 464.0, 1e6, f32::INFINITY]);
        for &x in &xs {
            for x in [x, -x] {
                let got = fp8_e4m3_to_f32(e4m3_from_f32(x));
                let want = nearest(x, &codes);
                assert!(
                    got == want && got.is_sign_negative() == x.is_sign_negative(),
                    "{x:e}: got {got:e}, want {want:e}"
                );
            }
        }
        assert_eq!(e4m3_from_f32(f32::NAN), 0x7F);
    }

    #[test]
    fn a_band_decodes_within_half_a_step_of_its_block() {
        // 3 rows × 5 columns in blocks of 2 columns: the last block is one column wide.
        let values = [
            0.5, -1.0, 3.0, 0.25, 0.0, //
            -0.75, 0.125, -6.0, 1.5, 0.0, //
            0.0625, 2.0, 0.5, -0.5, 0.0,
        ];
        let mut bytes = vec![0u8; values.len()];
        let scales = quantize_band(&values, 5, 2, &mut bytes);
        assert_eq!(scales, vec![2.0 / 448.0, 6.0 / 448.0, 1.0]);
        let back = dequantize_band(&bytes, 5, 2, &scales);
        for (i, (&v, &b)) in values.iter().zip(&back).enumerate() {
            let s = scales[(i % 5) / 2];
            // 3 mantissa bits: within 1/16 relative, or a subnormal step of s·2^-9.
            assert!(
                (v - b).abs() <= (v.abs() / 16.0).max(s * 2f32.powi(-10)),
                "{v} {b}"
            );
        }
        // A block's largest magnitude becomes the code 448, another value its nearest code.
        assert_eq!(bytes[7], 0x80 | 0x7E);
        assert_eq!(back[7], -448.0 * scales[1]);
        assert_eq!(back[1], -224.0 * scales[0]);
        assert!(back[4..].iter().step_by(5).all(|v| *v == 0.0));
    }
}
