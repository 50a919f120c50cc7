//! Parsing the header, the metadata and the tensor table of a GGUF file, every count and size
//! checked against the bytes left before anything is allocated (see [`super`]).

use super::{TensorInfo, MAX_ALIGNMENT, MAX_ARRAY_DEPTH};
use crate::error::{Error, Result};
use crate::gguf::quant::GgmlType;
use crate::gguf::value::{Array, Value, ValueType};
use crate::gguf::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use std::path::Path;

/// What the file holds before its data section.
pub(super) struct ParsedHeader {
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    pub data_start: u64,
}

/// A bounds-checked cursor over the file. Every read states what it reads, for the error.
pub(super) struct Parser<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Parser<'a> {
    pub(super) fn new(buf: &'a [u8], path: &'a Path) -> Parser<'a> {
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

    pub(super) fn header(mut self) -> Result<ParsedHeader> {
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
