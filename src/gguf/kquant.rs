//! The K-quants: 256-value super-blocks split into sub-blocks of 16 or 32 values, each with its
//! own small integer scale (and, for the "min" variants, offset) under one f16 super-scale.
//!
//! | type | bytes | fields, in order | value |
//! |------|-------|------------------|-------|
//! | Q2_K | 84  | scales[16] (lo: scale, hi: min), q[64] 2-bit, f16 d, f16 dmin | d·sc·q − dmin·m |
//! | Q3_K | 110 | hmask[32], q[64] 2-bit, scales[12] 6-bit, f16 d | d·(sc−32)·(q − 4·!hbit) |
//! | Q4_K | 144 | f16 d, f16 dmin, scales[12] 6-bit sc/m ×8, q[128] 4-bit | d·sc·q − dmin·m |
//! | Q5_K | 176 | Q4_K fields, then qh[32] before q[128] | d·sc·(q + 16·hbit) − dmin·m |
//! | Q6_K | 210 | ql[128] 4-bit, qh[64] 2-bit, scales[16] i8, f16 d | d·sc·(q − 32) |
//!
//! Bit placement follows ggml's block structs. In every type the quant bytes are consumed in
//! 128-value halves (Q4_K/Q5_K: 64-value chunks) where one byte feeds several output runs of 32
//! through different shifts. Products are formed as ggml forms them ((d·sc)·q, then minus
//! dmin·m) so results are bit-identical to ggml's reference and gguf-py.
//!
//! The quantizers for Q4_K and Q6_K follow ggml's reference approach (a weighted least-squares
//! fit of each sub-block's scale, and min, tried over a small grid of candidate scales, then the
//! scales themselves quantized against the largest), with the arithmetic in the same order: on
//! Gaussian data they produce the same bytes as ggml's `quantize_row_q{4,6}_K_ref` built without
//! FMA contraction. Exact agreement is not promised (ggml builds with `-march=native` may fuse
//! multiply-adds), only error of the same size, which the tests check.

use super::quant::{f16_bytes, f16_le};

// ---- dequantization ----------------------------------------------------------------------

/// Q4_K/Q5_K 6-bit scale and min of sub-block `j` (0..8) from the 12 packed bytes: the first
/// four sub-blocks keep them whole in bytes 0..4 and 4..8 (low 6 bits); the last four keep the
/// low nibbles in bytes 8..12 and their top two bits in the spare high bits of bytes 0..8.
#[inline]
pub(crate) fn scale_min_k4(j: usize, s: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

fn arr<const N: usize>(b: &[u8]) -> &[u8; N] {
    b.try_into().expect("fixed-size field")
}

pub(crate) fn dequantize_q2_k(b: &[u8; 84], out: &mut [f32; 256]) {
    let scales = &b[0..16];
    let d = f16_le(b[80], b[81]);
    let dmin = f16_le(b[82], b[83]);
    // Each 128-value half reads its 32 quant bytes four times (shifts 0, 2, 4, 6); each pass
    // yields 32 values, bytes 0..16 under one scale byte and 16..32 under the next.
    for half in 0..2 {
        let q: &[u8; 32] = arr(&b[16 + 32 * half..48 + 32 * half]);
        for k in 0..4 {
            let shift = 2 * k;
            for run in 0..2 {
                let sc = scales[8 * half + 2 * k + run];
                let dl = d * (sc & 0xF) as f32;
                let ml = dmin * (sc >> 4) as f32;
                let o = 128 * half + 32 * k + 16 * run;
                let o: &mut [f32; 16] = (&mut out[o..o + 16]).try_into().unwrap();
                let q: &[u8; 16] = arr(&q[16 * run..16 * run + 16]);
                for (v, &q) in o.iter_mut().zip(q) {
                    *v = dl * ((q >> shift) & 3) as f32 - ml;
                }
            }
        }
    }
}

/// Q3_K 6-bit signed scales (stored +32): scale s takes its low nibble from byte s (s < 8) or
/// the high nibble of byte s−8, and its top two bits from byte 8 + s%4 at shift 2·(s/4).
fn scales_q3_k(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let lo = if i < 8 { s[i] & 0xF } else { s[i - 8] >> 4 };
        let hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        *o = ((lo | (hi << 4)) as i8).wrapping_sub(32);
    }
    out
}

pub(crate) fn dequantize_q3_k(b: &[u8; 110], out: &mut [f32; 256]) {
    let hmask: &[u8; 32] = arr(&b[0..32]);
    let scales = scales_q3_k(&b[96..108]);
    let d = f16_le(b[108], b[109]);
    // First the signed 3-bit codes: as in Q2_K the low two bits of pass k (0..4) of each
    // 128-value half are bits 2k..2k+2 of the half's 32 quant bytes; the third bit is bit
    // 4·half + k of the mask byte, and a clear bit subtracts 4. Then one scale per 16 values.
    // (Two simple passes: a single fully unrolled loop nest compiled to slow scalar code.)
    let mut codes = [0i8; 256];
    for (p, c) in codes.chunks_exact_mut(32).enumerate() {
        let (half, k) = (p / 4, p % 4);
        let q: &[u8; 32] = arr(&b[32 + 32 * half..64 + 32 * half]);
        let m = 1u8 << (4 * half + k);
        for ((c, &q), &h) in c.iter_mut().zip(q).zip(hmask) {
            *c = ((q >> (2 * k)) & 3) as i8 - ((((h & m) == 0) as i8) << 2);
        }
    }
    for ((o, c), &sc) in out
        .chunks_exact_mut(16)
        .zip(codes.chunks_exact(16))
        .zip(&scales)
    {
        let dl = d * sc as f32;
        for (v, &c) in o.iter_mut().zip(c) {
            *v = dl * c as f32;
        }
    }
}

pub(crate) fn dequantize_q4_k(b: &[u8; 144], out: &mut [f32; 256]) {
    let d = f16_le(b[0], b[1]);
    let dmin = f16_le(b[2], b[3]);
    let scales = arr::<12>(&b[4..16]);
    let qs = &b[16..144];
    for c in 0..4 {
        let q = &qs[32 * c..32 * c + 32];
        let (sc0, m0) = scale_min_k4(2 * c, scales);
        let (sc1, m1) = scale_min_k4(2 * c + 1, scales);
        let (d0, dm0) = (d * sc0 as f32, dmin * m0 as f32);
        let (d1, dm1) = (d * sc1 as f32, dmin * m1 as f32);
        let (lo, hi) = out[64 * c..64 * c + 64].split_at_mut(32);
        for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(q) {
            *l = d0 * (q & 0xF) as f32 - dm0;
            *h = d1 * (q >> 4) as f32 - dm1;
        }
    }
}

pub(crate) fn dequantize_q5_k(b: &[u8; 176], out: &mut [f32; 256]) {
    let d = f16_le(b[0], b[1]);
    let dmin = f16_le(b[2], b[3]);
    let scales = arr::<12>(&b[4..16]);
    let qh = &b[16..48];
    let qs = &b[48..176];
    for c in 0..4 {
        let q = &qs[32 * c..32 * c + 32];
        let (sc0, m0) = scale_min_k4(2 * c, scales);
        let (sc1, m1) = scale_min_k4(2 * c + 1, scales);
        let (d0, dm0) = (d * sc0 as f32, dmin * m0 as f32);
        let (d1, dm1) = (d * sc1 as f32, dmin * m1 as f32);
        let (lo, hi) = out[64 * c..64 * c + 64].split_at_mut(32);
        for (i, (l, h)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
            let h0 = ((qh[i] >> (2 * c)) & 1) << 4;
            let h1 = ((qh[i] >> (2 * c + 1)) & 1) << 4;
            *l = d0 * ((q[i] & 0xF) | h0) as f32 - dm0;
            *h = d1 * ((q[i] >> 4) | h1) as f32 - dm1;
        }
    }
}

pub(crate) fn dequantize_q6_k(b: &[u8; 210], out: &mut [f32; 256]) {
    let sc = &b[192..208];
    let d = f16_le(b[208], b[209]);
    // Each 128-value half has 64 low-nibble bytes and 32 high-bit bytes, read as four passes of
    // 32 values: pass p takes nibble p/2 of bytes 32·(p%2).., and bits 2p..2p+2 of the high
    // bytes; each 16 values of a pass have their own scale.
    for half in 0..2 {
        let ql: &[u8; 64] = arr(&b[64 * half..64 * half + 64]);
        let qh: &[u8; 32] = arr(&b[128 + 32 * half..160 + 32 * half]);
        for pass in 0..4 {
            let (nshift, hshift) = (4 * (pass / 2), 2 * pass);
            for part in 0..2 {
                let scale = d * (sc[8 * half + 2 * pass + part] as i8) as f32;
                let o = 128 * half + 32 * pass + 16 * part;
                let o: &mut [f32; 16] = (&mut out[o..o + 16]).try_into().unwrap();
                let lo = 32 * (pass % 2) + 16 * part;
                let l: &[u8; 16] = arr(&ql[lo..lo + 16]);
                let h: &[u8; 16] = arr(&qh[16 * part..16 * part + 16]);
                for ((v, &l), &h) in o.iter_mut().zip(l).zip(h) {
                    let q = ((l >> nshift) & 0xF) | (((h >> hshift) & 3) << 4);
                    *v = scale * (q as i32 - 32) as f32;
                }
            }
        }
    }
}

// ---- quantization ------------------------------------------------------------------------

/// Round to nearest, ties to even (what ggml's `nearest_int` does), as an i32; NaN gives 0.
#[inline]
fn nearest(x: f32) -> i32 {
    x.round_ties_even() as i32
}

/// Fits `x ≈ scale·q + min` with q in 0..=qmax and min ≤ 0, minimising Σ w·err². Starts from
/// the plain range mapping, then tries 21 candidate inverse scales from (qmax − 1)/range to
/// (qmax + 1)/range; for each, the codes it gives get their least-squares (scale, min), and the
/// best fit so far becomes the origin of the next candidates. Returns (scale, −min) and writes
/// the codes. (This is the search ggml's reference does; the arithmetic keeps its order so the
/// codes agree.)
fn fit_scale_min(x: &[f32], w: &[f32], qmax: u8, codes: &mut [u8]) -> (f32, f32) {
    let mut min = x.iter().fold(f32::INFINITY, |a, &v| a.min(v)).min(0.0);
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    if max <= min || !(max - min).is_finite() {
        // constant block (or non-finite input): the min carries everything
        codes.fill(0);
        return (0.0, if min.is_finite() { -min } else { 0.0 });
    }
    let n = qmax as f32;
    let (sum_w, sum_x) = x
        .iter()
        .zip(w)
        .fold((0f32, 0f32), |(sw, sx), (&v, &w)| (sw + w, sx + w * v));
    let code = |inv: f32, min: f32, v: f32| nearest(inv * (v - min)).clamp(0, qmax as i32) as u8;
    let error = |scale: f32, min: f32, codes: &[u8]| -> f32 {
        x.iter()
            .zip(w)
            .zip(codes)
            .fold(0f32, |acc, ((&v, &w), &q)| {
                let e = scale * q as f32 + min - v;
                acc + w * (e * e)
            })
    };

    let inv = n / (max - min);
    let mut scale = 1.0 / inv;
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = code(inv, min, v);
    }
    let mut best = error(scale, min, codes);
    let mut trial = [0u8; 32];
    let trial = &mut trial[..x.len()];
    for step in 0..=20 {
        let inv = (-1.0 + 0.1 * step as f32 + n) / (max - min);
        let (mut sl, mut sl2, mut sxl) = (0f32, 0f32, 0f32);
        for ((t, &v), &w) in trial.iter_mut().zip(x).zip(w) {
            *t = code(inv, min, v);
            let l = *t as f32;
            sl += w * l;
            sl2 += w * l * l;
            sxl += w * l * v;
        }
        let det = sum_w * sl2 - sl * sl;
        if det <= 0.0 {
            continue;
        }
        let mut s = (sum_w * sxl - sum_x * sl) / det;
        let mut m = (sl2 * sum_x - sl * sxl) / det;
        if m > 0.0 {
            // offsets are only subtracted: refit the scale alone through zero
            m = 0.0;
            s = sxl / sl2;
        }
        let e = error(s, m, trial);
        if e < best {
            best = e;
            scale = s;
            min = m;
            codes.copy_from_slice(trial);
        }
    }
    (scale, -min)
}

/// Q4_K: eight 32-value sub-blocks, each fitted as scale·q − min with 4-bit q, weights
/// rms(x) + |x| (favouring large values); the eight scales and mins are then stored as 6-bit
/// multiples of d = max scale / 63 and dmin = max min / 63, and the values re-coded against the
/// scales actually stored.
pub(crate) fn quantize_q4_k(x: &[f32], b: &mut [u8]) {
    let mut codes = [0u8; 256];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut w = [0f32; 32];
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let rms = (xs.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
        for (w, &v) in w.iter_mut().zip(xs) {
            *w = rms + v.abs();
        }
        (scales[j], mins[j]) = fit_scale_min(xs, &w, 15, &mut codes[32 * j..32 * j + 32]);
    }
    let max_scale = scales.iter().fold(0f32, |a, &v| a.max(v));
    let max_min = mins.iter().fold(0f32, |a, &v| a.max(v));
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    for j in 0..8 {
        let ls = nearest(inv_scale * scales[j]).clamp(0, 63) as u8;
        let lm = nearest(inv_min * mins[j]).clamp(0, 63) as u8;
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let d_bytes = f16_bytes(max_scale / 63.0);
    let dmin_bytes = f16_bytes(max_min / 63.0);
    let d = f16_le(d_bytes[0], d_bytes[1]);
    let dmin = f16_le(dmin_bytes[0], dmin_bytes[1]);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &packed);
        let ds = d * sc as f32;
        if ds == 0.0 {
            // keep the fitted codes: the sub-block is all offset (or zero)
            continue;
        }
        let dm = dmin * m as f32;
        for (c, &v) in codes[32 * j..32 * j + 32]
            .iter_mut()
            .zip(&x[32 * j..32 * j + 32])
        {
            *c = nearest((v + dm) / ds).clamp(0, 15) as u8;
        }
    }
    b[0..2].copy_from_slice(&d_bytes);
    b[2..4].copy_from_slice(&dmin_bytes);
    b[4..16].copy_from_slice(&packed);
    for c in 0..4 {
        for l in 0..32 {
            b[16 + 32 * c + l] = codes[64 * c + l] | (codes[64 * c + 32 + l] << 4);
        }
    }
}

/// Fits `x ≈ scale·q` with signed q in −32..=31, weights x² (so large values dominate):
/// tries 19 candidate inverse scales around the one mapping the largest magnitude to −32 and
/// keeps the least-squares scale of the best. Returns the (signed) scale.
fn fit_scale_signed(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < 1e-15 || !amax.is_finite() {
        return 0.0;
    }
    let fit = |inv: f32| {
        let (mut sxl, mut sl2) = (0f32, 0f32);
        for &v in x {
            let l = nearest(inv * v).clamp(-32, 31) as f32;
            let w = v * v;
            sxl += w * v * l;
            sl2 += w * l * l;
        }
        (sxl, sl2)
    };
    let (sxl, sl2) = fit(-32.0 / max);
    let mut scale = if sl2 > 0.0 { sxl / sl2 } else { 0.0 };
    // The fit's weighted error is Σw·x² − sxl²/sl2: maximise sxl²/sl2.
    let mut best = scale * sxl;
    for step in -9..=9 {
        if step == 0 {
            continue;
        }
        let (sxl, sl2) = fit(-(32.0 + 0.1 * step as f32) / max);
        if sl2 > 0.0 && sxl * sxl > best * sl2 {
            scale = sxl / sl2;
            best = scale * sxl;
        }
    }
    scale
}

/// Q6_K: sixteen 16-value sub-blocks with signed 6-bit codes; each sub-block's scale is fitted,
/// then all sixteen stored as i8 multiples of d = −(largest-magnitude scale)/128, and the
/// values re-coded against the stored scales.
pub(crate) fn quantize_q6_k(x: &[f32], b: &mut [u8]) {
    let mut scales = [0f32; 16];
    let (mut max_abs, mut max_scale) = (0f32, 0f32);
    for (j, s) in scales.iter_mut().enumerate() {
        *s = fit_scale_signed(&x[16 * j..16 * j + 16]);
        if s.abs() > max_abs {
            max_abs = s.abs();
            max_scale = *s;
        }
    }
    b.fill(0);
    if max_abs < 1e-15 {
        // all (near) zero: d = 0 and every code at the zero point q = 32 (high bits 0b10), so
        // the values come back as +0 (ggml zeroes the block, which decodes to −0)
        b[128..192].fill(0xAA);
        return;
    }
    let inv = -128.0 / max_scale;
    let d_bytes = f16_bytes(1.0 / inv);
    let d = f16_le(d_bytes[0], d_bytes[1]);
    let mut sc = [0i8; 16];
    for (q, &s) in sc.iter_mut().zip(&scales) {
        *q = nearest(inv * s).clamp(-128, 127) as i8;
    }
    let mut codes = [32u8; 256];
    for j in 0..16 {
        let ds = d * sc[j] as f32;
        if ds == 0.0 {
            continue;
        }
        for (c, &v) in codes[16 * j..16 * j + 16]
            .iter_mut()
            .zip(&x[16 * j..16 * j + 16])
        {
            *c = (nearest(v / ds).clamp(-32, 31) + 32) as u8;
        }
    }
    for half in 0..2 {
        let c = &codes[128 * half..128 * half + 128];
        for l in 0..32 {
            let (q0, q1, q2, q3) = (c[l], c[l + 32], c[l + 64], c[l + 96]);
            b[64 * half + l] = (q0 & 0xF) | ((q2 & 0xF) << 4);
            b[64 * half + l + 32] = (q1 & 0xF) | ((q3 & 0xF) << 4);
            b[128 + 32 * half + l] =
                (q0 >> 4) | ((q1 >> 4) << 2) | ((q2 >> 4) << 4) | ((q3 >> 4) << 6);
        }
    }
    for (o, &s) in b[192..208].iter_mut().zip(&sc) {
        *o = s as u8;
    }
    b[208..210].copy_from_slice(&d_bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_scale_packing_round_trips_every_6_bit_pair() {
        for (sc, m) in [(0u8, 0u8), (63, 63), (17, 42), (63, 0), (0, 63), (33, 31)] {
            for j in 0..8 {
                // pack only sub-block j, as the quantizer does
                let mut p = [0u8; 12];
                if j < 4 {
                    p[j] = sc;
                    p[j + 4] = m;
                } else {
                    p[j + 4] = (sc & 0xF) | ((m & 0xF) << 4);
                    p[j - 4] |= (sc >> 4) << 6;
                    p[j] |= (m >> 4) << 6;
                }
                assert_eq!(scale_min_k4(j, &p), (sc, m), "sub-block {j}");
            }
        }
    }

    #[test]
    fn q3_k_scales_unpack_each_field() {
        // scale 5 ← low nibble of byte 5, bits 4..6 of byte 9 (5 % 4 = 1, shift 2·(5/4) = 2)
        let mut s = [0u8; 12];
        s[5] = 0x0A;
        s[9] = 0b0000_1100;
        let sc = scales_q3_k(&s);
        assert_eq!(sc[5], (0x0A | (3 << 4)) - 32);
        assert_eq!(sc[0], -32);
        // scale 13 ← high nibble of byte 5, bits of byte 9 at shift 6
        s[9] = 0b1100_0000;
        let sc = scales_q3_k(&s);
        assert_eq!(sc[13], (3 << 4) - 32);
        assert_eq!(sc[5], 0x0A - 32);
        s[5] = 0xF0;
        assert_eq!(scales_q3_k(&s)[13], (0xF | (3 << 4)) - 32);
    }
}
