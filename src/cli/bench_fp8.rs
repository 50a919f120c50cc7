//! `mladb bench --device cuda`: the decode over the FP8 latent cache (fp8_ds_mla, 656 bytes a
//! token) against the bf16 decode (1152 bytes a token) on the same shapes, in sequences per
//! second, the FP8 cache written by its write kernel from random bf16 rows; both caches rotate
//! among copies, as the bf16 decode table's do.

use super::bench_timing::{random, rotating_copies, time};
use super::Out;
use crate::backend::cuda::device::{DevBuf, DevI32, DevVec, Elem, Gpu};
use crate::backend::cuda::fast::{self, DecodeShape, DecodeWork, LATENT, PAGE, ROPE};
use crate::error::Result;

/// One shape's times: the bf16 decode, the FP8-cache decode the device chooses (and its
/// kernel), and each kernel of [`FORCED`] forced where it is not the choice (`None` where it
/// is, or does not run).
struct Fp8Times {
    bf16: f64,
    fp8: f64,
    kernel: &'static str,
    forced: [Option<f64>; 3],
}

/// The fp8_ds_mla cache of the tokens `slots` names, written from bf16 `rows` by the GPU's
/// write kernel (slot i from row i).
pub(super) fn fp8_cache(gpu: &Gpu, rows: &DevBuf, slots: &DevI32) -> Result<DevVec<u8>> {
    let cache = gpu.alloc_vec::<u8>(slots.len() * crate::ops::kv_fp8::TOKEN_BYTES)?;
    gpu.kv_fp8_write(rows, slots, &cache, slots.len(), 0)?;
    Ok(cache)
}

/// [`Fp8Times`] of one shape, in µs.
fn fp8_vs_bf16(
    gpu: &Gpu,
    batch: usize,
    context: usize,
    heads: usize,
    seed: u64,
) -> Result<Fp8Times> {
    let width = LATENT + ROPE;
    let pages_per_seq = context.div_ceil(PAGE);
    let slots = batch * pages_per_seq * PAGE;
    // Each kind of cache rotates among its copies (each FP8 copy written from a bf16 one).
    let rows: Vec<DevBuf> = (0..rotating_copies(slots * width * 2))
        .map(|i| random(gpu, slots * width, Elem::Bf16, seed + 10 * i as u64, 1.0))
        .collect::<Result<_>>()?;
    let all = gpu.upload_i32(&(0..slots as i32).collect::<Vec<_>>())?;
    let caches: Vec<DevVec<u8>> = (0..rotating_copies(slots * crate::ops::kv_fp8::TOKEN_BYTES))
        .map(|i| fp8_cache(gpu, &rows[i % rows.len()], &all))
        .collect::<Result<_>>()?;
    let q = random(gpu, batch * heads * width, Elem::Bf16, seed + 1, 1.0)?;
    let table: Vec<i32> = (0..(batch * pages_per_seq) as i32).collect();
    let table = gpu.upload_i32(&table)?;
    let lens = gpu.upload_i32(&vec![context as i32; batch])?;
    let out = gpu.alloc(batch * heads * LATENT, Elem::Bf16)?;
    let lse = gpu.alloc(batch * heads, Elem::F32)?;
    let shape = DecodeShape {
        batch,
        heads,
        max_pages: pages_per_seq,
        max_len: context,
    };
    let scale = 1.0 / 256f32.sqrt();
    let bf16_work = DecodeWork::new(gpu, shape)?;
    let mut turn = 0;
    let bf16 = time(gpu, 15, || {
        turn = (turn + 1) % rows.len();
        let rows = &rows[turn];
        fast::mla_decode(
            gpu, shape, &q, rows, &table, &lens, scale, &out, &lse, &bf16_work,
        )
        .map(|_| ())
    })?;
    let fp8_time = |work: &DecodeWork| {
        let mut turn = 0;
        time(gpu, 15, || {
            turn = (turn + 1) % caches.len();
            let cache = &caches[turn];
            fast::mla_decode_fp8(
                gpu, shape, &q, cache, &table, &lens, scale, &out, &lse, work,
            )
            .map(|_| ())
        })
    };
    let fp8_work = DecodeWork::for_fp8(gpu, shape, None, None)?;
    let fp8 = fp8_time(&fp8_work)?;
    let runs = fast::fp8_decode_variants_for(gpu);
    let mut forced = [None; 3];
    for (time, kernel) in forced.iter_mut().zip(FORCED) {
        if runs.contains(&kernel) && fp8_work.kernel != kernel {
            *time = Some(fp8_time(&DecodeWork::for_fp8(gpu, shape, Some(kernel), None)?)? * 1e3);
        }
    }
    Ok(Fp8Times {
        bf16: bf16 * 1e3,
        fp8: fp8 * 1e3,
        kernel: fp8_work.kernel,
        forced,
    })
}

/// The FP8-cache kernels timed forced beside the choice: those for a rank's few heads (8 and
/// 16 heads a block) and the wgmma one (64, Hopper).
const FORCED: [&str; 3] = [
    "mla_decode_fp8_h8",
    "mla_decode_fp8_h16",
    "mla_decode_wgmma_fp8",
];

/// The FP8-cache decode beside the bf16 one: batch 64 and 1 at 8k, at 64 and 128 heads (a
/// whole GLM-5 or DeepSeek-V3 layer), at a tensor-parallel rank's 8 and 16 heads, and at 32
/// (where the choice turns from the few-heads kernels to the wgmma one) at batch 1, 16 and 64.
pub fn fp8_decode(gpu: &Gpu) -> Result<()> {
    writeln!(
        Out,
        "\nMLA decode over the FP8 latent cache (fp8_ds_mla) vs the bf16 cache (h8, h16, wgmma: \
         those kernels forced where they are not the choice)"
    )?;
    writeln!(
        Out,
        "{:>6} {:>8} {:>6} {:>10} {:>10} {:>12} {:>20} {:>10} {:>10} {:>10}",
        "batch",
        "context",
        "heads",
        "bf16 us",
        "fp8 us",
        "fp8 seq/s ×",
        "fp8 kernel",
        "h8 us",
        "h16 us",
        "wgmma us"
    )?;
    for (batch, context, heads) in [
        (64, 8192, 8),
        (64, 8192, 16),
        (64, 8192, 32),
        (64, 8192, 64),
        (64, 8192, 128),
        (1, 8192, 8),
        (1, 8192, 32),
        (1, 8192, 64),
        (16, 8192, 32),
    ] {
        let t = fp8_vs_bf16(gpu, batch, context, heads, (batch + context + heads) as u64)?;
        let [h8, h16, wgmma] = t
            .forced
            .map(|f| f.map_or("-".to_string(), |f| format!("{f:.1}")));
        writeln!(
            Out,
            "{batch:>6} {context:>8} {heads:>6} {:>10.1} {:>10.1} {:>11.2}× {:>20} {h8:>10} {h16:>10} {wgmma:>10}",
            t.bf16,
            t.fp8,
            t.bf16 / t.fp8,
            t.kernel
        )?;
    }
    Ok(())
}
