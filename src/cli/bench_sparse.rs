//! `mladb bench --device cuda`: the sparse MLA decode (attention over the DSA indexer's top-k
//! keys, as GLM-5 decodes) at GLM-5's latent dims, over the bf16 cache and the fp8_ds_mla one,
//! in GB/s of the bytes it gathers (the listed cache rows, the query and the output) against the
//! device's copy bandwidth, each shape checked against the f64 reference (over the FP8 cache:
//! the rows as the CPU codec decodes them).

use super::bench_fp8::fp8_cache;
use super::bench_timing::{random, rotating_copies, time};
use super::Out;
use crate::backend::cuda::device::{DevBuf, DevVec, Elem, Gpu};
use crate::backend::cuda::fast::{self, DecodeShape, DecodeWork, LATENT, PAGE, ROPE};
use crate::error::{Error, Result};
use crate::ops::kv_fp8::{self, Fp8Faults};

/// `count` distinct positions below `context`, sorted (a DSA selection), from `seed`.
fn selection(context: usize, count: usize, seed: u64) -> Vec<i32> {
    let mut x = seed | 1;
    let mut all: Vec<i32> = (0..context as i32).collect();
    for i in 0..count.min(context) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let j = i + (x % (context - i) as u64) as usize;
        all.swap(i, j);
    }
    let mut chosen = all[..count.min(context)].to_vec();
    chosen.sort_unstable();
    chosen
}

/// (µs, GB/s gathered, worst error, splits, kernel) of one sparse decode shape, over an
/// fp8_ds_mla cache written from the same random rows when `fp8`; `forced`: the kernel (a
/// sparse variant of that cache) instead of the device's choice.
fn sparse_shape(
    gpu: &Gpu,
    (batch, context, topk, heads): (usize, usize, usize, usize),
    fp8: bool,
    forced: Option<&'static str>,
    seed: u64,
) -> Result<(f64, f64, f64, usize, &'static str)> {
    let width = LATENT + ROPE;
    let pages_per_seq = context.div_ceil(PAGE);
    let slots = batch * pages_per_seq * PAGE;
    // The cache rotates among copies (bench_timing's rotating_copies), as many as the rows a call
    // gathers ask for (at batch 1, 2048 rows of a 32k cache: more copies than the cache's size
    // would); copy 0 is checked.
    let caches: Vec<DevBuf> = (0..rotating_copies(batch * topk * width * 2))
        .map(|i| random(gpu, slots * width, Elem::Bf16, seed + 10 * i as u64, 1.0))
        .collect::<Result<_>>()?;
    let cache = &caches[0];
    let q = random(gpu, batch * heads * width, Elem::Bf16, seed + 1, 1.0)?;
    let table: Vec<i32> = (0..(batch * pages_per_seq) as i32).collect();
    let table = gpu.upload_i32(&table)?;
    let lists: Vec<Vec<i32>> = (0..batch)
        .map(|b| selection(context, topk, seed + 7 * b as u64))
        .collect();
    let indices: Vec<i32> = lists.iter().flatten().copied().collect();
    let indices_dev = gpu.upload_i32(&indices)?;
    let lens = gpu.upload_i32(&vec![topk as i32; batch])?;
    let out = gpu.alloc(batch * heads * LATENT, Elem::Bf16)?;
    let lse = gpu.alloc(batch * heads, Elem::F32)?;
    gpu.fill(&out, true)?;
    let shape = DecodeShape {
        batch,
        heads,
        max_pages: pages_per_seq,
        max_len: topk,
    };
    let scale = 1.0 / 256f32.sqrt();
    let keys = (&indices_dev, topk);
    // Over the FP8 cache: a copy written from each bf16 one.
    let fp8_caches: Vec<DevVec<u8>> = if fp8 {
        let all = gpu.upload_i32(&(0..slots as i32).collect::<Vec<_>>())?;
        caches
            .iter()
            .map(|rows| fp8_cache(gpu, rows, &all))
            .collect::<Result<_>>()?
    } else {
        Vec::new()
    };
    let work = if fp8 {
        DecodeWork::for_fp8_sparse(gpu, shape, forced, None)?
    } else {
        DecodeWork::sparse(gpu, shape, None, forced)?
    };
    let run = |copy: usize| {
        match fp8_caches.get(copy) {
            Some(bytes) => fast::mla_decode_fp8_sparse(
                gpu, shape, &q, bytes, &table, keys, &lens, scale, &out, &lse, &work,
            ),
            None => fast::mla_decode_sparse(
                gpu,
                shape,
                &q,
                &caches[copy],
                &table,
                keys,
                &lens,
                scale,
                &out,
                &lse,
                &work,
            ),
        }
        .map(|_| ())
    };
    let mut turn = 0;
    let ms = time(gpu, 15, || {
        turn = (turn + 1) % caches.len();
        run(turn)
    })?;
    run(0)?; // the output the check reads: copy 0's
    let mut worst: f64 = 0.0;
    for b in [0, batch - 1] {
        let rows: Vec<Vec<f32>> = lists[b]
            .iter()
            .map(|&p| {
                let row = b * pages_per_seq * PAGE + p as usize;
                let row = gpu.download_range(cache, row * width, width)?;
                if fp8 {
                    kv_fp8::round_trip(&row, Fp8Faults::default())
                } else {
                    Ok(row)
                }
            })
            .collect::<Result<_>>()?;
        for h in [0, heads - 1] {
            let qv = gpu.download_range(&q, (b * heads + h) * width, width)?;
            let got = gpu.download_range(&out, (b * heads + h) * LATENT, LATENT)?;
            let want = fast::reference_attention(
                &qv,
                rows.iter().map(|r| (&r[..], &r[..LATENT])),
                scale as f64,
            );
            worst = worst.max(fast::relative_error(&got, &want));
        }
    }
    let row_bytes = if fp8 { kv_fp8::TOKEN_BYTES } else { width * 2 };
    let bytes = (batch * topk * row_bytes + batch * heads * (width + LATENT) * 2) as f64;
    Ok((
        ms * 1e3,
        bytes / (ms * 1e-3) / 1e9,
        worst,
        work.splits,
        work.kernel,
    ))
}

/// The sparse decode table: top-k 2048 over 8k and 32k contexts, batch 1 and 64; over the
/// bf16 cache at 64 and 8 heads, over the fp8_ds_mla cache at 64, 32, 16 and 8 heads (where the
/// device runs its sparse kernels: sm_90 on). `forced`: the bf16 rows' kernel (a sparse variant).
/// At 16 and 32 heads, where the FP8 choice turns from the 16-head kernel to the wgmma one, the
/// other of the two is timed forced beside it, so the choice can be weighed on each device.
pub fn sparse_decode(
    gpu: &Gpu,
    copy_gbs: f64,
    quick: bool,
    forced: Option<&'static str>,
) -> Result<()> {
    writeln!(
        Out,
        "\nsparse MLA decode (top-k key lists, paged latent cache 512+64, bf16 or fp8_ds_mla); \
         GB/s of the rows gathered"
    )?;
    writeln!(
        Out,
        "{:>10} {:>6} {:>6} {:>8} {:>6} {:>10} {:>9} {:>8} {:>7} {:>10} {:>18}",
        "cache",
        "heads",
        "batch",
        "context",
        "topk",
        "time us",
        "GB/s",
        "of copy",
        "splits",
        "rel err",
        "kernel"
    )?;
    let shapes: &[(usize, usize)] = if quick {
        &[(64, 32768)]
    } else {
        &[(1, 32768), (64, 8192), (64, 32768)]
    };
    let fp8_kernels = fast::sparse_fp8_decode_variants_for(gpu);
    let fp8_runs = !fp8_kernels.is_empty();
    let caches: [(&str, bool, &[usize]); 2] = [
        ("bf16", false, &[64, 8]),
        ("fp8_ds_mla", true, &[64, 32, 16, 8]),
    ];
    for (cache, fp8, heads_list) in caches {
        if fp8 && !fp8_runs {
            writeln!(
                Out,
                "{cache:>10}: no sparse kernel over this cache on this device (sm_90 on)"
            )?;
            continue;
        }
        for &heads in heads_list {
            // The FP8 rows' kernels: the choice, then at 16 and 32 heads the other one forced.
            let kernels: &[Option<&'static str>] = match (fp8, heads) {
                (false, _) => &[forced],
                (true, 16) => &[None, Some("mla_sparse_wgmma_fp8")],
                (true, 32) => &[None, Some("mla_sparse_fp8_h16")],
                (true, _) => &[None],
            };
            for (&(batch, context), &kernel_forced) in shapes
                .iter()
                .flat_map(|shape| kernels.iter().map(move |k| (shape, k)))
            {
                if fp8 && kernel_forced.is_some_and(|k| !fp8_kernels.contains(&k)) {
                    continue;
                }
                let seed = (batch * 1000 + context + heads) as u64;
                let (us, gbs, err, splits, kernel) =
                    sparse_shape(gpu, (batch, context, 2048, heads), fp8, kernel_forced, seed)?;
                let mark = if fp8 && kernel_forced.is_some() {
                    " (forced)"
                } else {
                    ""
                };
                writeln!(
                    Out,
                    "{cache:>10} {heads:>6} {batch:>6} {context:>8} {:>6} {us:>10.1} {gbs:>9.0} {:>7.0}% {splits:>7} {err:>10.1e} {kernel:>18}{mark}",
                    2048,
                    100.0 * gbs / copy_gbs
                )?;
                if err.is_nan() || err >= 1e-2 {
                    return Err(Error::invalid(format!(
                        "sparse MLA decode over the {cache} cache at batch {batch}, context \
                         {context}, {heads} heads disagrees with the reference (relative error \
                         {err:.2e})"
                    )));
                }
            }
        }
    }
    Ok(())
}
