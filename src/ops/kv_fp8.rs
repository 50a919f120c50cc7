//! The FP8 latent cache format that DeepSeek-V3.2-style sparse attention (GLM-5's DSA) serves
//! with (`fp8_ds_mla` in vLLM): 656 bytes per token. The 512 latent (NoPE) values are stored as
//! OCP E4M3 in four tiles of 128, each tile scaled by its own f32 `amax / 448` (never below the
//! smallest normal f32), then the four scales, then the 64 RoPE values in bf16, unscaled:
//!
//! | bytes      | what                                  |
//! |------------|---------------------------------------|
//! | 0..512     | latent values / their tile's scale, E4M3 |
//! | 512..528   | the four tile scales, f32 little-endian |
//! | 528..656   | the RoPE values, bf16 little-endian     |
//!
//! This is the CPU codec, the reference a device write kernel and the decode kernels reading the
//! format are held to.

use crate::error::{Error, Result};

/// Latent values per token.
pub const LATENT: usize = 512;
/// RoPE values per token.
pub const ROPE: usize = 64;
/// Latent values sharing one scale.
pub const TILE: usize = 128;
/// Bytes per token.
pub const TOKEN_BYTES: usize = LATENT + 4 * (LATENT / TILE) + 2 * ROPE;
/// The largest finite E4M3 value; a tile's largest magnitude maps onto it.
pub const E4M3_MAX: f32 = 448.0;

const SCALES_AT: usize = LATENT;
const ROPE_AT: usize = LATENT + 4 * (LATENT / TILE);

/// The E4M3 byte nearest `x` (ties to even), saturating at ±448; NaN becomes the NaN pattern.
pub fn e4m3_from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    // Subnormals are multiples of 2^-9 below 2^-6; normals have 3 mantissa bits, so the step
    // is 2^(e-3) for a value in [2^e, 2^(e+1)).
    let exp = if a < 2f32.powi(-6) {
        -6
    } else {
        a.log2().floor() as i32
    };
    let step = 2f32.powi(exp - 3);
    let q = a / step;
    let mut m = q.floor();
    let frac = q - m;
    if frac > 0.5 || (frac == 0.5 && m % 2.0 == 1.0) {
        m += 1.0;
    }
    let rounded = m * step;
    if rounded >= E4M3_MAX {
        return sign | 0x7E;
    }
    if rounded < 2f32.powi(-6) {
        // Subnormal: exponent field 0, mantissa in units of 2^-9.
        return sign | (rounded / 2f32.powi(-9)) as u8;
    }
    // Recompute the exponent: rounding may have carried into the next power of two.
    let e = rounded.log2().floor() as i32;
    let mantissa = (rounded / 2f32.powi(e) - 1.0) * 8.0;
    sign | (((e + 7) as u8) << 3) | mantissa as u8
}

/// The value of an E4M3 byte (0x7F and 0xFF are NaN; there are no infinities): the decoder the
/// FP8 checkpoint loader uses.
pub use crate::model::weights::safetensors::fp8_e4m3_to_f32 as e4m3_to_f32;

/// The scale of a tile: its largest magnitude over 448, at least the smallest normal f32 (so an
/// all-zero tile still divides).
pub fn tile_scale(tile: &[f32]) -> f32 {
    let amax = tile.iter().fold(0f32, |m, v| m.max(v.abs()));
    (amax / E4M3_MAX).max(f32::MIN_POSITIVE)
}

/// Writes one token's latent and RoPE values into `out` (`TOKEN_BYTES` long) in the format.
pub fn encode_token(latent: &[f32], rope: &[f32], out: &mut [u8]) -> Result<()> {
    check(
        latent.len() == LATENT && rope.len() == ROPE && out.len() == TOKEN_BYTES,
        || {
            format!(
            "fp8_ds_mla: a token is {LATENT} latent and {ROPE} RoPE values into {TOKEN_BYTES} bytes, not {} and {} into {}",
            latent.len(),
            rope.len(),
            out.len()
        )
        },
    )?;
    for (t, tile) in latent.chunks(TILE).enumerate() {
        let scale = tile_scale(tile);
        for (i, &v) in tile.iter().enumerate() {
            out[t * TILE + i] = e4m3_from_f32(v / scale);
        }
        out[SCALES_AT + 4 * t..SCALES_AT + 4 * t + 4].copy_from_slice(&scale.to_le_bytes());
    }
    for (i, &v) in rope.iter().enumerate() {
        let bits = half::bf16::from_f32(v).to_bits().to_le_bytes();
        out[ROPE_AT + 2 * i..ROPE_AT + 2 * i + 2].copy_from_slice(&bits);
    }
    Ok(())
}

/// Reads one token back: its latent values (each E4M3 value times its tile's scale) and RoPE
/// values.
pub fn decode_token(bytes: &[u8], latent: &mut [f32], rope: &mut [f32]) -> Result<()> {
    check(
        bytes.len() == TOKEN_BYTES && latent.len() == LATENT && rope.len() == ROPE,
        || {
            format!(
            "fp8_ds_mla: a token is {TOKEN_BYTES} bytes into {LATENT} latent and {ROPE} RoPE values, not {} into {} and {}",
            bytes.len(),
            latent.len(),
            rope.len()
        )
        },
    )?;
    for (t, tile) in latent.chunks_mut(TILE).enumerate() {
        let at = SCALES_AT + 4 * t;
        let scale = f32::from_le_bytes(bytes[at..at + 4].try_into().expect("four bytes"));
        for (i, v) in tile.iter_mut().enumerate() {
            *v = e4m3_to_f32(bytes[t * TILE + i]) * scale;
        }
    }
    for (i, v) in rope.iter_mut().enumerate() {
        let at = ROPE_AT + 2 * i;
        *v = half::bf16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32();
    }
    Ok(())
}

fn check(ok: bool, why: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(why()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite E4M3 value, in increasing order, with its byte.
    fn finite_values() -> Vec<(f32, u8)> {
        let mut v: Vec<(f32, u8)> = (0..=255u8)
            .filter(|&b| !e4m3_to_f32(b).is_nan() && b != 0x80)
            .map(|b| (e4m3_to_f32(b), b))
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    }

    #[test]
    fn the_decoder_reads_the_ends_of_the_range() {
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
        assert_eq!(finite_values().len(), 253, "254 finite bytes, -0 left out");
    }

    #[test]
    fn every_value_round_trips_and_midpoints_round_to_even() {
        let values = finite_values();
        for &(v, b) in &values {
            assert_eq!(e4m3_from_f32(v), b, "{v}");
        }
        for pair in values.windows(2) {
            let ((lo, lb), (hi, hb)) = (pair[0], pair[1]);
            let mid = (lo + hi) / 2.0;
            let even = if lb & 1 == 0 { lb } else { hb };
            // Compared as values: a negative value rounding to zero gives -0 (0x80).
            let value = |x: f32| e4m3_to_f32(e4m3_from_f32(x));
            assert_eq!(value(mid), e4m3_to_f32(even), "midpoint of {lo} and {hi}");
            let below = f32::from_bits(mid.to_bits() - 1);
            let above = f32::from_bits(mid.to_bits() + 1);
            let (nearer_lo, nearer_hi) = if mid > 0.0 {
                (below, above)
            } else {
                (above, below)
            };
            assert_eq!(value(nearer_lo), lo, "just past {lo} toward {hi}");
            assert_eq!(value(nearer_hi), hi, "just before {hi} from {lo}");
        }
    }

    #[test]
    fn out_of_range_saturates_and_nan_stays_nan() {
        assert_eq!(e4m3_from_f32(1e9), 0x7E);
        assert_eq!(e4m3_from_f32(-464.0), 0xFE);
        assert_eq!(e4m3_from_f32(f32::INFINITY), 0x7E);
        assert!(e4m3_to_f32(e4m3_from_f32(f32::NAN)).is_nan());
        assert_eq!(
            e4m3_from_f32(2f32.powi(-11)),
            0,
            "below half the smallest subnormal"
        );
    }

    fn token(seed: u64) -> (Vec<f32>, Vec<f32>) {
        let key = crate::model::weights::synthetic::tensor_key(seed, "token");
        let v = |i: usize| crate::model::weights::synthetic::normalish(key, i as u64);
        // Tiles of very different magnitudes, as a latent has.
        let latent = (0..LATENT)
            .map(|i| v(i) * [1.0, 30.0, 1e-3, 0.2][i / TILE])
            .collect();
        let rope = (0..ROPE).map(|i| v(LATENT + i)).collect();
        (latent, rope)
    }

    #[test]
    fn a_token_decodes_within_what_e4m3_explains_and_lies_where_the_format_says() {
        for seed in 0..8 {
            let (latent, rope) = token(seed);
            let mut bytes = vec![0u8; TOKEN_BYTES];
            encode_token(&latent, &rope, &mut bytes).unwrap();
            let (mut l2, mut r2) = (vec![0f32; LATENT], vec![0f32; ROPE]);
            decode_token(&bytes, &mut l2, &mut r2).unwrap();
            for t in 0..LATENT / TILE {
                let tile = &latent[t * TILE..(t + 1) * TILE];
                let scale = tile_scale(tile);
                let at = SCALES_AT + 4 * t;
                assert_eq!(bytes[at..at + 4], scale.to_le_bytes(), "scale of tile {t}");
                for (i, (&a, &b)) in tile.iter().zip(&l2[t * TILE..]).enumerate() {
                    // Half a step of the E4M3 value: 2^-4 relative for normals, 2^-10 of the
                    // scale for subnormals.
                    let bound = (a.abs() / 16.0).max(scale * 2f32.powi(-10)) * 1.0001;
                    assert!((a - b).abs() <= bound, "tile {t} value {i}: {a} vs {b}");
                }
                let largest = tile.iter().fold(0f32, |m, v| m.max(v.abs()));
                let decoded = l2[t * TILE..(t + 1) * TILE]
                    .iter()
                    .fold(0f32, |m, v| m.max(v.abs()));
                assert!(
                    (largest - decoded).abs() <= largest * 1e-6,
                    "the tile's amax is exact"
                );
            }
            for (a, b) in rope.iter().zip(&r2) {
                assert_eq!(*b, half::bf16::from_f32(*a).to_f32());
            }
        }
    }

    #[test]
    fn an_all_zero_tile_keeps_a_usable_scale() {
        let latent = vec![0f32; LATENT];
        let rope = vec![0f32; ROPE];
        let mut bytes = vec![0xAAu8; TOKEN_BYTES];
        encode_token(&latent, &rope, &mut bytes).unwrap();
        let (mut l2, mut r2) = (vec![1f32; LATENT], vec![1f32; ROPE]);
        decode_token(&bytes, &mut l2, &mut r2).unwrap();
        assert!(l2.iter().chain(&r2).all(|&v| v == 0.0));
        assert_eq!(
            bytes[SCALES_AT..SCALES_AT + 4],
            f32::MIN_POSITIVE.to_le_bytes()
        );
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let mut bytes = vec![0u8; TOKEN_BYTES];
        assert!(encode_token(&[0.0; 10], &[0.0; ROPE], &mut bytes).is_err());
        assert!(decode_token(&bytes[1..], &mut [0.0; LATENT], &mut [0.0; ROPE]).is_err());
    }
}
