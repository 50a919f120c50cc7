//! Tensor statistics of device outputs: one launch for up to 16 tensors, each tensor's last
//! block writing its row of results; a batch of them, started op by op (a traced pass: launched
//! 16 at a time) or all at once (an attention call's outputs), comes back in one copy with one
//! wait ([`DeviceStatsBatch`]). Small tensors already on the host are summed there.

use super::device::buffer::PinnedBytes;
use super::device::kernels::{
    fresh_stats_rows, STATS_JOBS, STATS_PARTIAL_WIDTH, STATS_RESULT_WIDTH,
};
use super::device::{DevBuf, DevF64};
use super::CudaBackend;
use crate::backend::StatsBatch;
use crate::error::Result;
use crate::stats::TensorStats;
use crate::tensor::{DType, DeviceBuffer, Tensor};
use std::sync::{Arc, Mutex};

/// Blocks of one tensor's statistics at most (its rows of partials).
const MAX_BLOCKS: usize = 512;

/// Tensors whose statistics one launch computes at most.
const SLOTS: usize = STATS_JOBS;

/// The device buffers of the statistics pass, made once per backend (one for its own calls, one
/// for the sink's batches).
pub(super) struct StatsScratch {
    /// One row per block of a launch; launches on the one stream reuse it in turn.
    partials: DevF64,
    /// One result row per tensor, each with its accumulator (made at identity; each launch
    /// leaves it so).
    results: DevF64,
    /// Where the result rows are copied back.
    host: PinnedBytes,
}

impl StatsScratch {
    fn new(backend: &CudaBackend) -> Result<StatsScratch> {
        let gpu = backend.gpu();
        Ok(StatsScratch {
            partials: gpu.alloc_vec::<f64>(SLOTS * MAX_BLOCKS * STATS_PARTIAL_WIDTH)?,
            results: gpu.upload_vec(&fresh_stats_rows(BATCH_ROWS))?,
            host: gpu.alloc_pinned(BATCH_ROWS * STATS_RESULT_WIDTH * 8)?,
        })
    }

    /// Result rows `0..count` copied back (one wait).
    fn download(&mut self, backend: &CudaBackend, count: usize) -> Result<Vec<f64>> {
        backend
            .gpu()
            .download_vec_pinned(&self.results, count * STATS_RESULT_WIDTH, &mut self.host)
    }
}

/// Result rows of a scratch: the statistics of this many device tensors wait for one copy back
/// (a batch that fills it copies back and starts again).
const BATCH_ROWS: usize = 1024;

/// The device buffer on device `ordinal` to compute `t`'s statistics on, or none to sum its host
/// copy (a buffer on another rank's device is summed on the host).
fn on_device(t: &Tensor, ordinal: usize) -> Option<&DevBuf> {
    t.device()
        .and_then(|d| d.as_any().downcast_ref::<DevBuf>())
        .filter(|b| b.ordinal() == ordinal)
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
    /// computed there, in one batch over the backend's own scratch (one copy back); the others
    /// on the host. Device runs are checked within a tolerance, so the faster, reordered host
    /// pass will do, and it is what a failed device pass falls back to.
    pub(super) fn tensors_stats(&self, ts: &[&Tensor]) -> Vec<TensorStats> {
        let mut batch = DeviceStatsBatch::new(self, &self.stats_scratch);
        batch
            .start(ts)
            .and_then(|()| batch.collect())
            .unwrap_or_else(|_| {
                ts.iter()
                    .map(|t| TensorStats::of_unordered(t.data()))
                    .collect()
            })
    }
}

/// A tensor's statistics in a batch: computed, or waiting in a result row on the device.
enum Part {
    Ready(TensorStats),
    /// Result row, elements.
    Row(usize, usize),
}

/// [`StatsBatch`] on the device: each tensor's pass goes into a result row of its own, launched
/// for up to [`SLOTS`] tensors at once (a launch costs the host about as much as the op whose
/// output it sums), and the rows come back in one copy when collected. A tensor waiting for its
/// launch is held (its buffer cannot be reused meanwhile); outputs are never written after their
/// op, so the launch sees what the op wrote.
pub struct DeviceStatsBatch<'a> {
    backend: &'a CudaBackend,
    /// Where the scratch is kept between batches.
    slot: &'a Mutex<Option<StatsScratch>>,
    scratch: Option<StatsScratch>,
    parts: Vec<Part>,
    /// Result rows in use, the last `waiting.len()` of them not launched yet.
    used: usize,
    /// The buffers whose pass is not launched yet, in row order.
    waiting: Vec<Arc<dyn DeviceBuffer>>,
}

impl<'a> DeviceStatsBatch<'a> {
    /// A batch over the scratch kept in `slot` (made on first use; one batch holds it at a
    /// time, another meanwhile makes its own).
    pub(super) fn new(
        backend: &'a CudaBackend,
        slot: &'a Mutex<Option<StatsScratch>>,
    ) -> DeviceStatsBatch<'a> {
        let kept = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        DeviceStatsBatch {
            backend,
            slot,
            scratch: kept,
            parts: Vec::new(),
            used: 0,
            waiting: Vec::new(),
        }
    }

    /// Launches the pass of the waiting buffers, one launch for all.
    fn launch(&mut self) -> Result<()> {
        let Some(scratch) = &self.scratch else {
            return Ok(());
        };
        if self.waiting.is_empty() {
            return Ok(());
        }
        let bufs: Vec<&DevBuf> = self.waiting.iter().filter_map(|d| dev_buf(d)).collect();
        let first = self.used - self.waiting.len();
        self.backend
            .gpu
            .stats_many(&bufs, &scratch.partials, &scratch.results, first)?;
        self.waiting.clear();
        Ok(())
    }

    /// The rows in use copied back: every waiting part made ready, the rows free again.
    fn drain(&mut self) -> Result<()> {
        self.launch()?;
        let (Some(scratch), true) = (&mut self.scratch, self.used > 0) else {
            return Ok(());
        };
        let rows = scratch.download(self.backend, self.used)?;
        for part in &mut self.parts {
            if let Part::Row(r, count) = *part {
                let row = &rows[r * STATS_RESULT_WIDTH..(r + 1) * STATS_RESULT_WIDTH];
                *part = Part::Ready(stats_of(count, row));
            }
        }
        self.used = 0;
        Ok(())
    }

    /// The result row of device buffer `d`: the row of its earlier start if it still waits (an
    /// alias is summed once), else a new one, launched with the others once there are
    /// [`SLOTS`].
    fn row_of(&mut self, d: &Arc<dyn DeviceBuffer>, serial: u64) -> Result<usize> {
        let first = self.used - self.waiting.len();
        let same = |w: &Arc<dyn DeviceBuffer>| dev_buf(w).is_some_and(|b| b.serial() == serial);
        if let Some(i) = self.waiting.iter().position(same) {
            return Ok(first + i);
        }
        if self.used == BATCH_ROWS {
            self.drain()?;
        }
        self.waiting.push(d.clone());
        self.used += 1;
        let row = self.used - 1;
        if self.waiting.len() == SLOTS {
            self.launch()?;
        }
        Ok(row)
    }
}

/// The [`DevBuf`] behind a device tensor's buffer.
fn dev_buf(d: &Arc<dyn DeviceBuffer>) -> Option<&DevBuf> {
    d.as_any().downcast_ref::<DevBuf>()
}

impl StatsBatch for DeviceStatsBatch<'_> {
    fn start(&mut self, ts: &[&Tensor]) -> Result<()> {
        if self.scratch.is_none() {
            self.scratch = Some(StatsScratch::new(self.backend)?);
        }
        let ordinal = self.backend.gpu().ordinal();
        for t in ts {
            let part = match (on_device(t, ordinal), t.device()) {
                (Some(b), Some(d)) => Part::Row(self.row_of(d, b.serial())?, b.len()),
                _ => Part::Ready(TensorStats::of_unordered(t.data())),
            };
            self.parts.push(part);
        }
        Ok(())
    }

    fn collect(&mut self) -> Result<Vec<TensorStats>> {
        self.drain()?;
        Ok(std::mem::take(&mut self.parts)
            .into_iter()
            .map(|p| match p {
                Part::Ready(s) => s,
                Part::Row(..) => unreachable!("drained above"),
            })
            .collect())
    }
}

impl Drop for DeviceStatsBatch<'_> {
    /// Gives the scratch back for the next batch (the launches that leave its rows' counters
    /// zero come before the next batch's in the stream).
    fn drop(&mut self) {
        if let Some(scratch) = self.scratch.take() {
            *self.slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(scratch);
        }
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
