//! A small GGUF v3 writer: metadata of every value type and tensors laid out back to back at
//! the file's alignment. Used by tests, fixtures and tools; not a streaming writer (the whole
//! file is built in memory, then written atomically).

use super::quant::GgmlType;
use super::value::{Array, Value};
use super::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use crate::error::{Error, Result};
use crate::fsutil::write_atomic;
use std::path::Path;

struct PendingTensor {
    name: String,
    ty: GgmlType,
    /// Stored order: fastest first.
    dims: Vec<u64>,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then serialises them as GGUF v3.
pub struct GgufWriter {
    alignment: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter::new()
    }
}

impl GgufWriter {
    pub fn new() -> GgufWriter {
        GgufWriter {
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Sets the data alignment (a power of two); a value other than 32 is recorded as
    /// `general.alignment` so readers find it.
    pub fn alignment(&mut self, alignment: u32) -> Result<&mut Self> {
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(Error::invalid(format!(
                "GGUF alignment {alignment} is not a power of two"
            )));
        }
        self.alignment = alignment.into();
        self.metadata.retain(|(k, _)| k != ALIGNMENT_KEY);
        if self.alignment != DEFAULT_ALIGNMENT {
            self.metadata
                .push((ALIGNMENT_KEY.to_string(), Value::U32(alignment)));
        }
        Ok(self)
    }

    /// Adds (or replaces) a metadata entry. `general.alignment` must go through
    /// [`GgufWriter::alignment`].
    pub fn metadata(&mut self, key: impl Into<String>, value: Value) -> Result<&mut Self> {
        let key = key.into();
        if key == ALIGNMENT_KEY {
            return match value {
                Value::U32(a) => self.alignment(a),
                v => Err(Error::invalid(format!(
                    "{ALIGNMENT_KEY} must be a u32, got {}",
                    v.value_type()
                ))),
            };
        }
        check_value(&key, &value)?;
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key, value)),
        }
        Ok(self)
    }

    /// Adds a tensor of type `ty` with row-major `shape` (stored reversed, as GGUF does) and its
    /// encoded bytes, which must be exactly the size the shape implies.
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        shape: &[u64],
        data: Vec<u8>,
    ) -> Result<&mut Self> {
        let name = name.into();
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(Error::invalid(format!("tensor '{name}' added twice")));
        }
        if shape.len() > MAX_DIMS {
            return Err(Error::invalid(format!(
                "tensor '{name}': {} dimensions, at most {MAX_DIMS}",
                shape.len()
            )));
        }
        if shape.contains(&0) {
            return Err(Error::invalid(format!("tensor '{name}': a dimension is 0")));
        }
        let dims: Vec<u64> = shape.iter().rev().copied().collect();
        let row = dims.first().copied().unwrap_or(1);
        if !row.is_multiple_of(ty.block_size() as u64) {
            return Err(Error::invalid(format!(
                "tensor '{name}': rows of {row} values are not whole {ty} blocks"
            )));
        }
        let n = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|n| ty.bytes_for(n));
        if n != Some(data.len() as u64) {
            return Err(Error::invalid(format!(
                "tensor '{name}': shape {shape:?} of {ty} takes {n:?} bytes, got {}",
                data.len()
            )));
        }
        self.tensors.push(PendingTensor {
            name,
            ty,
            dims,
            data,
        });
        Ok(self)
    }

    /// Adds an f32 tensor with row-major `shape`.
    pub fn tensor_f32(
        &mut self,
        name: impl Into<String>,
        shape: &[u64],
        values: &[f32],
    ) -> Result<&mut Self> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, GgmlType::F32, shape, data)
    }

    /// The serialised file.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&v.value_type().id().to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len() as u64).next_multiple_of(self.alignment);
        }
        let data_start = (out.len() as u64).next_multiple_of(self.alignment);
        out.resize(data_start as usize, 0);
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize((data_start + off) as usize, 0);
            out.extend_from_slice(&t.data);
        }
        if !self.tensors.is_empty() {
            let end = (out.len() as u64).next_multiple_of(self.alignment);
            out.resize(end as usize, 0);
        }
        Ok(out)
    }

    /// Writes the file atomically.
    pub fn write(&self, path: &Path) -> Result<()> {
        write_atomic(path, &self.to_bytes()?)
    }
}

/// Refuses what the reader would refuse: arrays nested deeper than it reads. (Empty arrays are
/// valid GGUF, though gguf-py's writer will not produce them.)
fn check_value(key: &str, v: &Value) -> Result<()> {
    fn depth(a: &Array) -> usize {
        match a {
            Array::Array(v) => 1 + v.iter().map(depth).max().unwrap_or(0),
            _ => 1,
        }
    }
    if let Value::Array(a) = v {
        if depth(a) > super::reader::MAX_ARRAY_DEPTH {
            return Err(Error::invalid(format!(
                "metadata '{key}': arrays nested deeper than {}",
                super::reader::MAX_ARRAY_DEPTH
            )));
        }
    }
    Ok(())
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, s),
        Value::Array(a) => put_array(out, a),
    }
}

fn put_array(out: &mut Vec<u8>, a: &Array) {
    out.extend_from_slice(&a.element_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! le {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => le!(v),
        Array::U16(v) => le!(v),
        Array::I16(v) => le!(v),
        Array::U32(v) => le!(v),
        Array::I32(v) => le!(v),
        Array::F32(v) => le!(v),
        Array::U64(v) => le!(v),
        Array::I64(v) => le!(v),
        Array::F64(v) => le!(v),
        Array::Bool(v) => out.extend(v.iter().map(|&b| b as u8)),
        Array::String(v) => v.iter().for_each(|s| put_str(out, s)),
        Array::Array(v) => v.iter().for_each(|a| put_array(out, a)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    #[test]
    fn every_value_type_round_trips() {
        let values = vec![
            ("u8", Value::U8(200)),
            ("i8", Value::I8(-100)),
            ("u16", Value::U16(60000)),
            ("i16", Value::I16(-30000)),
            ("u32", Value::U32(4_000_000_000)),
            ("i32", Value::I32(-2_000_000_000)),
            ("f32", Value::F32(1.5e-3)),
            ("bool", Value::Bool(true)),
            ("str", Value::String("glm-dsa ✓".into())),
            ("u64", Value::U64(u64::MAX)),
            ("i64", Value::I64(i64::MIN)),
            ("f64", Value::F64(-2.25e300)),
            ("arr.u8", Value::Array(Array::U8(vec![1, 2, 3]))),
            ("arr.i8", Value::Array(Array::I8(vec![-1, 2]))),
            ("arr.u16", Value::Array(Array::U16(vec![1, 65535]))),
            ("arr.i16", Value::Array(Array::I16(vec![-2]))),
            ("arr.u32", Value::Array(Array::U32(vec![7; 5]))),
            ("arr.i32", Value::Array(Array::I32(vec![-7, 7]))),
            ("arr.f32", Value::Array(Array::F32(vec![0.5, -0.25]))),
            ("arr.bool", Value::Array(Array::Bool(vec![true, false]))),
            (
                "arr.str",
                Value::Array(Array::String(vec!["a".into(), "".into()])),
            ),
            ("arr.u64", Value::Array(Array::U64(vec![u64::MAX]))),
            ("arr.i64", Value::Array(Array::I64(vec![i64::MIN]))),
            ("arr.f64", Value::Array(Array::F64(vec![1e-300]))),
            ("arr.empty", Value::Array(Array::F32(vec![]))),
            (
                "arr.nested",
                Value::Array(Array::Array(vec![
                    Array::U8(vec![1]),
                    Array::String(vec!["x".into()]),
                ])),
            ),
        ];
        let mut w = GgufWriter::new();
        w.alignment(64).unwrap();
        for (k, v) in &values {
            w.metadata(*k, v.clone()).unwrap();
        }
        w.tensor_f32("a", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
            .unwrap();
        w.tensor("b", GgmlType::Q8_0, &[32], vec![0u8; 34]).unwrap();
        let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), 64);
        assert_eq!(f.metadata()[0], (ALIGNMENT_KEY.to_string(), Value::U32(64)));
        for (k, v) in &values {
            assert_eq!(f.get(k), Some(v), "{k}");
        }
        assert_eq!(f.get_u64("u32").unwrap(), 4_000_000_000);
        assert!(f.get_u64("i8").is_err());
        assert_eq!(f.get_i64("i8").unwrap(), -100);
        assert_eq!(f.get_str("str").unwrap(), "glm-dsa ✓");
        let e = f.get_str("u8").unwrap_err().to_string();
        assert!(e.contains("'u8' is u8 200, expected a string"), "{e}");
        assert!(f
            .get_f32("missing")
            .unwrap_err()
            .to_string()
            .contains("missing"));
        let a = f.tensor("a").unwrap();
        assert_eq!((a.dims.clone(), a.shape()), (vec![3, 2], vec![2, 3]));
        assert_eq!(f.dequantize("a").unwrap(), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(f.dequantize_rows("a", 1..2).unwrap(), [4.0, 5.0, 6.0]);
        assert_eq!(f.tensor("b").unwrap().offset % 64, 0);
        assert_eq!(f.data_start() % 64, 0);
    }

    #[test]
    fn bad_tensors_are_refused() {
        let mut w = GgufWriter::new();
        assert!(w
            .tensor("q", GgmlType::Q8_0, &[2, 31], vec![0; 68])
            .is_err());
        assert!(w
            .tensor("q", GgmlType::Q8_0, &[2, 32], vec![0; 67])
            .is_err());
        assert!(w
            .tensor("q", GgmlType::Q8_0, &[1, 1, 1, 1, 32], vec![0; 34])
            .is_err());
        assert!(w.tensor("q", GgmlType::F32, &[0], vec![]).is_err());
        w.tensor("q", GgmlType::Q8_0, &[32], vec![0; 34]).unwrap();
        assert!(w.tensor("q", GgmlType::Q8_0, &[32], vec![0; 34]).is_err());
        assert!(w.alignment(48).is_err());
        assert!(w.metadata(ALIGNMENT_KEY, Value::U64(64)).is_err());
    }
}
