//! Quantized weights as the engine sees them: a matrix of ggml blocks ([`QuantTensor`]), the
//! `--quant TYPE` wrapper that quantizes any weight source at load exactly as a GGUF file would
//! hold it ([`QuantizedSource`]), and the two ways an MLA backend turns a quantized kv_b_proj
//! into W_UK / W_UV:
//!
//! - through the quantized linear layer: push an identity matrix I_L through it, which yields
//!   Wᵀ (what vLLM's `get_and_maybe_dequant_weights` does for a quantized kv_b_proj);
//! - force-dequantize: decode the blocks once into a plain weight.
//!
//! FAULT q4k-scale-unpack lives here too ([`dequantize_with`]): Q4_K sub-blocks 4..7 decoded
//! with the 6-bit scale/min unpacking of sub-blocks 0..3.

use super::weights::WeightSource;
use crate::error::{Error, Result};
use crate::gguf::GgmlType;
use half::f16;
use rayon::prelude::*;
use std::sync::Arc;

/// A row-major matrix [rows, cols] stored as ggml blocks; every row is a whole number of blocks.
#[derive(Clone)]
pub struct QuantTensor {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    bytes: Arc<[u8]>,
}

impl std::fmt::Debug for QuantTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QuantTensor({} [{}, {}])", self.ty, self.rows, self.cols)
    }
}

impl QuantTensor {
    /// Wraps stored blocks, checking that they are exactly `rows` rows of `cols` values.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, bytes: Arc<[u8]>) -> Result<QuantTensor> {
        if !ty.can_dequantize() {
            return Err(Error::invalid(format!(
                "ggml type {ty} cannot be dequantized by mladb"
            )));
        }
        if !cols.is_multiple_of(ty.block_size()) {
            return Err(Error::invalid(format!(
                "{ty} rows of {cols} values are not whole blocks of {}",
                ty.block_size()
            )));
        }
        let expected = rows
            .checked_mul(cols / ty.block_size())
            .and_then(|b| b.checked_mul(ty.type_size()));
        if expected != Some(bytes.len()) {
            return Err(Error::invalid(format!(
                "{ty} [{rows}, {cols}] needs {expected:?} bytes, found {}",
                bytes.len()
            )));
        }
        Ok(QuantTensor {
            ty,
            rows,
            cols,
            bytes,
        })
    }

    /// Quantizes a row-major [rows, cols] matrix.
    pub fn quantize(ty: GgmlType, rows: usize, cols: usize, values: &[f32]) -> Result<QuantTensor> {
        if values.len() != rows * cols {
            return Err(Error::invalid(format!(
                "quantizing [{rows}, {cols}]: {} values",
                values.len()
            )));
        }
        let bytes = crate::gguf::quantize(ty, values)?;
        QuantTensor::new(ty, rows, cols, bytes.into())
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_size() * self.ty.type_size()
    }

    /// The stored blocks of rows `start..start + count`.
    pub fn rows_bytes(&self, start: usize, count: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes[start * rb..(start + count) * rb]
    }

    /// Rows `start..start + count` decoded into `out` (`count * cols` values).
    pub fn dequantize_rows(
        &self,
        start: usize,
        out: &mut [f32],
        faults: QuantFaults,
    ) -> Result<()> {
        let count = out.len() / self.cols;
        if !out.len().is_multiple_of(self.cols) || start + count > self.rows {
            return Err(Error::invalid(format!(
                "rows {start}..{} of a {} [{}, {}] weight",
                start + count,
                self.ty,
                self.rows,
                self.cols
            )));
        }
        dequantize_with(self.ty, self.rows_bytes(start, count), out, faults)
    }

    /// The whole matrix decoded.
    pub fn dequantize(&self, faults: QuantFaults) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        out.par_chunks_mut(self.cols * 16)
            .enumerate()
            .try_for_each(|(i, chunk)| self.dequantize_rows(i * 16, chunk, faults))?;
        Ok(out)
    }

    /// Bytes this tensor takes.
    pub fn size_bytes(&self) -> usize {
        self.bytes.len()
    }
}

/// The quantization faults a dequantization kernel carries out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuantFaults {
    /// FAULT q4k-scale-unpack: Q4_K sub-blocks 4..7 unpacked as if they were 0..3.
    pub q4k_scale_unpack: bool,
}

/// Dequantizes whole blocks, with the faults of a buggy kernel when asked for.
pub fn dequantize_with(
    ty: GgmlType,
    bytes: &[u8],
    out: &mut [f32],
    faults: QuantFaults,
) -> Result<()> {
    crate::gguf::dequantize_into(ty, bytes, out)?;
    if faults.q4k_scale_unpack && ty == GgmlType::Q4_K {
        for (block, vals) in bytes.chunks_exact(144).zip(out.chunks_exact_mut(256)) {
            q4k_upper_subblocks_misunpacked(block, vals);
        }
    }
    Ok(())
}

/// Re-decodes sub-blocks 4..7 of one Q4_K block with the unpacking of sub-blocks 0..3
/// (scale = s[j] & 63, min = s[j+4] & 63), the bug: the correct one splices the high two bits of
/// s[j−4] / s[j] onto the nibbles of s[j+4].
fn q4k_upper_subblocks_misunpacked(block: &[u8], out: &mut [f32]) {
    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
    let dmin = f16::from_le_bytes([block[2], block[3]]).to_f32();
    let s = &block[4..16];
    let qs = &block[16..144];
    for j in 4..8 {
        let (sc, m) = (s[j] & 63, s[j + 4] & 63);
        let chunk = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        for (i, &q) in chunk.iter().enumerate() {
            let nib = if j % 2 == 0 { q & 0xF } else { q >> 4 };
            out[32 * j + i] = d * sc as f32 * nib as f32 - dmin * m as f32;
        }
    }
}

/// Which weights `--quant TYPE` quantizes: the 2-D projection and expert weights, as a GGUF
/// conversion does; norms, biases, the router and the embedding table stay as they are.
pub fn is_quantizable_name(name: &str) -> bool {
    name.ends_with("_proj.weight") || name == "lm_head.weight"
}

/// The type a GGUF conversion falls back to when rows are not whole blocks of `ty` (llama.cpp
/// does this for K-quants whose rows are not multiples of 256).
pub fn fallback_type(ty: GgmlType, cols: usize) -> Option<GgmlType> {
    if cols.is_multiple_of(ty.block_size()) {
        return Some(ty);
    }
    let alternative = match ty {
        GgmlType::Q4_K => GgmlType::Q4_0,
        GgmlType::Q6_K => GgmlType::Q8_0,
        _ => return None,
    };
    cols.is_multiple_of(alternative.block_size())
        .then_some(alternative)
}

/// A weight source whose projection weights are quantized at load (`--quant TYPE`): rows read
/// back are the dequantized blocks, and [`WeightSource::quantized`] hands out the blocks
/// themselves. The unquantized values stay reachable ([`WeightSource::original`]) so detectors
/// can measure the quantization error.
pub struct QuantizedSource {
    inner: Box<dyn WeightSource>,
    ty: GgmlType,
}

impl QuantizedSource {
    pub fn new(inner: Box<dyn WeightSource>, ty: GgmlType) -> Result<QuantizedSource> {
        if !ty.can_quantize() {
            let names: Vec<&str> = GgmlType::QUANTIZABLE.iter().map(|t| t.name()).collect();
            return Err(Error::invalid(format!(
                "--quant {ty}: mladb quantizes to {}",
                names.join(", ")
            )));
        }
        Ok(QuantizedSource { inner, ty })
    }

    /// The type a tensor is stored as, or `None` when it stays unquantized.
    fn type_of(&self, name: &str) -> Option<(GgmlType, usize)> {
        if !is_quantizable_name(name) {
            return None;
        }
        let shape = self.inner.shape(name)?;
        if shape.len() != 2 {
            return None;
        }
        fallback_type(self.ty, shape[1]).map(|t| (t, shape[1]))
    }
}

impl WeightSource for QuantizedSource {
    fn describe(&self) -> String {
        format!("{} quantized to {}", self.inner.describe(), self.ty)
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.inner.shape(name)
    }

    fn readable(&self, name: &str) -> Result<()> {
        self.inner.readable(name)
    }

    fn read_rows(&self, name: &str, start_row: usize, out: &mut [f32]) -> Result<()> {
        self.inner.read_rows(name, start_row, out)?;
        if let Some((ty, _)) = self.type_of(name) {
            // Rows are whole blocks, so quantizing a row range equals slicing the quantized whole.
            let bytes = crate::gguf::quantize(ty, out)?;
            crate::gguf::dequantize_into(ty, &bytes, out)?;
        }
        Ok(())
    }

    fn quantized(&self, name: &str) -> Option<Result<QuantTensor>> {
        let (ty, cols) = self.type_of(name)?;
        let rows = self.inner.shape(name)?[0];
        Some((|| {
            let mut values = vec![0.0f32; crate::tensor::checked_numel(&[rows, cols], name)?];
            self.inner.read_rows(name, 0, &mut values)?;
            QuantTensor::quantize(ty, rows, cols, &values)
        })())
    }

    fn original(&self, name: &str, start_row: usize, out: &mut [f32]) -> Option<Result<()>> {
        Some(self.inner.read_rows(name, start_row, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaussianish(n: usize, seed: u64) -> Vec<f32> {
        let key = crate::model::weights::synthetic::tensor_key(seed, "q");
        (0..n as u64)
            .map(|i| crate::model::weights::synthetic::normalish(key, i))
            .collect()
    }

    #[test]
    fn the_q4k_fault_changes_only_the_upper_sub_blocks() {
        let x = gaussianish(4 * 256, 3);
        let q = QuantTensor::quantize(GgmlType::Q4_K, 2, 512, &x).unwrap();
        let good = q.dequantize(QuantFaults::default()).unwrap();
        let bad = q
            .dequantize(QuantFaults {
                q4k_scale_unpack: true,
            })
            .unwrap();
        let mut upper_changed = 0;
        for (i, (g, b)) in good.iter().zip(&bad).enumerate() {
            if (i % 256) < 128 {
                assert_eq!(g, b, "value {i} of a lower sub-block changed");
            } else if g != b {
                upper_changed += 1;
            }
        }
        assert!(
            upper_changed > 256,
            "only {upper_changed} upper values changed"
        );
    }

    #[test]
    fn k_quants_fall_back_on_short_rows() {
        assert_eq!(fallback_type(GgmlType::Q4_K, 512), Some(GgmlType::Q4_K));
        assert_eq!(fallback_type(GgmlType::Q4_K, 64), Some(GgmlType::Q4_0));
        assert_eq!(fallback_type(GgmlType::Q6_K, 96), Some(GgmlType::Q8_0));
        assert_eq!(fallback_type(GgmlType::Q8_0, 48), None);
    }
}
