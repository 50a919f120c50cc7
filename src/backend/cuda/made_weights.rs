//! Synthetic weights made on the device from their recipes (the `synthetic_fill` kernel), so a
//! full-size model's generated weights never cross PCIe. The host copy of such a tensor, made
//! only when something reads it, is the CPU generator's values, exactly as a weight uploaded
//! from the host has them.

use super::device::{DevBuf, Elem, Gpu};
use crate::error::Result;
use crate::model::weights::{Recipe, WeightMaker};
use crate::tensor::{checked_numel, DeviceBuffer, Tensor};
use std::any::Any;
use std::sync::Arc;

/// Makes generated weights on one device, in the backend's storage type.
pub(super) struct DeviceWeights {
    pub gpu: Arc<Gpu>,
    pub elem: Elem,
}

impl WeightMaker for DeviceWeights {
    fn make(&self, shape: &[usize], recipe: Recipe) -> Result<Tensor> {
        let n = checked_numel(shape, "generated weight")?;
        let buf = self.gpu.alloc(n, self.elem)?;
        self.gpu.synthetic_fill(&buf, recipe)?;
        Ok(Tensor::from_device(
            shape,
            Arc::new(MadeBuffer { buf, recipe }),
        ))
    }
}

/// A weight made on the device: kernels read `buf` (it passes for a [`DevBuf`]); its values on
/// the host are made again there from the recipe, in f32, whatever the device stores.
struct MadeBuffer {
    buf: DevBuf,
    recipe: Recipe,
}

impl DeviceBuffer for MadeBuffer {
    fn address(&self) -> u64 {
        self.buf.address()
    }
    fn bytes(&self) -> usize {
        self.buf.bytes()
    }
    fn device_index(&self) -> usize {
        self.buf.ordinal()
    }
    /// The device buffer itself, so that the backend uses it as any other.
    fn as_any(&self) -> &dyn Any {
        &self.buf
    }
    fn download(&self) -> Result<Vec<f32>> {
        Ok(self.recipe.values(self.buf.len()))
    }
}
