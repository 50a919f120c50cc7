//! The GGUF reader: memory-maps a file, parses and validates its header, metadata and tensor
//! table up front, and hands out tensor bytes as slices of the map.
//!
//! Validation happens while parsing, before any allocation sized by the file: a count is first
//! checked against the bytes left (each element needs at least a known number of bytes), so a
//! claim of 2^62 tensors fails at once instead of reserving memory. Tensor sizes are derived
//! with checked arithmetic and each tensor must lie inside the data section, aligned, without
//! overlapping another. After `open` succeeds every accessor is infallible except lookups by
//! name and dequantization (whose output size is capped, see [`MAX_DEQUANT_BYTES`]).

use super::quant::{self, GgmlType};
use super::value::{Array, Value};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

mod parse;

use parse::{ParsedHeader, Parser};

/// Largest `general.alignment` accepted. ggml takes any power of two; real files use 32 (a
/// few use 64 or 4096). Anything past 16 MiB is treated as corruption.
pub const MAX_ALIGNMENT: u64 = 1 << 24;
/// Deepest nesting of arrays inside arrays (the format allows nesting; files use none).
pub const MAX_ARRAY_DEPTH: usize = 4;
/// Largest f32 output [`GgufFile::dequantize`] allocates (64 GiB). The f32 values of a tensor
/// can be far larger than the file (Q2_K stores 2.625 bits per value: ×12), so a hostile or
/// merely huge file must not decide the allocation alone; row ranges
/// ([`GgufFile::dequantize_rows`]) are the way to read larger tensors.
pub const MAX_DEQUANT_BYTES: u64 = 64 << 30;

/// One tensor's entry in the tensor table, validated against the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// Dimensions as stored: fastest-varying first (`ne0` = elements per row).
    pub dims: Vec<u64>,
    /// Offset of the first byte, relative to the start of the data section.
    pub offset: u64,
    pub n_elements: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    /// The row-major shape (the stored dims reversed), as mladb and safetensors use it.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }

    /// Elements per row (`ne0`); 1 for a zero-dimensional tensor.
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows: all dimensions but the first, multiplied.
    pub fn n_rows(&self) -> u64 {
        self.n_elements / self.row_len()
    }

    /// Bytes per row (a whole number of blocks, checked at open).
    pub fn row_bytes(&self) -> u64 {
        self.n_bytes / self.n_rows()
    }
}

enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// An open, validated GGUF file.
pub struct GgufFile {
    path: PathBuf,
    bytes: Bytes,
    version: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    alignment: u64,
    data_start: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and validates `path`, memory-mapping it.
    ///
    /// The map assumes the file is not modified while open (as every mmap-based model loader
    /// does); truncating it underneath would fault on access.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = crate::input::open_regular(path)?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let bytes = if len == 0 {
            // mapping an empty file fails on some systems; parse it for the proper error
            Bytes::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only and private to this value; see the note above on
            // concurrent modification.
            Bytes::Mapped(unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?)
        };
        GgufFile::parse(path.to_path_buf(), bytes)
    }

    /// Parses an in-memory file; errors name it `<memory>`.
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<GgufFile> {
        GgufFile::parse(PathBuf::from("<memory>"), Bytes::Owned(bytes.into()))
    }

    /// Parses an in-memory file; errors name it `name`.
    pub fn from_bytes_named(
        bytes: impl Into<Vec<u8>>,
        name: impl Into<PathBuf>,
    ) -> Result<GgufFile> {
        GgufFile::parse(name.into(), Bytes::Owned(bytes.into()))
    }

    fn parse(path: PathBuf, bytes: Bytes) -> Result<GgufFile> {
        let p = Parser::new(bytes.as_slice(), &path).header()?;
        let ParsedHeader {
            version,
            metadata,
            tensors,
            alignment,
            data_start,
        } = p;
        let by_name = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            path,
            bytes,
            version,
            metadata,
            tensors,
            by_name,
            alignment,
            data_start,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data-section alignment in bytes.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// File size in bytes.
    pub fn file_len(&self) -> u64 {
        self.bytes.as_slice().len() as u64
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    fn typed<T>(&self, key: &str, want: &str, f: impl Fn(&Value) -> Option<T>) -> Result<T> {
        let v = self
            .get(key)
            .ok_or_else(|| self.err(format!("metadata key '{key}' is missing")))?;
        f(v).ok_or_else(|| {
            self.err(format!(
                "metadata key '{key}' is {} {}, expected {want}",
                v.value_type(),
                v.display(4)
            ))
        })
    }

    /// An integer of any width whose value is non-negative.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.typed(key, "a non-negative integer", Value::as_u64)
    }

    /// An integer of any width that fits in i64.
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.typed(key, "an integer", Value::as_i64)
    }

    /// An f32 (or an f64 rounded to f32).
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.typed(key, "a float", Value::as_f32)
    }

    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.typed(key, "a float", Value::as_f64)
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.typed(key, "a bool", Value::as_bool)
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self
            .get(key)
            .ok_or_else(|| self.err(format!("metadata key '{key}' is missing")))?;
        v.as_str().ok_or_else(|| {
            self.err(format!(
                "metadata key '{key}' is {} {}, expected a string",
                v.value_type(),
                v.display(4)
            ))
        })
    }

    pub fn get_arr(&self, key: &str) -> Result<&Array> {
        let v = self
            .get(key)
            .ok_or_else(|| self.err(format!("metadata key '{key}' is missing")))?;
        v.as_array().ok_or_else(|| {
            self.err(format!(
                "metadata key '{key}' is {} {}, expected an array",
                v.value_type(),
                v.display(4)
            ))
        })
    }

    /// The tensor table in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Whether the file holds a tensor named `name` (without [`GgufFile::tensor`]'s
    /// suggestions, which weigh every name of the table: a lookup that may miss often, as
    /// mapping a model's catalogue onto the file does, must not pay for them).
    pub fn has_tensor(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// The tensor named `name`; the error suggests close names.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        match self.by_name.get(name) {
            Some(&i) => Ok(&self.tensors[i]),
            None => {
                let close = close_names(name, self.tensors.iter().map(|t| t.name.as_str()));
                let hint = if close.is_empty() {
                    String::new()
                } else {
                    format!(" (did you mean {}?)", close.join(", "))
                };
                Err(Error::MissingTensor {
                    name: format!("'{name}'"),
                    source_desc: format!("{}{hint}", self.path.display()),
                })
            }
        }
    }

    /// The stored bytes of `t`, one of this file's [`GgufFile::tensors`] (validated to lie
    /// inside the file at open). An entry that does not fit this file gives an empty slice,
    /// which dequantization then rejects by size, rather than a panic.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let range = self
            .data_start
            .checked_add(t.offset)
            .and_then(|s| Some(s..s.checked_add(t.n_bytes)?))
            .and_then(|r| Some(usize::try_from(r.start).ok()?..usize::try_from(r.end).ok()?));
        range
            .and_then(|r| self.bytes.as_slice().get(r))
            .unwrap_or(&[])
    }

    /// The stored bytes of the tensor named `name`.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        Ok(self.tensor_data(self.tensor(name)?))
    }

    /// The stored bytes of rows `rows` (each `ne0` values) of tensor `name`: the unit the
    /// engine dequantizes on the fly.
    pub fn row_bytes(&self, name: &str, rows: Range<u64>) -> Result<&[u8]> {
        let t = self.tensor(name)?;
        if rows.start > rows.end || rows.end > t.n_rows() {
            return Err(Error::invalid(format!(
                "tensor '{name}' has {} rows, rows {}..{} requested",
                t.n_rows(),
                rows.start,
                rows.end
            )));
        }
        let rb = t.row_bytes();
        let data = self.tensor_data(t);
        Ok(&data[(rows.start * rb) as usize..(rows.end * rb) as usize])
    }

    /// Rows `rows` of tensor `name`, dequantized to f32.
    pub fn dequantize_rows(&self, name: &str, rows: Range<u64>) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        let bytes = self.row_bytes(name, rows.clone())?;
        let n = (rows.end - rows.start) * t.row_len();
        let mut out = alloc_f32(n, name)?;
        quant::dequantize_into_par(t.ty, bytes, &mut out)?;
        Ok(out)
    }

    /// The whole tensor `name` dequantized to f32, in storage order (row-major for
    /// [`TensorInfo::shape`]). Refuses outputs over [`MAX_DEQUANT_BYTES`].
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        if !t.ty.can_dequantize() {
            return Err(Error::invalid(format!(
                "tensor '{name}': {}",
                quant::unsupported(t.ty, "dequantization")
            )));
        }
        let mut out = alloc_f32(t.n_elements, name)?;
        quant::dequantize_into_par(t.ty, self.tensor_data(t), &mut out)
            .map_err(|e| Error::invalid(format!("tensor '{name}': {e}")))?;
        Ok(out)
    }

    fn err(&self, msg: String) -> Error {
        Error::parse(&self.path, msg)
    }
}

fn alloc_f32(n: u64, name: &str) -> Result<Vec<f32>> {
    match n.checked_mul(4) {
        Some(b) if b <= MAX_DEQUANT_BYTES && usize::try_from(n).is_ok() => {
            Ok(vec![0f32; n as usize])
        }
        _ => Err(Error::Allocation {
            what: format!("the f32 values of tensor '{name}'"),
            detail: format!(
                "{n} values exceed the {} GiB cap; read it by row ranges",
                MAX_DEQUANT_BYTES >> 30
            ),
        }),
    }
}

/// Up to three names within a small edit distance of `name` (or containing it).
fn close_names<'a>(name: &str, names: impl Iterator<Item = &'a str>) -> Vec<String> {
    let limit = (name.len() / 4).max(2);
    let mut scored: Vec<(usize, &str)> = names
        .filter(|n| n.len() <= 256 && name.len() <= 256)
        .filter_map(|n| {
            // case-insensitive, so a wrong case ranks first
            let d = edit_distance(
                name.to_ascii_lowercase().as_bytes(),
                n.to_ascii_lowercase().as_bytes(),
            );
            if d <= limit || (name.len() >= 3 && n.contains(name)) {
                Some((d, n))
            } else {
                None
            }
        })
        .collect();
    scored.sort();
    scored
        .iter()
        .take(3)
        .map(|(_, n)| format!("'{n}'"))
        .collect()
}

fn edit_distance(a: &[u8], b: &[u8]) -> usize {
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, &ca) in a.iter().enumerate() {
        cur[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_names_suggest_typos_and_substrings() {
        let names = [
            "blk.0.attn_q_a.weight",
            "blk.0.attn_q_b.weight",
            "output.weight",
        ];
        let s = close_names("blk.0.attn_q_a.weigth", names.iter().copied());
        assert_eq!(s[0], "'blk.0.attn_q_a.weight'");
        assert!(close_names("zzz", names.iter().copied()).is_empty());
        assert_eq!(
            close_names("output", names.iter().copied()),
            ["'output.weight'"]
        );
        assert_eq!(edit_distance(b"kitten", b"sitting"), 3);
    }

    #[test]
    fn dequantized_outputs_are_capped() {
        let e = alloc_f32((MAX_DEQUANT_BYTES / 4) + 1, "t")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("refusing to allocate the f32 values of tensor 't'"),
            "{e}"
        );
        assert!(alloc_f32(u64::MAX, "t").is_err());
        assert_eq!(alloc_f32(3, "t").unwrap().len(), 3);
    }

    #[test]
    fn empty_input_is_a_truncation_error() {
        let e = GgufFile::from_bytes(Vec::new()).unwrap_err().to_string();
        assert!(e.contains("<memory>") && e.contains("truncated"), "{e}");
    }
}
