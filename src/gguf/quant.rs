//! ggml tensor types and their block formats: dequantization to f32 and the quantizers mladb
//! needs (Q8_0, Q4_0 matching ggml's reference bit for bit; Q4_K and Q6_K in [`super::kquant`]).
//!
//! A quantized tensor is a sequence of independent blocks, each holding `block_size` values in
//! `type_size` bytes; rows are whole blocks (ggml requires ne0 to be a multiple of the block
//! size). So a row range of a quantized matrix dequantizes on its own: slice its bytes and call
//! [`dequantize_into`], which is what the engine does for quantized matmuls.
//!
//! Arithmetic follows ggml's reference C (and gguf-py, which mirrors it) operation for
//! operation, in f32 and without fused multiply-adds, so results are bit-identical; the tests
//! compare against gguf-py's output.

use super::kquant;
use crate::error::{Error, Result};
use half::f16;
use rayon::prelude::*;
use std::fmt;

/// A ggml tensor type, with its numeric id as stored in GGUF files. The ids are not
/// contiguous: ggml removed some types (4, 5, 31–33, 36–38) and never reuses their ids.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
    NVFP4 = 40,
    Q1_0 = 41,
}

/// Values per super-block of the K-quants (ggml's `QK_K`).
pub const QK_K: usize = 256;

impl GgmlType {
    /// Every type mladb knows, in id order.
    pub const ALL: [GgmlType; 34] = {
        use GgmlType::*;
        [
            F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K,
            IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, I8, I16, I32, I64, F64,
            IQ1_M, BF16, TQ1_0, TQ2_0, MXFP4, NVFP4, Q1_0,
        ]
    };

    /// The types [`dequantize_into`] handles.
    pub const DEQUANTIZABLE: [GgmlType; 13] = {
        use GgmlType::*;
        [
            F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
        ]
    };

    /// The types [`quantize`] produces.
    pub const QUANTIZABLE: [GgmlType; 4] = [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ];

    /// The type with ggml id `id`; None for ids ggml never had or has removed.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.iter().copied().find(|t| t.id() == id)
    }

    /// The type named `name` as ggml spells it (`Q4_K`, `bf16`…; case-insensitive).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        GgmlType::ALL
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ2_XXS => "IQ2_XXS",
            IQ2_XS => "IQ2_XS",
            IQ3_XXS => "IQ3_XXS",
            IQ1_S => "IQ1_S",
            IQ4_NL => "IQ4_NL",
            IQ3_S => "IQ3_S",
            IQ2_S => "IQ2_S",
            IQ4_XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1_M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
            NVFP4 => "NVFP4",
            Q1_0 => "Q1_0",
        }
    }

    /// Values per block (1 for the plain float and integer types).
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4_NL | MXFP4 => 32,
            NVFP4 => 64,
            Q1_0 => 128,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S
            | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 => QK_K,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        use GgmlType::*;
        const K: usize = QK_K;
        match self {
            F32 | I32 => 4,
            F16 | BF16 | I16 => 2,
            I8 => 1,
            I64 | F64 => 8,
            Q4_0 => 2 + 16,
            Q4_1 => 2 + 2 + 16,
            Q5_0 => 2 + 4 + 16,
            Q5_1 => 2 + 2 + 4 + 16,
            Q8_0 => 2 + 32,
            Q8_1 => 4 + 4 + 32,
            Q2_K => 2 + 2 + K / 16 + K / 4,
            Q3_K => 2 + K / 4 + K / 8 + 12,
            Q4_K => 2 + 2 + K / 2 + 12,
            Q5_K => 2 + 2 + K / 2 + K / 8 + 12,
            Q6_K => 2 + K / 2 + K / 4 + K / 16,
            Q8_K => 4 + K + K / 8,
            IQ2_XXS => 2 + K / 4,
            IQ2_XS => 2 + K / 4 + K / 32,
            IQ3_XXS => 2 + K / 4 + K / 8,
            IQ1_S => 2 + K / 8 + K / 16,
            IQ4_NL => 2 + 16,
            IQ3_S => 2 + K / 4 + K / 8 + K / 32 + 4,
            IQ2_S => 2 + K / 4 + K / 16,
            IQ4_XS => 2 + 2 + K / 2 + K / 64,
            IQ1_M => K / 8 + K / 16 + K / 32,
            TQ1_0 => 2 + 4 * 13,
            TQ2_0 => 2 + 64,
            MXFP4 => 1 + 16,
            NVFP4 => 4 + 32,
            Q1_0 => 2 + 16,
        }
    }

    /// Whether [`dequantize_into`] handles this type.
    pub fn can_dequantize(self) -> bool {
        GgmlType::DEQUANTIZABLE.contains(&self)
    }

    /// Whether [`quantize`] produces this type.
    pub fn can_quantize(self) -> bool {
        GgmlType::QUANTIZABLE.contains(&self)
    }

    /// Bytes taken by `n` values, or None when `n` is not a whole number of blocks or the size
    /// overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.type_size() as u64)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Checks that `bytes` holds exactly the blocks for `n_values` values of `ty`.
fn check_sizes(ty: GgmlType, n_bytes: usize, n_values: usize) -> Result<()> {
    let bs = ty.block_size();
    if !n_values.is_multiple_of(bs) {
        return Err(Error::invalid(format!(
            "{ty}: {n_values} values is not a whole number of {bs}-value blocks"
        )));
    }
    let expected = (n_values / bs)
        .checked_mul(ty.type_size())
        .ok_or_else(|| Error::invalid(format!("{ty}: {n_values} values overflow a byte size")))?;
    if n_bytes != expected {
        return Err(Error::invalid(format!(
            "{ty}: {n_values} values take {expected} bytes, got {n_bytes}"
        )));
    }
    Ok(())
}

pub(crate) fn unsupported(ty: GgmlType, what: &str) -> Error {
    let list: Vec<&str> = match what {
        "quantization" => GgmlType::QUANTIZABLE.iter().map(|t| t.name()).collect(),
        _ => GgmlType::DEQUANTIZABLE.iter().map(|t| t.name()).collect(),
    };
    Error::invalid(format!(
        "{what} of ggml type {ty} is not supported by mladb (supported: {})",
        list.join(", ")
    ))
}

/// Dequantizes whole blocks of `ty` from `bytes` into `out`; `bytes` must hold exactly the
/// blocks of `out.len()` values. Runs on the calling thread: meant for a row range at a time.
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    if !ty.can_dequantize() {
        return Err(unsupported(ty, "dequantization"));
    }
    check_sizes(ty, bytes.len(), out.len())?;
    dequantize_blocks(ty, bytes, out);
    Ok(())
}

/// [`dequantize_into`] spread over rayon's threads in chunks of whole blocks (small inputs run
/// on the calling thread).
pub fn dequantize_into_par(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    if !ty.can_dequantize() {
        return Err(unsupported(ty, "dequantization"));
    }
    check_sizes(ty, bytes.len(), out.len())?;
    // ~256 KiB of output per task: large enough to amortise scheduling, small enough to
    // balance over a few cores.
    let blocks_per_task = (65536 / ty.block_size()).max(1);
    let (vals, bytes_per) = (
        blocks_per_task * ty.block_size(),
        blocks_per_task * ty.type_size(),
    );
    if out.len() <= vals {
        dequantize_blocks(ty, bytes, out);
        return Ok(());
    }
    out.par_chunks_mut(vals)
        .zip(bytes.par_chunks(bytes_per))
        .for_each(|(o, b)| dequantize_blocks(ty, b, o));
    Ok(())
}

/// Dequantizes `bytes` (a whole number of blocks) into a new vector.
pub fn dequantize(ty: GgmlType, bytes: &[u8]) -> Result<Vec<f32>> {
    let ts = ty.type_size();
    if !bytes.len().is_multiple_of(ts) {
        return Err(Error::invalid(format!(
            "{ty}: {} bytes is not a whole number of {ts}-byte blocks",
            bytes.len()
        )));
    }
    let n = (bytes.len() / ts)
        .checked_mul(ty.block_size())
        .ok_or_else(|| Error::invalid(format!("{ty}: value count overflows")))?;
    let mut out = vec![0f32; n];
    dequantize_into_par(ty, bytes, &mut out)?;
    Ok(out)
}

/// Quantizes `values` (a whole number of blocks) to `ty`, one of [`GgmlType::QUANTIZABLE`].
pub fn quantize(ty: GgmlType, values: &[f32]) -> Result<Vec<u8>> {
    if !ty.can_quantize() {
        return Err(unsupported(ty, "quantization"));
    }
    let bs = ty.block_size();
    if !values.len().is_multiple_of(bs) {
        return Err(Error::invalid(format!(
            "{ty} quantization: {} values is not a multiple of the block size {bs}",
            values.len()
        )));
    }
    let mut out = vec![0u8; values.len() / bs * ty.type_size()];
    let blocks = values
        .chunks_exact(bs)
        .zip(out.chunks_exact_mut(ty.type_size()));
    match ty {
        GgmlType::Q8_0 => blocks.for_each(|(x, b)| quantize_q8_0(x, b)),
        GgmlType::Q4_0 => blocks.for_each(|(x, b)| quantize_q4_0(x, b)),
        GgmlType::Q4_K => blocks.for_each(|(x, b)| kquant::quantize_q4_k(x, b)),
        GgmlType::Q6_K => blocks.for_each(|(x, b)| kquant::quantize_q6_k(x, b)),
        _ => unreachable!("checked by can_quantize"),
    }
    Ok(out)
}

/// Sizes already checked: whole blocks, matching lengths.
fn dequantize_blocks(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    use GgmlType::*;
    fn each<const B: usize, const T: usize>(
        bytes: &[u8],
        out: &mut [f32],
        f: impl Fn(&[u8; T], &mut [f32; B]),
    ) {
        for (b, o) in bytes.chunks_exact(T).zip(out.chunks_exact_mut(B)) {
            f(b.try_into().unwrap(), o.try_into().unwrap());
        }
    }
    match ty {
        F32 => {
            for (b, o) in bytes.chunks_exact(4).zip(out.iter_mut()) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        F16 => {
            // half's slice conversion checks the CPU once per call and uses F16C when present;
            // per-element `to_f32` pays that check every time (~3× slower).
            use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
            let mut bits = [0u16; 256];
            for (b, o) in bytes.chunks(512).zip(out.chunks_mut(256)) {
                for (d, s) in bits.iter_mut().zip(b.chunks_exact(2)) {
                    *d = u16::from_le_bytes([s[0], s[1]]);
                }
                bits[..o.len()]
                    .reinterpret_cast::<f16>()
                    .convert_to_f32_slice(o);
            }
        }
        BF16 => {
            for (b, o) in bytes.chunks_exact(2).zip(out.iter_mut()) {
                *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            }
        }
        Q8_0 => each::<32, 34>(bytes, out, dequantize_q8_0),
        Q4_0 => each::<32, 18>(bytes, out, dequantize_q4_0),
        Q4_1 => each::<32, 20>(bytes, out, dequantize_q4_1),
        Q5_0 => each::<32, 22>(bytes, out, dequantize_q5_0),
        Q5_1 => each::<32, 24>(bytes, out, dequantize_q5_1),
        Q2_K => each::<256, 84>(bytes, out, kquant::dequantize_q2_k),
        Q3_K => each::<256, 110>(bytes, out, kquant::dequantize_q3_k),
        Q4_K => each::<256, 144>(bytes, out, kquant::dequantize_q4_k),
        Q5_K => each::<256, 176>(bytes, out, kquant::dequantize_q5_k),
        Q6_K => each::<256, 210>(bytes, out, kquant::dequantize_q6_k),
        _ => unreachable!("checked by can_dequantize"),
    }
}

/// A little-endian f16 widened to f32 (exact).
#[inline]
pub(crate) fn f16_le(lo: u8, hi: u8) -> f32 {
    f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

/// f32 rounded to the nearest f16 (ties to even), little-endian: ggml's `GGML_FP32_TO_FP16`.
#[inline]
pub(crate) fn f16_bytes(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_bits().to_le_bytes()
}

// ---- the 32-value block types ------------------------------------------------------------
//
// Q8_0:  f16 d, i8 q[32]                       x = q·d
// Q4_0:  f16 d, nibbles[16]                    x = (q − 8)·d
// Q4_1:  f16 d, f16 m, nibbles[16]             x = q·d + m
// Q5_0:  f16 d, u32 high bits, nibbles[16]     x = (q − 16)·d
// Q5_1:  f16 d, f16 m, u32 high bits, nibbles  x = q·d + m
//
// Nibble byte i holds value i in its low half and value i + 16 in its high half; for the 5-bit
// types bit j of the little-endian u32 is the fifth bit of value j.

fn dequantize_q8_0(b: &[u8; 34], out: &mut [f32; 32]) {
    let d = f16_le(b[0], b[1]);
    for (o, &q) in out.iter_mut().zip(&b[2..]) {
        *o = (q as i8) as f32 * d;
    }
}

fn dequantize_q4_0(b: &[u8; 18], out: &mut [f32; 32]) {
    let d = f16_le(b[0], b[1]);
    let (lo, hi) = out.split_at_mut(16);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..]) {
        *l = ((q & 0xF) as i32 - 8) as f32 * d;
        *h = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

fn dequantize_q4_1(b: &[u8; 20], out: &mut [f32; 32]) {
    let d = f16_le(b[0], b[1]);
    let m = f16_le(b[2], b[3]);
    let (lo, hi) = out.split_at_mut(16);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[4..]) {
        *l = (q & 0xF) as f32 * d + m;
        *h = (q >> 4) as f32 * d + m;
    }
}

fn dequantize_q5_0(b: &[u8; 22], out: &mut [f32; 32]) {
    let d = f16_le(b[0], b[1]);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, &q) in b[6..].iter().enumerate() {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        out[j] = (((q & 0xF) as u32 | h0) as i32 - 16) as f32 * d;
        out[j + 16] = (((q >> 4) as u32 | h1) as i32 - 16) as f32 * d;
    }
}

fn dequantize_q5_1(b: &[u8; 24], out: &mut [f32; 32]) {
    let d = f16_le(b[0], b[1]);
    let m = f16_le(b[2], b[3]);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, &q) in b[8..].iter().enumerate() {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        out[j] = ((q & 0xF) as u32 | h0) as f32 * d + m;
        out[j + 16] = ((q >> 4) as u32 | h1) as f32 * d + m;
    }
}

/// ggml's reference Q8_0: d = max|x| / 127, q = round-half-away(x / d) computed as x·(1/d).
fn quantize_q8_0(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f16_bytes(d));
    for (q, &v) in b[2..].iter_mut().zip(x) {
        // f32::round rounds half away from zero, like C's roundf; `as` saturates (NaN → 0).
        *q = ((v * id).round() as i8) as u8;
    }
}

/// ggml's reference Q4_0: the value of largest magnitude (the first, on ties) maps to −8, so
/// d = that value / −8; q = min(15, trunc(x·(1/d) + 8.5)).
fn quantize_q4_0(x: &[f32], b: &mut [u8]) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f16_bytes(d));
    let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
    for j in 0..16 {
        b[2 + j] = q(x[j]) | (q(x[j + 16]) << 4);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_names_and_sizes_round_trip() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
            assert!(t.type_size() > 0 && t.block_size() > 0);
        }
        for removed in [4, 5, 31, 32, 33, 36, 37, 38, 42, u32::MAX] {
            assert_eq!(GgmlType::from_id(removed), None);
        }
        assert_eq!(GgmlType::Q4_K.type_size(), 144);
        assert_eq!(GgmlType::Q6_K.type_size(), 210);
        assert_eq!(GgmlType::Q5_K.type_size(), 176);
        assert_eq!(GgmlType::Q8_0.bytes_for(64), Some(68));
        assert_eq!(GgmlType::Q8_0.bytes_for(33), None);
        assert_eq!(GgmlType::F32.bytes_for(u64::MAX), None);
    }

    #[test]
    fn sizes_are_checked() {
        let mut out = vec![0f32; 32];
        let err = dequantize_into(GgmlType::Q8_0, &[0u8; 33], &mut out).unwrap_err();
        assert!(err.to_string().contains("take 34 bytes, got 33"), "{err}");
        let mut out = vec![0f32; 31];
        assert!(dequantize_into(GgmlType::Q8_0, &[0u8; 34], &mut out).is_err());
        let err = dequantize_into(GgmlType::IQ2_XXS, &[0u8; 66], &mut [0f32; 256]).unwrap_err();
        assert!(
            err.to_string().contains("IQ2_XXS is not supported"),
            "{err}"
        );
        let err = quantize(GgmlType::Q4_K, &[0f32; 255]).unwrap_err();
        assert!(err.to_string().contains("block size 256"), "{err}");
        assert!(quantize(GgmlType::Q5_K, &[0f32; 256]).is_err());
        assert!(dequantize(GgmlType::Q4_0, &[0u8; 19]).is_err());
    }

    #[test]
    fn q8_0_and_q4_0_hand_examples() {
        // d = 127/127 = 1: values round half away from zero.
        let mut x = [0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -2.5;
        x[3] = 0.49;
        let q = quantize(GgmlType::Q8_0, &x).unwrap();
        assert_eq!(&q[..2], &f16_bytes(1.0));
        assert_eq!(q[2..6], [127, 3, (-3i8) as u8, 0]);
        assert_eq!(
            dequantize(GgmlType::Q8_0, &q).unwrap()[..4],
            [127.0, 3.0, -3.0, 0.0]
        );

        // Largest magnitude −16 ⇒ d = 2, it maps to q = 0 (value −8·2 = −16).
        let mut x = [0f32; 32];
        x[0] = -16.0;
        x[17] = 14.0;
        let q = quantize(GgmlType::Q4_0, &x).unwrap();
        assert_eq!(&q[..2], &f16_bytes(2.0));
        let y = dequantize(GgmlType::Q4_0, &q).unwrap();
        assert_eq!((y[0], y[17], y[5]), (-16.0, 14.0, 0.0));

        // All zeros: d = 0, every q at the zero point.
        let q = quantize(GgmlType::Q4_0, &[0f32; 32]).unwrap();
        assert_eq!(&q[2..], &[0x88u8; 16]);
        assert!(dequantize(GgmlType::Q4_0, &q)
            .unwrap()
            .iter()
            .all(|&v| v == 0.0));
    }

    #[test]
    fn parallel_and_serial_dequantization_agree() {
        let n_blocks = 5000;
        let mut bytes = vec![0u8; n_blocks * 34];
        let mut s = 12345u32;
        for (i, b) in bytes.iter_mut().enumerate() {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            // keep d finite: the high byte of each f16 below the exponent of Inf/NaN
            *b = if i % 34 == 1 {
                (s >> 24) as u8 & 0x3B
            } else {
                (s >> 24) as u8
            };
        }
        let mut a = vec![0f32; n_blocks * 32];
        let mut b = vec![1f32; n_blocks * 32];
        dequantize_into(GgmlType::Q8_0, &bytes, &mut a).unwrap();
        dequantize_into_par(GgmlType::Q8_0, &bytes, &mut b).unwrap();
        assert_eq!(a, b);
    }
}
