//! Tensor statistics of device outputs: one pass on the device with per-block partials merged
//! there too, so that one row of doubles comes back; small tensors from their host copy.

use super::device::kernels::STATS_WIDTH;
use super::device::DevBuf;
use super::CudaBackend;
use crate::error::Result;
use crate::stats::TensorStats;
use crate::tensor::{DType, Tensor};

/// Blocks of the statistics pass at most (rows of partials).
const MAX_BLOCKS: usize = 1024;

impl CudaBackend {
    pub(super) fn tensor_stats(&self, t: &Tensor) -> TensorStats {
        // Small tensors are summed from their host copy (downloaded from the device, poison
        // included): a kernel launch and its wait would cost more than the pass.
        const DEVICE_STATS_FROM: usize = 1 << 14;
        match t.device().and_then(|d| d.as_any().downcast_ref::<DevBuf>()) {
            Some(buf) if t.dtype() == DType::F32 && t.numel() >= DEVICE_STATS_FROM => self
                .device_stats(buf)
                .unwrap_or_else(|_| TensorStats::of_unordered(t.data())),
            // Device runs are checked within a tolerance: the faster, reordered pass will do.
            _ => TensorStats::of_unordered(t.data()),
        }
    }

    /// Statistics computed on the device in one pass (partials per block), the partials merged
    /// on the device too, so that one row of 11 doubles comes back.
    pub fn device_stats(&self, buf: &DevBuf) -> Result<TensorStats> {
        let mut scratch = self.stats_scratch.lock().unwrap_or_else(|e| e.into_inner());
        if scratch.is_none() {
            *scratch = Some(self.gpu.alloc_vec::<f64>(MAX_BLOCKS * STATS_WIDTH)?);
        }
        let partials = scratch.as_ref().expect("allocated above");
        self.gpu.stats(buf, partials)?;
        let acc = self.gpu.download_vec(partials, STATS_WIDTH)?;
        let finite = acc[5] as usize;
        let mut s = TensorStats {
            count: buf.len(),
            min: f64::NAN,
            max: f64::NAN,
            mean: f64::NAN,
            std: f64::NAN,
            abs_max: 0.0,
            l2: 0.0,
            nan: acc[6] as usize,
            pos_inf: acc[7] as usize,
            neg_inf: acc[8] as usize,
            zeros: acc[9] as usize,
            unwritten: acc[10] as usize,
        };
        if finite > 0 {
            s.min = acc[2];
            s.max = acc[3];
            s.mean = acc[0] / finite as f64;
            s.std = (acc[1] / finite as f64 - s.mean * s.mean).max(0.0).sqrt();
            s.abs_max = acc[4];
            s.l2 = acc[1].sqrt();
        }
        Ok(s)
    }
}
