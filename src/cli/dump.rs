//! `--dump FILE.safetensors`: the captured op outputs as F32 tensors named `PHASE/OPNAME`, with
//! metadata saying which run made them (`debug::external::meta_key`).

use crate::debug::external::DumpMeta;
use crate::engine::{Observer, OpEvent};
use crate::error::{Error, Result};
use crate::fsutil::write_atomic;
use crate::session::ModelSource;
use crate::tensor::Tensor;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::path::Path;

/// Collects the outputs to dump.
#[derive(Default)]
pub struct DumpCollector {
    pub tensors: Vec<(String, Vec<usize>, Vec<u8>)>,
}

impl DumpCollector {
    pub fn add(&mut self, event: &OpEvent, output: &Tensor) {
        let bytes = output.data().iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensors
            .push((event.dump_name(), output.shape().to_vec(), bytes));
    }

    /// Writes the collected tensors atomically, with `meta`.
    pub fn write(&self, path: &Path, meta: &DumpMeta) -> Result<()> {
        // safetensors needs unique names (it panics on a repeat).
        let mut seen = std::collections::HashSet::new();
        if let Some((name, ..)) = self.tensors.iter().find(|(n, ..)| !seen.insert(n)) {
            return Err(Error::invalid(format!(
                "writing {}: two op outputs are both named {name}",
                path.display()
            )));
        }
        let views: Vec<(String, TensorView<'_>)> = self
            .tensors
            .iter()
            .map(|(name, shape, bytes)| {
                TensorView::new(Dtype::F32, shape.clone(), bytes)
                    .map(|v| (name.clone(), v))
                    .map_err(|e| Error::invalid(format!("dump of {name}: {e}")))
            })
            .collect::<Result<_>>()?;
        let bytes = safetensors::serialize(views, Some(meta.to_map()))
            .map_err(|e| Error::invalid(format!("writing {}: {e}", path.display())))?;
        write_atomic(path, &bytes)
    }
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
