//! `mladb bench --device cuda`: what tracing costs the fast decode. One decode step of one
//! sequence at GLM-5's latent dims, run the way the engine runs it (the backend's
//! `fast_attention_latent`: the query assembled on the device, the block table uploaded, the
//! output, log-sum-exps and split partials copied back, statistics of the three ops) against the
//! bare kernel on the same buffers.
//!
//! The traced time is wall time per call (what the user waits for, host work included); the bare
//! time is event-timed on the device, as the kernel grid above. The engine decodes one sequence
//! at a time, so this is batch 1 (a serving batch of many sequences is the kernel grid's).

use super::bench_gpu::median;
use super::Out;
use crate::backend::cuda::fast::{self, DecodeShape, DecodeWork, LATENT, ROPE};
use crate::backend::cuda::CudaBackend;
use crate::backend::{AttnMask, Backend, FastOutcome, MlaDims};
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

/// (traced ms, bare ms, splits) of one decode step over `context` tokens with `heads` heads.
fn traced_step(backend: &CudaBackend, context: usize, heads: usize) -> Result<(f64, f64, usize)> {
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
    let q_lat = random(&[1, heads, LATENT], 1);
    let q_pe = random(&[1, heads, ROPE], 2);
    let mask = AttnMask::causal(vec![context - 1]);
    let scale = 1.0 / 256f32.sqrt();
    let mut splits = 0;
    let mut call = || -> Result<()> {
        let mut out = backend.alloc(&[1, heads, LATENT], false)?;
        let outcome = backend.fast_attention_latent(
            &q_lat,
            &q_pe,
            &cache,
            dims,
            &mask,
            scale,
            &mut out,
            AttnKernels::default(),
            KernelFaults::default(),
        )?;
        let FastOutcome::Ran(f) = outcome else {
            return Err(Error::invalid(
                "the fast decode declined the benchmark's shape",
            ));
        };
        splits = f.launches[0].splits as usize;
        // The statistics the trace computes for the op's three events.
        std::hint::black_box((
            backend.stats(&f.lse),
            f.partials
                .as_ref()
                .map(|(o, l)| (backend.stats(o), backend.stats(l))),
            backend.stats(&out),
        ));
        Ok(())
    };
    for _ in 0..3 {
        call()?; // the first also uploads the cache
    }
    let traced = median(
        (0..15)
            .map(|_| {
                let t = Instant::now();
                call().map(|()| t.elapsed().as_secs_f64() * 1e3)
            })
            .collect::<Result<_>>()?,
    );

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
    let table: Vec<i32> = (0..pages.len() as i32).collect();
    let table = gpu.upload_i32(&table)?;
    let lens = gpu.upload_i32(&[context as i32])?;
    let out = gpu.alloc(heads * LATENT, backend.elem())?;
    let lse = gpu.alloc(heads, crate::backend::cuda::device::Elem::F32)?;
    let shape = DecodeShape {
        batch: 1,
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
    Ok((traced, bare, splits))
}

/// The traced-vs-bare table, for contexts 1k, 8k and 32k at 64 heads (and 8, a TP=8 rank).
pub fn traced_decode(backend: &CudaBackend, quick: bool) -> Result<()> {
    writeln!(
        Out,
        "\ntraced decode attention (one sequence, latent 512+64, bf16): the engine's call with \
         statistics of its three ops, wall time, vs the bare kernel, device time"
    )?;
    writeln!(
        Out,
        "{:>6} {:>8} {:>7} {:>11} {:>9} {:>7}",
        "heads", "context", "splits", "traced us", "bare us", "ratio"
    )?;
    let contexts: &[usize] = if quick { &[8192] } else { &[1024, 8192, 32768] };
    for heads in [64, 8] {
        for &context in contexts {
            let (traced, bare, splits) = traced_step(backend, context, heads)?;
            writeln!(
                Out,
                "{heads:>6} {context:>8} {splits:>7} {:>11.1} {:>9.1} {:>6.1}×",
                traced * 1e3,
                bare * 1e3,
                traced / bare
            )?;
        }
    }
    Ok(())
}
