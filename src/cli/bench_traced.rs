//! `mladb bench --device cuda`: what tracing costs the fast decode. One decode step at GLM-5's
//! latent dims, run the way the engine runs it (the backend's `fast_attention_latent`: the query
//! assembled on the device, the block table kept with the cache, the output, log-sum-exps and
//! split partials left on the device, statistics of the call's events) against the bare kernel
//! on the same buffers.
//!
//! The traced times are wall time per call (host work included): calls back to back whose
//! statistics are started on the device and brought back once (a traced `run` or `bench`, whose
//! observer takes late events), and one call with its wait (a debugger stepping op by op); the
//! bare time is event-timed on the device, calls back to back, as the kernel grid above. The
//! engine decodes one sequence at a time, so a batch here is the last `batch` tokens of one
//! sequence attending at once (a chunk of a chunked prefill over the cache, or a speculative
//! step): to the kernel, a batch of that many sequences of neighbouring lengths over the same
//! pages.

use super::bench_timing::median;
use super::Out;
use crate::backend::cuda::fast::{self, DecodeShape, DecodeWork, LATENT, ROPE};
use crate::backend::cuda::CudaBackend;
use crate::backend::{AttnMask, AttnParams, Backend, FastOutcome, MlaDims, StatsBatch};
use crate::engine::cache::LatentCache;
use crate::error::{Error, Result};
use crate::model::weights::synthetic::normalish;
use crate::ops::{AttnKernels, KernelFaults, RowSource};
use crate::tensor::Tensor;
use std::time::Instant;

/// Random inputs from the synthetic weights' generator.
fn random(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_vec(shape, (0..n as u64).map(|i| normalish(seed, i)).collect())
}

/// The times of one decode step, in ms.
struct StepTimes {
    /// The engine's call with the statistics of its ops started on the device and brought back
    /// once for many calls, as a pass for an observer that takes late events runs (wall per
    /// call over calls back to back).
    stream: f64,
    /// The engine's call with the statistics of its ops, one call and its wait (wall), as a
    /// debugger stepping op by op runs it.
    traced: f64,
    /// The engine's call alone (wall).
    call: f64,
    /// The driver calls of one traced call with its wait (every kind), and the host seconds
    /// of those that issue work (waits and downloads, which wait for the device, left out).
    driver_calls: f64,
    issue_secs: f64,
    /// The bare kernel, one call and a wait for it (wall).
    bare_wall: f64,
    /// The bare kernel (device time, calls back to back).
    bare: f64,
    splits: usize,
}

/// Calls back to back whose statistics come back together in the streamed figure.
const STREAM_CALLS: usize = 16;

/// The median wall time of `f` over 15 calls after 3, in ms.
fn wall_ms(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let times = (0..15)
        .map(|_| {
            let t = Instant::now();
            f().map(|()| t.elapsed().as_secs_f64() * 1e3)
        })
        .collect::<Result<_>>()?;
    Ok(median(times))
}

/// The times of one decode step of `batch` queries over `context` tokens with `heads` heads.
fn traced_step(
    backend: &CudaBackend,
    batch: usize,
    context: usize,
    heads: usize,
) -> Result<StepTimes> {
    let width = LATENT + ROPE;
    let mut cache = LatentCache::new(width, false);
    for t in 0..context {
        let row: Vec<f32> = (0..width as u64)
            .map(|i| normalish(7, (t * width) as u64 + i))
            .collect();
        cache.push(&row)?;
    }
    let dims = MlaDims {
        heads,
        nope: 192,
        rope: ROPE,
        v: 256,
        latent: LATENT,
    };
    let q_lat = random(&[batch, heads, LATENT], 1);
    let q_pe = random(&[batch, heads, ROPE], 2);
    let positions: Vec<usize> = (context - batch..context).collect();
    let mask = AttnMask::causal(positions.clone());
    let scale = 1.0 / 256f32.sqrt();
    let mut splits = 0;
    // `Some`: the statistics are started into this batch, not waited for.
    let mut call = |with_stats: bool, late: Option<&mut dyn StatsBatch>| -> Result<()> {
        let mut out = backend.alloc(&[batch, heads, LATENT], false)?;
        let outcome = backend.fast_attention_latent(
            &q_lat,
            &q_pe,
            &cache,
            AttnParams {
                dims,
                mask: &mask,
                scale,
                faults: KernelFaults::default(),
            },
            &mut out,
            AttnKernels::default(),
        )?;
        let FastOutcome::Ran(f) = outcome else {
            return Err(Error::invalid(
                "the fast decode declined the benchmark's shape",
            ));
        };
        splits = f.launches[0].splits as usize;
        if !with_stats {
            // The wait the statistics would have done.
            std::hint::black_box(backend.stats(&f.lse));
            return Ok(());
        }
        // The statistics the trace computes for the op's events, together (as the engine does).
        let mut events = vec![&f.lse, &out];
        if let Some((o, l)) = &f.partials {
            events.extend([o, l]);
        }
        match late {
            Some(b) => b.start(&events)?,
            None => _ = std::hint::black_box(backend.stats_many(&events)),
        }
        Ok(())
    };
    // The first call also uploads the cache.
    let traced = wall_ms(|| call(true, None))?;
    let (driver_calls, issue_secs) = driver_per_call(backend, || call(true, None))?;
    let call_alone = wall_ms(|| call(false, None))?;
    let stream = wall_ms(|| {
        let mut late = backend.stats_batch();
        for _ in 0..STREAM_CALLS {
            call(true, Some(&mut *late))?;
        }
        std::hint::black_box(late.collect()?);
        Ok(())
    })? / STREAM_CALLS as f64;

    // The bare kernel: the same shape on device buffers made once.
    let gpu = backend.gpu();
    let q = backend.concat_groups(&q_lat, &q_pe, heads)?;
    let q = gpu.upload(q.data(), backend.elem())?;
    let pages = cache.block_table().to_vec();
    let rows: Vec<f32> = (0..pages.len() * crate::ops::PAGE_SIZE)
        .flat_map(|s| {
            if s < context {
                cache.row(s).to_vec()
            } else {
                vec![0.0; width]
            }
        })
        .collect();
    let cache_dev = gpu.upload(&rows, backend.elem())?;
    let table: Vec<i32> = (0..batch).flat_map(|_| 0..pages.len() as i32).collect();
    let table = gpu.upload_i32(&table)?;
    let lens: Vec<i32> = positions.iter().map(|&p| p as i32 + 1).collect();
    let lens = gpu.upload_i32(&lens)?;
    let out = gpu.alloc(batch * heads * LATENT, backend.elem())?;
    let lse = gpu.alloc(batch * heads, crate::backend::cuda::device::Elem::F32)?;
    let shape = DecodeShape {
        batch,
        heads,
        max_pages: pages.len(),
        max_len: context,
    };
    let work = DecodeWork::new(gpu, shape)?;
    let run = || {
        fast::mla_decode(
            gpu, shape, &q, &cache_dev, &table, &lens, scale, &out, &lse, &work,
        )
        .map(|_| ())
    };
    let bare = median(gpu.time_ms(3, 15, 20, run)?);
    let bare_wall = wall_ms(|| run().and_then(|()| gpu.synchronize()))?;
    Ok(StepTimes {
        stream,
        traced,
        call: call_alone,
        driver_calls,
        issue_secs,
        bare_wall,
        bare,
        splits,
    })
}

/// The driver calls `f` makes, and the host seconds of those that issue work (all but waits
/// and downloads), per call over 5 calls.
fn driver_per_call(backend: &CudaBackend, mut f: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    const CALLS: u64 = 5;
    let before = backend.driver_calls().unwrap_or_default();
    for _ in 0..CALLS {
        f()?;
    }
    let (calls, issue) = backend
        .driver_calls()
        .unwrap_or_default()
        .since(&before)
        .issuing();
    Ok((calls as f64 / CALLS as f64, issue / CALLS as f64))
}

/// The traced-vs-bare table: batches 1 and 64 over contexts 1k, 8k and 32k at 64 heads (and 8,
/// a TP=8 rank).
pub fn traced_decode(backend: &CudaBackend, quick: bool) -> Result<()> {
    writeln!(
        Out,
        "\ntraced decode attention (latent 512+64, bf16): the engine's call with statistics of \
         its ops, wall time per call ({STREAM_CALLS} calls back to back, statistics brought back \
         once, as `run` and `bench` trace; and one call with its wait, as a debugger stepping \
         op by op), vs the bare kernel, device time; the driver calls of one call with its wait, \
         and the host time of those that issue work (waits and downloads apart)"
    )?;
    writeln!(
        Out,
        "{:>6} {:>6} {:>8} {:>7} {:>10} {:>9} {:>8} {:>10} {:>8} {:>7} {:>7} {:>7} {:>9}",
        "heads",
        "batch",
        "context",
        "splits",
        "stream us",
        "alone us",
        "call us",
        "bare wall",
        "bare us",
        "stream",
        "alone",
        "calls",
        "issue us"
    )?;
    let contexts: &[usize] = if quick { &[8192] } else { &[1024, 8192, 32768] };
    for heads in [64, 8] {
        for (batch, &context) in [1, 64]
            .into_iter()
            .flat_map(|b| contexts.iter().map(move |c| (b, c)))
        {
            let t = traced_step(backend, batch, context, heads)?;
            writeln!(
                Out,
                "{heads:>6} {batch:>6} {context:>8} {:>7} {:>10.1} {:>9.1} {:>8.1} {:>10.1} {:>8.1} {:>6.2}× {:>6.2}× {:>7.1} {:>9.1}",
                t.splits,
                t.stream * 1e3,
                t.traced * 1e3,
                t.call * 1e3,
                t.bare_wall * 1e3,
                t.bare * 1e3,
                t.stream / t.bare,
                t.traced / t.bare,
                t.driver_calls,
                t.issue_secs * 1e6
            )?;
        }
    }
    Ok(())
}
