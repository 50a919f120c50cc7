//! `--dump FILE.safetensors`: the captured op outputs as F32 tensors named `PHASE/OPNAME`.

use crate::engine::{Observer, OpEvent};
use crate::error::{Error, Result};
use crate::fsutil::write_atomic;
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

    /// Writes the collected tensors atomically.
    pub fn write(&self, path: &Path) -> Result<()> {
        let views: Vec<(String, TensorView<'_>)> = self
            .tensors
            .iter()
            .map(|(name, shape, bytes)| {
                TensorView::new(Dtype::F32, shape.clone(), bytes)
                    .map(|v| (name.clone(), v))
                    .map_err(|e| Error::invalid(format!("dump of {name}: {e}")))
            })
            .collect::<Result<_>>()?;
        let bytes = safetensors::serialize(views, None)
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
