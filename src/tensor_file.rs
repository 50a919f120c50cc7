//! F32 tensors written to a safetensors file a tensor at a time, atomically: a dump's tensors
//! (`run --dump`, `import`) and a session's companion of recorded outputs. `serialize_to_file`
//! asks each tensor for its bytes only as it writes it, so a writer holds the tensors' values
//! and one tensor's bytes, not a byte copy of every tensor and the whole file beside them.
//! (`serialize_to_file` writes through a temporary of its own, `.tmpXXXXXX` beside the target,
//! which it renames onto the atomic writer's: a kill in the middle can leave that one behind, the
//! target untouched.)

use crate::error::{Error, Result};
use crate::fsutil::write_atomic_with;
use crate::model::weights::synthetic::{fnv1a64_from, FNV1A64_START};
use safetensors::tensor::View;
use safetensors::Dtype;
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

/// One tensor of the file: its values as F32, turned into bytes only while the file takes them.
pub struct F32Tensor<'a> {
    pub name: String,
    pub shape: &'a [usize],
    pub data: &'a [f32],
}

impl View for F32Tensor<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.data.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
    fn data_len(&self) -> usize {
        self.data.len() * 4
    }
}

/// Writes `tensors` (names unique, each holding its shape's values) and `metadata` to `path`
/// atomically ([`write_atomic_with`]). `what` names a tensor in errors ("op output").
pub fn write_f32<'a>(
    path: &Path,
    metadata: Option<HashMap<String, String>>,
    tensors: impl IntoIterator<Item = F32Tensor<'a>>,
    what: &str,
) -> Result<()> {
    let tensors: Vec<F32Tensor<'a>> = tensors.into_iter().collect();
    // safetensors needs unique names (it panics on a repeat) and data that fills each shape.
    let mut seen = std::collections::HashSet::new();
    for t in &tensors {
        if !seen.insert(t.name.as_str()) {
            return Err(Error::invalid(format!(
                "writing {}: two {what}s are both named {}",
                path.display(),
                t.name
            )));
        }
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
    write_atomic_with(path, |tmp| {
        let named = tensors.into_iter().map(|t| (t.name.clone(), t));
        safetensors::serialize_to_file(named, metadata, tmp)
            .map_err(|e| Error::invalid(format!("writing {}: {e}", path.display())))
    })
}

/// The FNV-1a hash of a file's bytes, read a buffer at a time.
pub fn file_hash(path: &Path) -> Result<u64> {
    let io = |e| Error::io(path, e);
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut h = FNV1A64_START;
    loop {
        let n = file.read(&mut buf).map_err(io)?;
        if n == 0 {
            return Ok(h);
        }
        h = fnv1a64_from(h, &buf[..n]);
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
        write_f32(&path, None, tensors, "output").unwrap();
        let hash = file_hash(&path).unwrap();
        assert_eq!(hash, fnv1a64(&std::fs::read(&path).unwrap()));
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "no temporary left beside it");
    }
}
