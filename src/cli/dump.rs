//! `--dump FILE.safetensors`: the captured op outputs as F32 tensors named `PHASE/OPNAME`, with
//! metadata saying which run made them (`debug::external::meta_key`).

use crate::debug::external::DumpMeta;
use crate::engine::{Observer, OpEvent};
use crate::error::Result;
use crate::session::ModelSource;
use crate::tensor::Tensor;
use crate::tensor_file::{write_f32, F32Tensor};
use std::path::Path;

/// Collects the outputs to dump.
#[derive(Default)]
pub struct DumpCollector {
    /// (name, shape, values) of each output, in the order they came.
    pub tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
}

impl DumpCollector {
    pub fn add(&mut self, event: &OpEvent, output: &Tensor) {
        self.tensors.push((
            event.dump_name(),
            output.shape().to_vec(),
            output.data().to_vec(),
        ));
    }

    /// Writes the collected tensors atomically, with `meta`.
    pub fn write(&self, path: &Path, meta: &DumpMeta) -> Result<()> {
        let tensors = self.tensors.iter().map(|(name, shape, data)| F32Tensor {
            name: name.clone(),
            shape,
            data,
        });
        write_dump(path, meta, tensors)
    }
}

/// Writes a dump (F32 tensors and the run's metadata) to `path` atomically, a tensor at a time
/// ([`crate::tensor_file`]).
pub fn write_dump<'a>(
    path: &Path,
    meta: &DumpMeta,
    tensors: impl IntoIterator<Item = F32Tensor<'a>>,
) -> Result<()> {
    write_f32(path, Some(meta.to_map()), tensors, "op output").map(drop)
}

impl Observer for DumpCollector {
    fn on_op(&mut self, event: &OpEvent, output: &Tensor) -> Result<()> {
        self.add(event, output);
        Ok(())
    }
}

/// The model as a dump's metadata names it.
pub fn model_text(source: &ModelSource) -> String {
    let (mut s, quant) = match source {
        ModelSource::Layout {
            layout,
            seed,
            quant,
        } => (format!("layout {layout}, seed {seed}"), quant),
        ModelSource::Checkpoint {
            path,
            fingerprint,
            quant,
        } => (
            format!("checkpoint {} ({fingerprint})", path.display()),
            quant,
        ),
    };
    if let Some(q) = quant {
        s.push_str(&format!(", quant {q}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::Dtype;

    fn meta() -> DumpMeta {
        DumpMeta {
            tokens: vec![1, 2, 3],
            prefill: 3,
            decode: 1,
            generated: vec![7],
            model: "layout glm5-tiny, seed 0".into(),
            flags: "absorbed".into(),
            producer: "mladb test".into(),
            dtype: None,
        }
    }

    fn tensors() -> Vec<(String, Vec<usize>, Vec<f32>)> {
        vec![
            (
                "prefill/a".into(),
                vec![2, 3],
                (0..6).map(|i| i as f32 * 0.5).collect(),
            ),
            (
                "decode0/b".into(),
                vec![4],
                vec![-1.0, f32::NAN, 3.25, 1e-30],
            ),
            ("prefill/c".into(), vec![0, 5], vec![]),
        ]
    }

    #[test]
    fn a_dump_written_a_tensor_at_a_time_is_the_file_serialize_makes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.safetensors");
        std::fs::write(&path, b"an older dump").unwrap();
        let dump = DumpCollector { tensors: tensors() };
        dump.write(&path, &meta()).unwrap();
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors()
            .into_iter()
            .map(|(n, s, d)| (n, s, d.iter().flat_map(|v| v.to_le_bytes()).collect()))
            .collect();
        let views = bytes.iter().map(|(n, s, b)| {
            let view = safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b).unwrap();
            (n.clone(), view)
        });
        let whole = safetensors::serialize(views, Some(meta().to_map())).unwrap();
        // The same tensors, bytes and metadata (whose keys a map orders as it likes).
        let file = std::fs::read(&path).unwrap();
        assert_eq!(file.len(), whole.len());
        let (a, b) = (
            safetensors::SafeTensors::deserialize(&file).unwrap(),
            safetensors::SafeTensors::deserialize(&whole).unwrap(),
        );
        let (_, meta_a) = safetensors::SafeTensors::read_metadata(&file).unwrap();
        let (_, meta_b) = safetensors::SafeTensors::read_metadata(&whole).unwrap();
        assert_eq!(meta_a.metadata(), meta_b.metadata());
        let mut tensors_a = a.tensors();
        let mut tensors_b = b.tensors();
        tensors_a.sort_by(|x, y| x.0.cmp(&y.0));
        tensors_b.sort_by(|x, y| x.0.cmp(&y.0));
        assert_eq!(tensors_a.len(), 3);
        for ((na, ta), (nb, tb)) in tensors_a.iter().zip(&tensors_b) {
            assert_eq!(na, nb);
            assert_eq!(
                (ta.dtype(), ta.shape(), ta.data()),
                (tb.dtype(), tb.shape(), tb.data())
            );
        }
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["d.safetensors"], "no temporary left beside it");
    }

    #[test]
    fn a_dump_that_cannot_be_written_leaves_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.safetensors");
        std::fs::write(&path, b"kept").unwrap();
        let mut twice = tensors();
        twice.push(twice[0].clone());
        let e = DumpCollector { tensors: twice }
            .write(&path, &meta())
            .unwrap_err();
        assert!(e.to_string().contains("both named prefill/a"), "{e}");
        let mut short = tensors();
        short[1].2.pop();
        let e = DumpCollector { tensors: short }
            .write(&path, &meta())
            .unwrap_err();
        assert!(e.to_string().contains("has 3 values for shape [4]"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"kept");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
