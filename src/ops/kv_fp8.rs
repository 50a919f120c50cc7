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
use serde::{Deserialize, Serialize};
use std::fmt;

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

/// How the latent cache stores a token: bf16 rows (576 values), or `fp8_ds_mla` (656 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvCacheDtype {
    #[default]
    Bf16,
    Fp8DsMla,
}

impl KvCacheDtype {
    /// The flag's spelling (`bf16`, `fp8_ds_mla`).
    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Bf16 => "bf16",
            KvCacheDtype::Fp8DsMla => "fp8_ds_mla",
        }
    }

    /// Whether a layout's latent rows (`latent` c_kv values and `rope` k_pe values) fit this
    /// format: fp8_ds_mla is laid out for 512 + 64 alone.
    pub fn check_layout(self, latent: usize, rope: usize) -> Result<()> {
        if self == KvCacheDtype::Fp8DsMla && (latent, rope) != (LATENT, ROPE) {
            return Err(Error::invalid(format!(
                "kv-cache-dtype fp8_ds_mla needs kv_lora_rank {LATENT} and qk_rope_head_dim \
                 {ROPE} (this layout: {latent}+{rope})"
            )));
        }
        Ok(())
    }
}

impl std::str::FromStr for KvCacheDtype {
    type Err = Error;
    fn from_str(s: &str) -> Result<KvCacheDtype> {
        match s {
            "bf16" => Ok(KvCacheDtype::Bf16),
            "fp8_ds_mla" => Ok(KvCacheDtype::Fp8DsMla),
            other => Err(Error::invalid(format!(
                "kv-cache-dtype '{other}' is not bf16 or fp8_ds_mla"
            ))),
        }
    }
}

impl fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Faults of the codec's tile scale (`fp8-scale-default`, `fp8-amax-padded-rows`), carried out
/// identically by the CPU codec and the device write kernel.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Fp8Faults {
    /// Every tile scale left at 1.0, as if the loader step that sets them never ran.
    pub scale_default: bool,
    /// The tile's amax taken over padding as well: at least [`PADDING_AMAX`].
    pub amax_padded: bool,
}

impl Fp8Faults {
    /// The faults as the write kernel's `faults` argument: bit 0 and bit 1.
    pub fn bits(self) -> u32 {
        u32::from(self.scale_default) | u32::from(self.amax_padded) << 1
    }
}

/// What `fp8-amax-padded-rows` finds in the padding its amax wrongly covers: stale values far
/// above any normalised latent, so every real value of the tile is crushed toward zero.
pub const PADDING_AMAX: f32 = 1.0e4;

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
    tile_scale_with(tile, Fp8Faults::default())
}

/// [`tile_scale`] with the scale faults planted.
pub fn tile_scale_with(tile: &[f32], faults: Fp8Faults) -> f32 {
    if faults.scale_default {
        return 1.0;
    }
    let mut amax = tile.iter().fold(0f32, |m, v| m.max(v.abs()));
    if faults.amax_padded {
        amax = amax.max(PADDING_AMAX);
    }
    (amax / E4M3_MAX).max(f32::MIN_POSITIVE)
}

/// Writes one token's latent and RoPE values into `out` (`TOKEN_BYTES` long) in the format.
pub fn encode_token(latent: &[f32], rope: &[f32], out: &mut [u8]) -> Result<()> {
    encode_token_with(latent, rope, out, Fp8Faults::default())
}

/// A latent-cache row (latent then RoPE values) as the format gives it back: encoded with
/// `faults`, then decoded. What an attention kernel reading an fp8_ds_mla cache sees.
pub fn round_trip(row: &[f32], faults: Fp8Faults) -> Result<Vec<f32>> {
    check(row.len() == LATENT + ROPE, || {
        format!(
            "fp8_ds_mla: a row is {} values, not {}",
            LATENT + ROPE,
            row.len()
        )
    })?;
    let mut bytes = [0u8; TOKEN_BYTES];
    encode_token_with(&row[..LATENT], &row[LATENT..], &mut bytes, faults)?;
    let mut out = vec![0f32; LATENT + ROPE];
    let (latent, rope) = out.split_at_mut(LATENT);
    decode_token(&bytes, latent, rope)?;
    Ok(out)
}

/// [`encode_token`] with the scale faults planted.
pub fn encode_token_with(
    latent: &[f32],
    rope: &[f32],
    out: &mut [u8],
    faults: Fp8Faults,
) -> Result<()> {
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
        let scale = tile_scale_with(tile, faults);
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
    fn the_scale_faults_crush_or_clamp_and_round_trip_is_encode_then_decode() {
        let (latent, rope) = token(3);
        let row: Vec<f32> = latent.iter().chain(&rope).copied().collect();
        let clean = round_trip(&row, Fp8Faults::default()).unwrap();
        let mut bytes = vec![0u8; TOKEN_BYTES];
        encode_token(&latent, &rope, &mut bytes).unwrap();
        let (mut l2, mut r2) = (vec![0f32; LATENT], vec![0f32; ROPE]);
        decode_token(&bytes, &mut l2, &mut r2).unwrap();
        assert_eq!(clean, [l2, r2].concat());
        let worst = |faults: Fp8Faults, t: usize| {
            let got = round_trip(&row, faults).unwrap();
            (t * TILE..(t + 1) * TILE)
                .map(|i| (got[i] - row[i]).abs() / row[i].abs().max(1e-30))
                .fold(0f32, f32::max)
        };
        // Scale 1.0: the 1e-3 tile falls among the subnormals (steps of 2^-9); 30 stays normal.
        let one = Fp8Faults {
            scale_default: true,
            ..Fp8Faults::default()
        };
        assert!(worst(one, 2) > 0.5, "{}", worst(one, 2));
        assert!(worst(one, 1) <= 1.0 / 16.0 + 1e-6);
        assert_eq!(tile_scale_with(&latent[..TILE], one), 1.0);
        // Padding in the amax: the unit tile is crushed too.
        let padded = Fp8Faults {
            amax_padded: true,
            ..Fp8Faults::default()
        };
        assert!(worst(padded, 0) > 0.5, "{}", worst(padded, 0));
        assert_eq!(
            tile_scale_with(&latent[..TILE], padded),
            PADDING_AMAX / E4M3_MAX
        );
        assert!(worst(Fp8Faults::default(), 2) <= 1.0 / 16.0 + 1e-6);
        // The RoPE values are untouched by either.
        let both = Fp8Faults {
            scale_default: true,
            amax_padded: true,
        };
        assert_eq!(both.bits(), 3);
        assert_eq!(round_trip(&row, both).unwrap()[LATENT..], clean[LATENT..]);
    }

    #[test]
    fn the_cache_dtype_parses_and_needs_the_glm5_layout() {
        for d in [KvCacheDtype::Bf16, KvCacheDtype::Fp8DsMla] {
            assert_eq!(d.name().parse::<KvCacheDtype>().unwrap(), d);
        }
        assert!("fp8".parse::<KvCacheDtype>().is_err());
        assert!(KvCacheDtype::Fp8DsMla.check_layout(512, 64).is_ok());
        assert!(KvCacheDtype::Bf16.check_layout(64, 32).is_ok());
        let err = KvCacheDtype::Fp8DsMla
            .check_layout(64, 32)
            .unwrap_err()
            .to_string();
        assert!(err.contains("(this layout: 64+32)"), "{err}");
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let mut bytes = vec![0u8; TOKEN_BYTES];
        assert!(encode_token(&[0.0; 10], &[0.0; ROPE], &mut bytes).is_err());
        assert!(decode_token(&bytes[1..], &mut [0.0; LATENT], &mut [0.0; ROPE]).is_err());
    }
}
