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
use super::value::{Array, Value, ValueType};
use super::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

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

// ---- parsing -----------------------------------------------------------------------------

struct ParsedHeader {
    version: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_start: u64,
}

/// A bounds-checked cursor over the file. Every read states what it reads, for the error.
struct Parser<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Parser<'a> {
    fn new(buf: &'a [u8], path: &'a Path) -> Parser<'a> {
        Parser { buf, pos: 0, path }
    }

    fn err(&self, msg: impl Into<String>) -> Error {
        Error::parse(self.path, msg)
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(format!(
                "truncated: {} needs {n} bytes at offset {}, the file has {} left",
                what(),
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn fixed<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        Ok(self.take(N as u64, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.fixed(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.fixed(what)?))
    }

    /// A length-prefixed string's raw bytes; the length is checked against the bytes left.
    fn string_bytes(&mut self, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let len = self.u64(&|| format!("the length of {}", what()))?;
        if len > self.remaining() {
            return Err(self.err(format!(
                "{} claims a length of {len} bytes at offset {}, past the end of the file ({} bytes left)",
                what(),
                self.pos - 8,
                self.remaining()
            )));
        }
        self.take(len, what)
    }

    /// A string that must be valid UTF-8 (keys and tensor names: they are looked up).
    fn name(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let at = self.pos;
        let b = self.string_bytes(what)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| self.err(format!("{} at offset {at} is not valid UTF-8", what())))
    }

    fn header(mut self) -> Result<ParsedHeader> {
        let magic: [u8; 4] = self.fixed(&|| "the magic number".into())?;
        if magic != MAGIC {
            return Err(self.err(format!(
                "not a GGUF file: it starts with {magic:02x?}, not \"GGUF\""
            )));
        }
        let version = self.u32(&|| "the version".into())?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(self.err(
                    "GGUF version 1 (32-bit counts) is not supported; convert the file again",
                ))
            }
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
                return Err(self.err("big-endian GGUF files are not supported"))
            }
            v => return Err(self.err(format!("unsupported GGUF version {v} (2 and 3 are read)"))),
        }
        let n_tensors = self.u64(&|| "the tensor count".into())?;
        let n_kv = self.u64(&|| "the metadata count".into())?;

        // Each metadata entry takes at least 8 (key length) + 4 (type) + 1 bytes.
        if n_kv > self.remaining() / 13 {
            return Err(self.err(format!(
                "the header claims {n_kv} metadata entries; the {} bytes left hold at most {}",
                self.remaining(),
                self.remaining() / 13
            )));
        }
        let mut metadata: Vec<(String, Value)> = Vec::with_capacity(n_kv as usize);
        let mut seen = std::collections::HashSet::new();
        for i in 0..n_kv {
            let key = self.name(&|| format!("the key of metadata entry #{i}"))?;
            let ty_id = self.u32(&|| format!("the type of metadata '{key}'"))?;
            let ty = ValueType::from_id(ty_id).ok_or_else(|| {
                self.err(format!("metadata '{key}' has unknown value type {ty_id}"))
            })?;
            let value = self.value(ty, &key, 0)?;
            if !seen.insert(key.clone()) {
                return Err(self.err(format!("metadata key '{key}' appears twice")));
            }
            metadata.push((key, value));
        }

        let alignment = match metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
            None => DEFAULT_ALIGNMENT,
            Some((_, Value::U32(a))) => {
                let a = u64::from(*a);
                if a == 0 || !a.is_power_of_two() || a > MAX_ALIGNMENT {
                    return Err(self.err(format!(
                        "{ALIGNMENT_KEY} is {a}: it must be a power of two between 1 and {MAX_ALIGNMENT}"
                    )));
                }
                a
            }
            Some((_, v)) => {
                return Err(self.err(format!(
                    "{ALIGNMENT_KEY} must be a u32, found {} {}",
                    v.value_type(),
                    v.display(4)
                )))
            }
        };

        // Each tensor entry takes at least 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset).
        if n_tensors > self.remaining() / 24 {
            return Err(self.err(format!(
                "the header claims {n_tensors} tensors; the {} bytes left hold at most {}",
                self.remaining(),
                self.remaining() / 24
            )));
        }
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut names = std::collections::HashSet::new();
        for i in 0..n_tensors {
            let t = self.tensor_info(i, alignment)?;
            if !names.insert(t.name.clone()) {
                return Err(self.err(format!("tensor '{}' appears twice", t.name)));
            }
            tensors.push(t);
        }

        let end_of_table = self.pos as u64;
        let data_start = end_of_table
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| self.err("data section offset overflows"))?;
        let file_len = self.buf.len() as u64;
        if !tensors.is_empty() && data_start > file_len {
            return Err(self.err(format!(
                "the data section would start at offset {data_start} (tensor table ends at \
                 {end_of_table}, aligned to {alignment}), past the end of the {file_len}-byte file"
            )));
        }
        let data_len = file_len.saturating_sub(data_start);
        for t in &tensors {
            let end = t.offset.checked_add(t.n_bytes);
            match end {
                Some(end) if end <= data_len => {}
                _ => {
                    return Err(self.err(format!(
                        "tensor '{}' ({} bytes at data offset {}) extends past the end of the \
                         data section ({data_len} bytes from file offset {data_start})",
                        t.name, t.n_bytes, t.offset
                    )))
                }
            }
        }
        let mut order: Vec<&TensorInfo> = tensors.iter().collect();
        order.sort_by_key(|t| t.offset);
        for w in order.windows(2) {
            if w[0].offset + w[0].n_bytes > w[1].offset {
                return Err(self.err(format!(
                    "tensors '{}' (bytes {}..{}) and '{}' (from {}) overlap in the data section",
                    w[0].name,
                    w[0].offset,
                    w[0].offset + w[0].n_bytes,
                    w[1].name,
                    w[1].offset
                )));
            }
        }
        Ok(ParsedHeader {
            version,
            metadata,
            tensors,
            alignment,
            data_start,
        })
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: usize) -> Result<Value> {
        let what = || format!("the value of metadata '{key}'");
        Ok(match ty {
            ValueType::U8 => Value::U8(self.fixed::<1>(&what)?[0]),
            ValueType::I8 => Value::I8(self.fixed::<1>(&what)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.fixed(&what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.fixed(&what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.fixed(&what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.fixed(&what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.fixed(&what)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.fixed(&what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.fixed(&what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.fixed(&what)?)),
            ValueType::Bool => Value::Bool(self.bool(key)?),
            ValueType::String => {
                Value::String(String::from_utf8_lossy(self.string_bytes(&what)?).into_owned())
            }
            ValueType::Array => Value::Array(self.array(key, depth)?),
        })
    }

    fn bool(&mut self, key: &str) -> Result<bool> {
        let at = self.pos;
        match self.fixed::<1>(&|| format!("a bool in metadata '{key}'"))?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.err(format!(
                "metadata '{key}': byte {b} at offset {at} is not a bool (0 or 1)"
            ))),
        }
    }

    fn array(&mut self, key: &str, depth: usize) -> Result<Array> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.err(format!(
                "metadata '{key}': arrays nested deeper than {MAX_ARRAY_DEPTH} levels"
            )));
        }
        let ty_id = self.u32(&|| format!("the element type of array '{key}'"))?;
        let ty = ValueType::from_id(ty_id).ok_or_else(|| {
            self.err(format!(
                "metadata '{key}': unknown array element type {ty_id}"
            ))
        })?;
        let n = self.u64(&|| format!("the length of array '{key}'"))?;
        let min = ty.min_encoded_size();
        if n > self.remaining() / min {
            return Err(self.err(format!(
                "metadata '{key}': an array of {n} {ty} elements needs at least {} bytes, the \
                 file has {} left",
                n as u128 * min as u128,
                self.remaining()
            )));
        }
        // From here n·min ≤ remaining bytes: allocations below are bounded by the file size.
        let n = n as usize;
        let what = || format!("the elements of array '{key}'");
        macro_rules! scalars {
            ($variant:ident, $t:ty, $size:expr) => {
                Array::$variant(
                    self.take((n * $size) as u64, &what)?
                        .chunks_exact($size)
                        .map(|c| <$t>::from_le_bytes(c.try_into().unwrap()))
                        .collect(),
                )
            };
        }
        Ok(match ty {
            ValueType::U8 => Array::U8(self.take(n as u64, &what)?.to_vec()),
            ValueType::I8 => Array::I8(
                self.take(n as u64, &what)?
                    .iter()
                    .map(|&b| b as i8)
                    .collect(),
            ),
            ValueType::U16 => scalars!(U16, u16, 2),
            ValueType::I16 => scalars!(I16, i16, 2),
            ValueType::U32 => scalars!(U32, u32, 4),
            ValueType::I32 => scalars!(I32, i32, 4),
            ValueType::F32 => scalars!(F32, f32, 4),
            ValueType::U64 => scalars!(U64, u64, 8),
            ValueType::I64 => scalars!(I64, i64, 8),
            ValueType::F64 => scalars!(F64, f64, 8),
            ValueType::Bool => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.bool(key)?);
                }
                Array::Bool(v)
            }
            ValueType::String => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    let s = self.string_bytes(&|| format!("element {i} of array '{key}'"))?;
                    v.push(String::from_utf8_lossy(s).into_owned());
                }
                Array::String(v)
            }
            ValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array(key, depth + 1)?);
                }
                Array::Array(v)
            }
        })
    }

    fn tensor_info(&mut self, i: u64, alignment: u64) -> Result<TensorInfo> {
        let name = self.name(&|| format!("the name of tensor #{i}"))?;
        let n_dims = self.u32(&|| format!("the dimension count of tensor '{name}'"))?;
        if n_dims as usize > MAX_DIMS {
            return Err(self.err(format!(
                "tensor '{name}' has {n_dims} dimensions; ggml allows at most {MAX_DIMS}"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        let mut n_elements: u64 = 1;
        for d in 0..n_dims {
            let ne = self.u64(&|| format!("dimension {d} of tensor '{name}'"))?;
            if ne == 0 {
                return Err(self.err(format!("tensor '{name}': dimension {d} is 0")));
            }
            n_elements = n_elements.checked_mul(ne).ok_or_else(|| {
                self.err(format!(
                    "tensor '{name}': the element count of dims {:?} overflows 64 bits",
                    dims.iter().chain([&ne]).collect::<Vec<_>>()
                ))
            })?;
            dims.push(ne);
        }
        let ty_id = self.u32(&|| format!("the type of tensor '{name}'"))?;
        let ty = GgmlType::from_id(ty_id)
            .ok_or_else(|| self.err(format!("tensor '{name}' has unknown ggml type id {ty_id}")))?;
        let offset = self.u64(&|| format!("the data offset of tensor '{name}'"))?;
        let row_len = dims.first().copied().unwrap_or(1);
        let bs = ty.block_size() as u64;
        if !row_len.is_multiple_of(bs) {
            return Err(self.err(format!(
                "tensor '{name}': rows of {row_len} values are not a whole number of {ty} blocks \
                 ({bs} values each)"
            )));
        }
        let n_bytes = ty.bytes_for(n_elements).ok_or_else(|| {
            self.err(format!(
                "tensor '{name}': the byte size of {n_elements} {ty} values overflows 64 bits"
            ))
        })?;
        if !offset.is_multiple_of(alignment) {
            return Err(self.err(format!(
                "tensor '{name}': data offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        Ok(TensorInfo {
            name,
            ty,
            dims,
            offset,
            n_elements,
            n_bytes,
        })
    }
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
