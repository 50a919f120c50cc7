//! How `mladb bench --device cuda` times a call: event-timed samples of back-to-back calls
//! after a warm-up, their median; on the stream and replayed from a CUDA graph; and inputs that
//! rotate among copies, so that no call reads what an earlier one left in L2.

use crate::backend::cuda::device::{DevBuf, Elem, Gpu};
use crate::backend::DriverCall;
use crate::error::Result;

/// The largest L2 among the GPUs the bench is read on (H100 and H200: 50 MB).
const L2_BYTES: usize = 50 << 20;
/// What a timed loop cycles through at least, so that no call finds its inputs in L2 from an
/// earlier call: five times the L2.
const ROTATION_BYTES: usize = 5 * L2_BYTES;

/// How many copies of an input of `bytes` a timed loop rotates among: enough to cycle through
/// [`ROTATION_BYTES`] (one for inputs that large). A decode step in serving reads a cache the
/// other layers have long since pushed out of L2; timed back to back on one copy, a cache that
/// fits (batch 1 up to 8k) would be read from L2 instead, and the kernel would look faster than
/// it runs.
pub(super) fn rotating_copies(bytes: usize) -> usize {
    ROTATION_BYTES.div_ceil(bytes.max(1 << 20))
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Back-to-back calls per timed sample, so that one sample lasts about a millisecond or more:
/// from a probe of `work`'s time.
fn inner_calls(gpu: &Gpu, work: &mut impl FnMut() -> Result<()>) -> Result<usize> {
    let estimate_ms = median(gpu.time_ms(2, 3, 1, work)?);
    Ok((1.0 / estimate_ms.max(1e-3)).ceil().clamp(1.0, 200.0) as usize)
}

/// Milliseconds per call, median of `reps` samples.
pub(super) fn time(gpu: &Gpu, reps: usize, mut work: impl FnMut() -> Result<()>) -> Result<f64> {
    let inner = inner_calls(gpu, &mut work)?;
    Ok(median(gpu.time_ms(2, reps, inner, work)?))
}

/// One call's figures in milliseconds: back to back on the stream (median of `reps` samples),
/// the same calls replayed from a CUDA graph (as CUDA-graph serving runs a decode step) or why
/// they could not be (the table says so, and goes on with the stream's figures), and the host's
/// time to issue a call (median of `reps` bursts of calls issued after the stream drained).
pub(super) struct CallTimes {
    pub stream: f64,
    pub graph: std::result::Result<f64, String>,
    pub host: f64,
    /// Of `host`, the driver's kernel launches and its tensor-map encodes (the ledger's).
    pub host_launch: f64,
    pub host_maps: f64,
}

/// Times `work` three ways (see [`CallTimes`]). Where the host's time to issue a call comes
/// near the stream's time per call, the stream's figure is the launches' and not the kernels':
/// the graph's is then the device's.
pub(super) fn call_times(
    gpu: &Gpu,
    reps: usize,
    mut work: impl FnMut() -> Result<()>,
) -> Result<CallTimes> {
    let inner = inner_calls(gpu, &mut work)?;
    let stream = median(gpu.time_ms(2, reps, inner, &mut work)?);
    let mut host = Vec::with_capacity(reps);
    let before = gpu.driver_calls();
    for _ in 0..reps {
        gpu.synchronize()?;
        let start = std::time::Instant::now();
        (0..inner).try_for_each(|_| work())?;
        host.push(start.elapsed().as_secs_f64() * 1e3 / inner as f64);
    }
    let calls = gpu.driver_calls().since(&before);
    let per_call =
        |kind: DriverCall| calls.nanos[kind as usize] as f64 * 1e-6 / (reps * inner) as f64;
    gpu.synchronize()?;
    let graph = gpu.time_graph_ms(reps, inner, work).map(median);
    Ok(CallTimes {
        stream,
        graph: graph.map_err(|e| e.to_string()),
        host: median(host),
        host_launch: per_call(DriverCall::Launch),
        host_maps: per_call(DriverCall::TensorMap),
    })
}

pub(super) fn random(gpu: &Gpu, len: usize, elem: Elem, seed: u64, amp: f32) -> Result<DevBuf> {
    let buf = gpu.alloc(len, elem)?;
    gpu.fill_random(&buf, seed, amp)?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::fast::{LATENT, ROPE};
    use crate::ops::kv_fp8::TOKEN_BYTES;

    /// Every decode shape the bench times, in either cache format, cycles through more than
    /// twice the L2 (batch 1 × 1k is a 1.2 MB cache: eight copies of it, the old rule, sat in L2).
    #[test]
    fn every_decode_cache_rotates_out_of_l2() {
        for batch in [1, 16, 64, 128] {
            for context in [1024, 2048, 4096, 8192, 16384, 32768] {
                for token_bytes in [(LATENT + ROPE) * 2, TOKEN_BYTES] {
                    let bytes = batch * context * token_bytes;
                    let copies = rotating_copies(bytes);
                    assert!(
                        copies * bytes > 2 * L2_BYTES,
                        "{batch} × {context}: {copies} copies of {bytes} bytes"
                    );
                    assert!(copies == 1 || copies * bytes <= ROTATION_BYTES + bytes.max(1 << 20));
                }
            }
        }
        // The sparse decode at batch 1: the 2048 rows it gathers.
        let gathered = 2048 * (LATENT + ROPE) * 2;
        assert!(rotating_copies(gathered) * gathered > 2 * L2_BYTES);
    }
}
