//! Tensor statistics of device outputs: one launch for up to 16 tensors, each tensor's last
//! block writing its row of results; a batch of them, started op by op (a traced pass) or all at
//! once (an attention call's outputs), comes back in one copy with one wait
//! ([`DeviceStatsBatch`]). Small tensors already on the host are summed there.

use super::device::buffer::PinnedBytes;
use super::device::kernels::{
    fresh_stats_rows, STATS_JOBS, STATS_PARTIAL_WIDTH, STATS_RESULT_WIDTH,
};
use super::device::{DevBuf, DevF64};
use super::CudaBackend;
use crate::backend::StatsBatch;
use crate::error::Result;
use crate::stats::TensorStats;
use crate::tensor::{DType, Tensor};
use std::sync::Mutex;

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

/// [`StatsBatch`] on the device: each tensor's pass is launched when started (so that later
/// writes to its buffer do not reach it) into a result row of its own, and the rows come back in
/// one copy when collected.
pub struct DeviceStatsBatch<'a> {
    backend: &'a CudaBackend,
    /// Where the scratch is kept between batches.
    slot: &'a Mutex<Option<StatsScratch>>,
    scratch: Option<StatsScratch>,
    parts: Vec<Part>,
    /// Result rows in use.
    used: usize,
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
        }
    }

    /// The rows in use copied back: every waiting part made ready, the rows free again.
    fn drain(&mut self) -> Result<()> {
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
}

impl StatsBatch for DeviceStatsBatch<'_> {
    fn start(&mut self, ts: &[&Tensor]) -> Result<()> {
        if ts.len() > BATCH_ROWS {
            return ts.chunks(BATCH_ROWS).try_for_each(|c| self.start(c));
        }
        if self.scratch.is_none() {
            self.scratch = Some(StatsScratch::new(self.backend)?);
        }
        // One pass per distinct buffer (an alias is summed once), SLOTS to a launch.
        let mut distinct: Vec<&DevBuf> = Vec::new();
        let mut rows = Vec::with_capacity(ts.len());
        let ordinal = self.backend.gpu().ordinal();
        for t in ts {
            rows.push(on_device(t, ordinal).map(|b| {
                distinct
                    .iter()
                    .position(|d| d.serial() == b.serial())
                    .unwrap_or_else(|| {
                        distinct.push(b);
                        distinct.len() - 1
                    })
            }));
        }
        if self.used + distinct.len() > BATCH_ROWS {
            self.drain()?;
        }
        let scratch = self.scratch.as_ref().expect("made above");
        for (i, chunk) in distinct.chunks(SLOTS).enumerate() {
            let first = self.used + i * SLOTS;
            self.backend
                .gpu
                .stats_many(chunk, &scratch.partials, &scratch.results, first)?;
        }
        for (t, row) in ts.iter().zip(rows) {
            self.parts.push(match row {
                Some(r) => Part::Row(self.used + r, distinct[r].len()),
                None => Part::Ready(TensorStats::of_unordered(t.data())),
            });
        }
        self.used += distinct.len();
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
