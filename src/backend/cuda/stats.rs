//! Tensor statistics of device outputs: one pass on the device whose last block merges the
//! others' partials, so that one row of doubles comes back; the statistics of several tensors
//! (an attention call's outputs) come back in one copy, with one wait. Small tensors already on
//! the host are summed there.

use super::device::buffer::PinnedBytes;
use super::device::kernels::{STATS_RESULT_WIDTH, STATS_WIDTH};
use super::device::{DevBuf, DevF64};
use super::CudaBackend;
use crate::error::Result;
use crate::stats::TensorStats;
use crate::tensor::{DType, Tensor};

/// Blocks of the statistics pass at most (rows of partials).
const MAX_BLOCKS: usize = 512;

/// Tensors whose statistics one copy brings back at most.
const SLOTS: usize = 16;

/// The device buffers of the statistics pass, made once per backend.
pub(super) struct StatsScratch {
    /// One row per block of a launch; launches on the one stream reuse it in turn.
    partials: DevF64,
    /// One result row per tensor of a batch, each with its block counter (zeroed once).
    results: DevF64,
    /// Where the result rows are copied back.
    host: PinnedBytes,
}

/// The device buffer to compute `t`'s statistics on, or none to sum its host copy.
fn on_device(t: &Tensor) -> Option<&DevBuf> {
    t.device()
        .and_then(|d| d.as_any().downcast_ref::<DevBuf>())
        .filter(|_| t.dtype() == DType::F32 && (t.numel() >= DEVICE_STATS_FROM || !t.on_host()))
}

/// Below this many elements a tensor already on the host is summed there: a launch and its wait
/// would cost more than the pass.
const DEVICE_STATS_FROM: usize = 1 << 14;

impl CudaBackend {
    pub(super) fn tensor_stats(&self, t: &Tensor) -> TensorStats {
        self.tensors_stats(&[t])
            .pop()
            .expect("one statistics per tensor")
    }

    /// Statistics of each tensor: those on the device (large ones, and any without a host copy)
    /// computed there, all in one copy back; the others on the host. Device runs are checked
    /// within a tolerance, so the faster, reordered host pass will do.
    pub(super) fn tensors_stats(&self, ts: &[&Tensor]) -> Vec<TensorStats> {
        let bufs: Vec<Option<&DevBuf>> = ts.iter().map(|t| on_device(t)).collect();
        // One pass per distinct buffer: an alias (a split decode's merge op reports the output's
        // buffer) is summed once.
        let mut distinct: Vec<&DevBuf> = Vec::new();
        for b in bufs.iter().flatten() {
            if !distinct.iter().any(|d| d.serial() == b.serial()) {
                distinct.push(b);
            }
        }
        let device = self.device_stats(&distinct).ok();
        ts.iter()
            .zip(&bufs)
            .map(|(t, b)| match (b, &device) {
                (Some(b), Some(stats)) => {
                    let i = distinct.iter().position(|d| d.serial() == b.serial());
                    stats[i.expect("every device buffer is among the distinct ones")].clone()
                }
                _ => TensorStats::of_unordered(t.data()),
            })
            .collect()
    }

    /// Statistics of buffers computed on the device, one launch each, brought back together.
    pub fn device_stats(&self, bufs: &[&DevBuf]) -> Result<Vec<TensorStats>> {
        let mut scratch = self.stats_scratch.lock().unwrap_or_else(|e| e.into_inner());
        if scratch.is_none() {
            *scratch = Some(StatsScratch {
                partials: self.gpu.alloc_vec::<f64>(MAX_BLOCKS * STATS_WIDTH)?,
                results: self.gpu.upload_vec(&[0.0f64; SLOTS * STATS_RESULT_WIDTH])?,
                host: self.gpu.alloc_pinned(SLOTS * STATS_RESULT_WIDTH * 8)?,
            });
        }
        let scratch = scratch.as_mut().expect("allocated above");
        let mut out = Vec::with_capacity(bufs.len());
        for chunk in bufs.chunks(SLOTS) {
            for (slot, buf) in chunk.iter().enumerate() {
                self.gpu
                    .stats(buf, &scratch.partials, &scratch.results, slot)?;
            }
            let rows = self.gpu.download_vec_pinned(
                &scratch.results,
                chunk.len() * STATS_RESULT_WIDTH,
                &mut scratch.host,
            )?;
            out.extend(
                chunk
                    .iter()
                    .zip(rows.chunks_exact(STATS_RESULT_WIDTH))
                    .map(|(buf, row)| stats_of(buf.len(), row)),
            );
        }
        Ok(out)
    }
}

/// The statistics of `count` elements from the device pass's row of sums and counts.
fn stats_of(count: usize, acc: &[f64]) -> TensorStats {
    let finite = acc[5] as usize;
    let mut s = TensorStats {
        count,
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
    s
}
