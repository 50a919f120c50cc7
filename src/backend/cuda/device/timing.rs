//! Device-event timing for the benches: calls issued back to back on the stream, or the same
//! calls captured once into a CUDA graph and replayed, as CUDA-graph serving runs a decode step
//! (the launches' gaps on the device shrink; the host issues one launch for them all).

use super::Gpu;
use crate::error::{CudaError, Error, Result};
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};

impl Gpu {
    /// Times `work` with device events: `reps` samples, each of `inner` back-to-back calls,
    /// after `warmup` untimed calls; returns milliseconds per call, one value per sample.
    pub fn time_ms(
        &self,
        warmup: usize,
        reps: usize,
        inner: usize,
        mut work: impl FnMut() -> Result<()>,
    ) -> Result<Vec<f64>> {
        for _ in 0..warmup {
            work()?;
        }
        self.synchronize()?;
        self.time_samples(reps, inner, || (0..inner.max(1)).try_for_each(|_| work()))
    }

    /// Times `work` replayed from a CUDA graph: `inner` calls captured once, then `reps` replays
    /// after a warm-up replay; returns milliseconds per call, one value per replay. `work` must
    /// have run before (kernels loaded, buffers made) and must only issue work to the stream
    /// (no waits, downloads or allocations).
    pub fn time_graph_ms(
        &self,
        reps: usize,
        inner: usize,
        mut work: impl FnMut() -> Result<()>,
    ) -> Result<Vec<f64>> {
        self.synchronize()?;
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(CudaError::driver("graph capture"))?;
        let captured = (0..inner.max(1)).try_for_each(|_| work());
        // The capture ends whatever `work` did, so that the stream is usable again.
        let graph = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(CudaError::driver("graph capture"));
        captured?;
        let graph = graph?.ok_or_else(|| Error::invalid("the graph capture took no work"))?;
        graph.upload().map_err(CudaError::driver("graph upload"))?;
        graph.launch().map_err(CudaError::driver("graph launch"))?;
        self.synchronize()?;
        self.time_samples(reps, inner, || {
            graph.launch().map_err(CudaError::driver("graph launch"))
        })
    }

    /// `reps` samples of `issue` between two device events, each divided by `inner`.
    fn time_samples(
        &self,
        reps: usize,
        inner: usize,
        mut issue: impl FnMut() -> Result<()>,
    ) -> Result<Vec<f64>> {
        let event = || {
            self.stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(CudaError::driver("event"))
        };
        let mut out = Vec::with_capacity(reps);
        for _ in 0..reps {
            let start = event()?;
            issue()?;
            let end = event()?;
            let ms = start
                .elapsed_ms(&end)
                .map_err(CudaError::driver("event timing"))?;
            out.push(ms as f64 / inner.max(1) as f64);
        }
        Ok(out)
    }
}
