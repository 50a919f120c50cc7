//! Reading the files `torch.save` writes (what SGLang's dumper leaves, one per tensor): a zip
//! archive, stored without compression, holding `PREFIX/data.pkl` (the object, pickled, with
//! each tensor's storage as a persistent id) and `PREFIX/data/KEY` (each storage's raw bytes,
//! little-endian). No Python is run: the pickle is read as data ([`super::pickle`]) and tensors
//! are rebuilt from `torch._utils._rebuild_tensor_v2`'s arguments.

use super::pickle::{self, Value};
use crate::error::{Error, Result};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The largest pickle read (SGLang's dumps hold a tensor and a small dict of tags).
const MAX_PICKLE: u64 = 64 << 20;

/// An opened torch file: its object, and the archive its tensors' bytes are read from.
pub struct TorchFile {
    pub root: Value,
    archive: Archive,
    prefix: String,
}

/// A tensor of the file, in f32, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct TorchTensor {
    /// The storage type torch names (`BFloat16Storage`, `FloatStorage`, ...).
    pub storage: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl TorchFile {
    pub fn open(path: &Path) -> Result<TorchFile> {
        let bad = |msg: String| Error::parse(path, msg);
        let file = crate::input::open_regular(path)?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let zip = zip::ZipArchive::new(file)
            .map_err(|e| bad(format!("not a torch.save file (a zip archive): {e}")))?;
        let mut archive = Archive {
            zip,
            path: path.to_path_buf(),
            len,
        };
        let pkl = (0..archive.zip.len())
            .filter_map(|i| {
                archive
                    .zip
                    .name_for_index(i)
                    .and_then(|n| n.ok())
                    .map(|n| n.to_string())
            })
            .find(|n| n == "data.pkl" || n.ends_with("/data.pkl"))
            .ok_or_else(|| bad("a zip archive without data.pkl: not a torch.save file".into()))?;
        let prefix = pkl.trim_end_matches("data.pkl").to_string();
        if let Some(order) = archive.entry(&format!("{prefix}byteorder"), 16)? {
            if order != b"little" {
                return Err(bad(format!(
                    "byte order {:?}: only little-endian files are read",
                    String::from_utf8_lossy(&order)
                )));
            }
        }
        let bytes = archive.entry(&pkl, MAX_PICKLE)?.expect("listed");
        let root = pickle::read(&bytes).map_err(|e| bad(format!("{pkl}: {e}")))?;
        Ok(TorchFile {
            root,
            archive,
            prefix,
        })
    }

    /// The tensor `value` rebuilds: `_rebuild_tensor_v2(storage, offset, size, stride, ...)`,
    /// possibly inside a parameter or a tensor subclass.
    pub fn tensor(&mut self, value: &Value) -> Result<TorchTensor> {
        let path = self.archive.path.clone();
        let bad = |msg: String| Error::parse(&path, msg);
        let Value::Call { func, args, .. } = value else {
            return Err(bad("the value is not a tensor".into()));
        };
        let Value::Global(module, name) = func.as_ref() else {
            return Err(bad("the value is not a tensor".into()));
        };
        let args = args.items().unwrap_or(&[]);
        match (module.as_str(), name.as_str()) {
            ("torch._utils", "_rebuild_tensor_v2") | ("torch._utils", "_rebuild_tensor") => {}
            // A parameter (its data first) or a subclass (the plain tensor's rebuild inside).
            ("torch._utils", "_rebuild_parameter" | "_rebuild_parameter_with_state") => {
                let inner = args.first().cloned().unwrap_or(Value::None);
                return self.tensor(&inner);
            }
            ("torch._tensor", "_rebuild_from_type_v2") => {
                let (Some(f), Some(a)) = (args.first(), args.get(2)) else {
                    return Err(bad("_rebuild_from_type_v2 without its arguments".into()));
                };
                let inner = Value::Call {
                    func: Box::new(f.clone()),
                    args: Box::new(a.clone()),
                    state: None,
                };
                return self.tensor(&inner);
            }
            (m, n) => {
                return Err(bad(format!(
                    "{m}.{n}: not a tensor mladb can rebuild (a plain dense tensor is)"
                )))
            }
        }
        let [Value::Persistent(id), offset, size, stride, ..] = args else {
            return Err(bad(
                "_rebuild_tensor_v2 with other arguments than torch writes".into(),
            ));
        };
        // ('storage', torch.XStorage, key, location, numel)
        let id = id.items().unwrap_or(&[]);
        let (Some(Value::Global(_, storage)), Some(key), Some(numel)) = (
            id.get(1),
            id.get(2).and_then(Value::as_str),
            id.get(4).and_then(Value::as_int),
        ) else {
            return Err(bad("a storage id other than torch writes".into()));
        };
        let width = element_width(storage).ok_or_else(|| {
            bad(format!(
                "{storage}: mladb reads float32, bfloat16, float16, float64 and integer tensors"
            ))
        })?;
        let ints = |v: &Value, what: &str| -> Result<Vec<usize>> {
            v.items()
                .ok_or_else(|| bad(format!("the tensor's {what} is not a tuple")))?
                .iter()
                .map(|x| {
                    x.as_int()
                        .and_then(|i| usize::try_from(i).ok())
                        .ok_or_else(|| bad(format!("the tensor's {what} holds {x:?}")))
                })
                .collect()
        };
        let shape = ints(size, "size")?;
        let stride = ints(stride, "stride")?;
        let offset = offset
            .as_int()
            .and_then(|i| usize::try_from(i).ok())
            .ok_or_else(|| bad("the tensor's storage offset is not a count".into()))?;
        let numel = usize::try_from(numel).map_err(|_| bad("a storage of negative size".into()))?;
        if stride.len() != shape.len() {
            return Err(bad(format!(
                "size {shape:?} and stride {stride:?} differ in rank"
            )));
        }
        // The last element any index reaches must lie inside the storage.
        let count = shape
            .iter()
            .try_fold(1usize, |a, &n| a.checked_mul(n))
            .ok_or_else(|| bad(format!("size {shape:?} overflows")))?;
        if count > 0 {
            let reach = shape
                .iter()
                .zip(&stride)
                .try_fold(offset, |a, (&n, &s)| a.checked_add((n - 1).checked_mul(s)?))
                .ok_or_else(|| bad(format!("size {shape:?} stride {stride:?} overflow")))?;
            if reach >= numel {
                return Err(bad(format!(
                    "size {shape:?}, stride {stride:?} and offset {offset} reach past the storage's {numel} elements"
                )));
            }
        }
        let bytes_needed = (numel as u64).saturating_mul(width as u64);
        let name = format!("{}data/{key}", self.prefix);
        let raw = self
            .archive
            .entry(&name, bytes_needed)?
            .ok_or_else(|| bad(format!("storage {key} is missing ({name})")))?;
        if raw.len() as u64 != bytes_needed {
            return Err(bad(format!(
                "storage {key} holds {} bytes, {numel} {storage} elements need {bytes_needed}",
                raw.len()
            )));
        }
        let element = |i: usize| value_at(storage, &raw[i * width..(i + 1) * width]);
        let mut data = Vec::with_capacity(count);
        let mut index = vec![0usize; shape.len()];
        for _ in 0..count {
            let at = offset + index.iter().zip(&stride).map(|(i, s)| i * s).sum::<usize>();
            data.push(element(at));
            for d in (0..index.len()).rev() {
                index[d] += 1;
                if index[d] < shape[d] {
                    break;
                }
                index[d] = 0;
            }
        }
        Ok(TorchTensor {
            storage: storage.clone(),
            shape,
            data,
        })
    }
}

/// The zip archive of a torch file, with its path and length (the most a stored entry holds).
struct Archive {
    zip: zip::ZipArchive<File>,
    path: PathBuf,
    len: u64,
}

impl Archive {
    /// An entry's bytes, `None` when the archive has no such entry; an entry larger than
    /// `limit`, or compressed (torch never compresses), is an error.
    fn entry(&mut self, name: &str, limit: u64) -> Result<Option<Vec<u8>>> {
        let path = &self.path;
        let entry = match self.zip.by_name(name) {
            Ok(e) => e,
            Err(zip::result::ZipError::FileNotFound) => return Ok(None),
            Err(e) => return Err(Error::parse(path, format!("{name}: {e}"))),
        };
        if entry.compression() != zip::CompressionMethod::Stored {
            return Err(Error::parse(
                path,
                format!("{name} is compressed; torch.save stores its entries uncompressed"),
            ));
        }
        // A stored entry cannot be larger than its archive: a size that says otherwise is a
        // lie, refused before anything is allocated for it.
        let most = limit.min(self.len);
        if entry.size() > most {
            return Err(Error::parse(
                path,
                format!(
                    "{name} says it holds {} bytes; at most {most} fit",
                    entry.size()
                ),
            ));
        }
        let mut bytes = Vec::with_capacity(entry.size() as usize);
        entry
            .take(most)
            .read_to_end(&mut bytes)
            .map_err(|e| Error::parse(path, format!("{name}: {e}")))?;
        Ok(Some(bytes))
    }
}

fn element_width(storage: &str) -> Option<usize> {
    Some(match storage {
        "FloatStorage" | "IntStorage" => 4,
        "BFloat16Storage" | "HalfStorage" | "ShortStorage" => 2,
        "DoubleStorage" | "LongStorage" => 8,
        "ByteStorage" | "CharStorage" | "BoolStorage" => 1,
        _ => return None,
    })
}

/// One element of a storage of type `storage`, as f32.
fn value_at(storage: &str, b: &[u8]) -> f32 {
    match storage {
        "FloatStorage" => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        "IntStorage" => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32,
        "BFloat16Storage" => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        "HalfStorage" => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
        "ShortStorage" => i16::from_le_bytes([b[0], b[1]]) as f32,
        "DoubleStorage" => f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32,
        "LongStorage" => i64::from_le_bytes(b.try_into().expect("8 bytes")) as f32,
        "CharStorage" => b[0] as i8 as f32,
        _ => b[0] as f32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/torch")
            .join(name)
    }

    /// Files torch 2.11 saved (tools/make_sglang_dump.py), read back to the values torch listed.
    #[test]
    fn reads_what_torch_saved_views_and_parameters_included() {
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap())
                .unwrap();
        let cases = expected.as_object().unwrap();
        assert_eq!(cases.len(), 4);
        for (name, want) in cases {
            let mut file = TorchFile::open(&fixture(&format!("{name}.pt"))).unwrap();
            let value = file.root.get("value").unwrap().clone();
            let t = file
                .tensor(&value)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let shape: Vec<usize> = serde_json::from_value(want["shape"].clone()).unwrap();
            let values: Vec<f32> = serde_json::from_value(want["values"].clone()).unwrap();
            assert_eq!(t.shape, shape, "{name}");
            assert_eq!(t.data, values, "{name}");
            assert_eq!(
                file.root.get("meta").and_then(|m| m.get("name")),
                Some(&Value::Str(name.clone()))
            );
        }
    }

    #[test]
    fn what_is_not_a_torch_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let not_zip = dir.path().join("x.pt");
        std::fs::write(&not_zip, b"not a zip at all").unwrap();
        let e = TorchFile::open(&not_zip).err().unwrap().to_string();
        assert!(
            e.contains("x.pt") && e.contains("not a torch.save file"),
            "{e}"
        );
        // A truncated file.
        let good = std::fs::read(fixture("int64.pt")).unwrap();
        let cut = dir.path().join("cut.pt");
        std::fs::write(&cut, &good[..good.len() / 2]).unwrap();
        assert!(TorchFile::open(&cut).is_err());
        // A storage entry that says it holds 2 GB in a file of a few hundred bytes: refused
        // before anything is allocated for it.
        let mut lying = good.clone();
        for sig in [[0x50, 0x4b, 0x03, 0x04], [0x50, 0x4b, 0x01, 0x02]] {
            // Local headers keep the sizes at 18 and 22, central entries at 20 and 24.
            let (at, name_len_at, name_at) = if sig[2] == 3 {
                (18, 26, 30)
            } else {
                (20, 28, 46)
            };
            let mut i = 0;
            while i + name_at < lying.len() {
                if lying[i..i + 4] == sig {
                    let n =
                        u16::from_le_bytes([lying[i + name_len_at], lying[i + name_len_at + 1]]);
                    let name = &lying[i + name_at..i + name_at + n as usize];
                    if name.ends_with(b"data/0") {
                        for off in [at, at + 4] {
                            lying[i + off..i + off + 4]
                                .copy_from_slice(&0x7fff_ffffu32.to_le_bytes());
                        }
                    }
                }
                i += 1;
            }
        }
        let lie = dir.path().join("lie.pt");
        std::fs::write(&lie, &lying).unwrap();
        let e = match TorchFile::open(&lie).and_then(|mut f| {
            let v = f.root.get("value").unwrap().clone();
            f.tensor(&v)
        }) {
            Ok(t) => panic!("read {t:?}"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("lie.pt"), "{e}");
    }
}
