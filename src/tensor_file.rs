//! Safetensors files of f32 values, written and read a tensor at a time: a dump's tensors
//! (`run --dump`, `import`, `check --reference`) and a session's companion of recorded outputs.
//!
//! Writing: [`write_f32`] makes the header with safetensors' own `Metadata` (the layout its
//! `serialize` gives: tensors by name, the header padded to 8 bytes), then streams each tensor's
//! bytes a buffer at a time into [`write_atomic_with`]'s temporary, so a writer holds the tensors'
//! values and a buffer, not a byte copy of every tensor and the whole file beside them, and a kill
//! mid-write leaves only a temporary the next write removes.
//!
//! Reading: [`TensorReader`] reads the header, then the file front to back a buffer at a time,
//! turning the tensors a caller keeps into f32 values as they pass and hashing every byte, so a
//! reader holds the values it keeps, not the file's bytes beside them.

use crate::error::{Error, Result};
use crate::fsutil::write_atomic_with;
use crate::model::weights::synthetic::{fnv1a64_from, FNV1A64_START};
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// One tensor of the file: its values as F32, turned into bytes only while the file takes them.
pub struct F32Tensor<'a> {
    pub name: String,
    pub shape: &'a [usize],
    pub data: &'a [f32],
}

/// Writes `tensors` (names unique, each holding its shape's values) and `metadata` to `path`
/// atomically ([`write_atomic_with`]). `what` names a tensor in errors ("op output"). Returns the
/// FNV-1a hash of the bytes written, taken as they pass (what binds a session to its companion).
pub fn write_f32<'a>(
    path: &Path,
    metadata: Option<HashMap<String, String>>,
    tensors: impl IntoIterator<Item = F32Tensor<'a>>,
    what: &str,
) -> Result<u64> {
    let mut tensors: Vec<F32Tensor<'a>> = tensors.into_iter().collect();
    // safetensors' order for tensors of one dtype: by name; a repeated name is then adjacent.
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    if let Some(pair) = tensors.windows(2).find(|p| p[0].name == p[1].name) {
        return Err(Error::invalid(format!(
            "writing {}: two {what}s are both named {}",
            path.display(),
            pair[0].name
        )));
    }
    for t in &tensors {
        if t.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)) != Some(t.data.len()) {
            return Err(Error::invalid(format!(
                "writing {}: {what} {} has {} values for shape {:?}",
                path.display(),
                t.name,
                t.data.len(),
                t.shape
            )));
        }
    }
    let mut offset = 0;
    let infos = tensors
        .iter()
        .map(|t| {
            let end = offset + 4 * t.data.len();
            let info = TensorInfo {
                dtype: Dtype::F32,
                shape: t.shape.to_vec(),
                data_offsets: (offset, end),
            };
            offset = end;
            (t.name.clone(), info)
        })
        .collect();
    let bad = |e: String| Error::invalid(format!("writing {}: {e}", path.display()));
    let header = Metadata::new(metadata, infos).map_err(|e| bad(e.to_string()))?;
    let mut text = serde_json::to_vec(&header).map_err(|e| bad(e.to_string()))?;
    text.resize(text.len().next_multiple_of(8), b' ');
    if text.len() as u64 > MAX_HEADER_BYTES {
        return Err(bad(format!(
            "{} {what}s need a header of {} bytes, more than a safetensors file may have",
            tensors.len(),
            text.len()
        )));
    }
    let mut hash = FNV1A64_START;
    write_atomic_with(path, |w| {
        let mut put = |bytes: &[u8]| {
            hash = fnv1a64_from(hash, bytes);
            w.write_all(bytes).map_err(|e| Error::io(path, e))
        };
        put(&(text.len() as u64).to_le_bytes())?;
        put(&text)?;
        let mut bytes = Vec::with_capacity(CHUNK_BYTES);
        for t in &tensors {
            for chunk in t.data.chunks(CHUNK_BYTES / 4) {
                bytes.clear();
                bytes.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
                put(&bytes)?;
            }
        }
        Ok(())
    })?;
    Ok(hash)
}

/// A tensor read from a safetensors file: its values as f32, and how the file stored them.
pub struct ReadTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub stored: Dtype,
    pub values: Vec<f32>,
}

/// The largest header read: safetensors' own limit.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The bytes read at a time (a multiple of every element size read).
const CHUNK_BYTES: usize = 1 << 20;

/// A safetensors file open for reading a tensor at a time. Its header is read and checked on
/// opening (the tensors' byte ranges tile the data exactly, and the file holds just that data);
/// its values are read by [`TensorReader::read_f32`].
pub struct TensorReader {
    path: PathBuf,
    file: std::fs::File,
    header: Metadata,
    /// FNV-1a of the bytes read so far.
    hash: u64,
}

impl TensorReader {
    /// Opens a regular file of at most `cap` bytes and reads its header.
    pub fn open(path: &Path, cap: u64) -> Result<TensorReader> {
        let bad = |msg: String| Error::parse(path, format!("not a valid safetensors file: {msg}"));
        let (mut file, len) = crate::input::open_capped(path, cap)?;
        let mut size = [0u8; 8];
        file.read_exact(&mut size)
            .map_err(|_| bad(format!("{len} bytes are too few for a header")))?;
        let n = u64::from_le_bytes(size);
        if n > MAX_HEADER_BYTES || n > len - 8 {
            return Err(bad(format!(
                "its header says it is {n} bytes long, in a file of {len}"
            )));
        }
        let mut text = vec![0u8; n as usize];
        file.read_exact(&mut text).map_err(|e| Error::io(path, e))?;
        let hash = fnv1a64_from(fnv1a64_from(FNV1A64_START, &size), &text);
        let header: Metadata =
            serde_json::from_slice(&text).map_err(|e| bad(format!("its header: {e}")))?;
        let data = len - 8 - n;
        if header.data_len() as u64 != data {
            return Err(bad(format!(
                "its header describes {} bytes of tensors, the file holds {data}",
                header.data_len()
            )));
        }
        Ok(TensorReader {
            path: path.to_path_buf(),
            file,
            header,
            hash,
        })
    }

    /// The header's free-form metadata.
    pub fn metadata(&self) -> Option<&HashMap<String, String>> {
        self.header.metadata().as_ref()
    }

    /// Each tensor's name and description, in the file's order.
    pub fn tensors(&self) -> Vec<(String, &TensorInfo)> {
        in_order(&self.header)
    }

    /// Reads the file to its end. The tensors `keep` chooses become f32 values (from F32, F16 or
    /// BF16; another dtype of a kept tensor is an error); the others are only hashed. Returns the
    /// kept tensors in the file's order and the FNV-1a hash of all of the file's bytes.
    pub fn read_f32(
        self,
        mut keep: impl FnMut(&str, &TensorInfo) -> bool,
    ) -> Result<(Vec<ReadTensor>, u64)> {
        let TensorReader {
            path,
            mut file,
            header,
            mut hash,
        } = self;
        let mut kept = Vec::new();
        let mut buf = vec![0u8; CHUNK_BYTES];
        for (name, info) in in_order(&header) {
            let chosen = keep(&name, info);
            let (start, end) = info.data_offsets;
            let mut values = Vec::new();
            if chosen {
                if !matches!(info.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
                    return Err(Error::parse(
                        &path,
                        format!(
                            "{name} is {:?}; only F32, F16 and BF16 tensors are read",
                            info.dtype
                        ),
                    ));
                }
                values.reserve_exact((end - start) * 8 / info.dtype.bitsize());
            }
            let mut left = end - start;
            while left > 0 {
                let chunk = &mut buf[..left.min(CHUNK_BYTES)];
                read_all(&mut file, chunk, &path)?;
                hash = fnv1a64_from(hash, chunk);
                if chosen {
                    decode(info.dtype, chunk, &mut values);
                }
                left -= chunk.len();
            }
            if chosen {
                kept.push(ReadTensor {
                    name,
                    shape: info.shape.clone(),
                    stored: info.dtype,
                    values,
                });
            }
        }
        Ok((kept, hash))
    }
}

/// The header's tensors by their place in the file.
fn in_order(header: &Metadata) -> Vec<(String, &TensorInfo)> {
    header
        .offset_keys()
        .into_iter()
        .filter_map(|name| header.info(&name).map(|info| (name, info)))
        .collect()
}

/// Fills `chunk` from `file`; a file that ends first was cut short after it was opened.
fn read_all(file: &mut std::fs::File, chunk: &mut [u8], path: &Path) -> Result<()> {
    file.read_exact(chunk).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => Error::parse(
            path,
            "the file ended before its tensors did (was it cut short while it was read?)",
        ),
        _ => Error::io(path, e),
    })
}

/// Appends the little-endian values of `bytes` (whole elements of `dtype`: F32, F16 or BF16)
/// to `out` as f32.
fn decode(dtype: Dtype, bytes: &[u8], out: &mut Vec<f32>) {
    match dtype {
        Dtype::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        Dtype::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        Dtype::BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::weights::synthetic::fnv1a64;

    #[test]
    fn the_hash_is_the_written_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let a: Vec<f32> = (0..3000).map(|i| i as f32 / 7.0).collect();
        let tensors = vec![
            F32Tensor {
                name: "run0/a".into(),
                shape: &[3, 1000],
                data: &a,
            },
            F32Tensor {
                name: "run0/b".into(),
                shape: &[2],
                data: &[1.5, -2.0],
            },
        ];
        let hash = write_f32(&path, None, tensors, "output").unwrap();
        assert_eq!(hash, fnv1a64(&std::fs::read(&path).unwrap()));
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "no temporary left beside it");
    }

    /// A file of an F32, a BF16 and an F16 tensor, and its bytes.
    fn mixed(path: &Path) -> Vec<u8> {
        use safetensors::tensor::TensorView;
        let f32s: Vec<u8> = [1.5f32, -2.0, 3.25]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let bf16s: Vec<u8> = [0.5f32, 7.0]
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect();
        let f16s: Vec<u8> = [-0.25f32]
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect();
        let views = [
            ("a", Dtype::F32, vec![3], &f32s),
            ("b", Dtype::BF16, vec![1, 2], &bf16s),
            ("c", Dtype::F16, vec![1], &f16s),
        ]
        .map(|(name, dtype, shape, bytes)| (name, TensorView::new(dtype, shape, bytes).unwrap()));
        let meta = HashMap::from([("k".to_string(), "v".to_string())]);
        let bytes = safetensors::serialize(views, Some(meta)).unwrap();
        std::fs::write(path, &bytes).unwrap();
        bytes
    }

    #[test]
    fn a_file_is_read_a_tensor_at_a_time_as_f32_and_hashed_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let bytes = mixed(&path);
        let reader = TensorReader::open(&path, 1 << 20).unwrap();
        assert_eq!(reader.metadata().unwrap()["k"], "v");
        let names: Vec<String> = reader.tensors().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names.len(), 3);
        let (read, hash) = reader.read_f32(|name, _| name != "c").unwrap();
        assert_eq!(hash, fnv1a64(&bytes), "every byte, kept or not");
        let got: Vec<(&str, &[usize], Dtype, &[f32])> = read
            .iter()
            .map(|t| {
                (
                    t.name.as_str(),
                    t.shape.as_slice(),
                    t.stored,
                    t.values.as_slice(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("a", &[3][..], Dtype::F32, &[1.5, -2.0, 3.25][..]),
                ("b", &[1, 2][..], Dtype::BF16, &[0.5, 7.0][..]),
            ]
        );
        let (read, _) = TensorReader::open(&path, 1 << 20)
            .unwrap()
            .read_f32(|name, _| name == "c")
            .unwrap();
        assert_eq!(read[0].values, vec![-0.25]);
    }

    #[test]
    fn damaged_files_are_refused_with_a_reason() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let bytes = mixed(&path);
        let open = |b: &[u8]| {
            std::fs::write(&path, b).unwrap();
            TensorReader::open(&path, 1 << 20).and_then(|r| r.read_f32(|_, _| true))
        };
        let err = |b: &[u8]| open(b).err().expect("refused").to_string();
        assert!(err(&bytes[..5]).contains("too few for a header"));
        assert!(err(&bytes[..bytes.len() - 2]).contains("the file holds"));
        let mut long = bytes.clone();
        long.extend_from_slice(&[0; 4]);
        assert!(err(&long).contains("the file holds"));
        let mut huge = bytes.clone();
        huge[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(err(&huge).contains("header says it is"));
        let mut garbled = bytes.clone();
        garbled[9] = b'!';
        assert!(err(&garbled).contains("its header"));
        assert!(open(&bytes).is_ok());
        // Too large for the cap: refused before it is read.
        let capped = TensorReader::open(&path, 16)
            .err()
            .expect("refused")
            .to_string();
        assert!(capped.contains("larger than"), "{capped}");
    }

    #[test]
    fn a_kept_tensor_of_another_dtype_is_refused_and_an_unkept_one_skipped() {
        use safetensors::tensor::TensorView;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("i.safetensors");
        let ints: Vec<u8> = [1i64, 2].iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = TensorView::new(Dtype::I64, vec![2], &ints).unwrap();
        std::fs::write(&path, safetensors::serialize([("i", view)], None).unwrap()).unwrap();
        let kept = TensorReader::open(&path, 1 << 20)
            .unwrap()
            .read_f32(|_, _| true);
        assert!(kept.err().unwrap().to_string().contains("i is I64"));
        let (read, _) = TensorReader::open(&path, 1 << 20)
            .unwrap()
            .read_f32(|_, _| false)
            .unwrap();
        assert!(read.is_empty());
    }
}
