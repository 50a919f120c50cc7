//! `mladb bench --device cuda`: the decode over the FP8 latent cache (fp8_ds_mla, 656 bytes a
//! token) against the bf16 decode (1152 bytes a token) on the same shapes, in sequences per
//! second, the FP8 cache written by its write kernel from random bf16 rows.

use super::bench_gpu::{random, time};
use super::Out;
use crate::backend::cuda::device::{Elem, Gpu};
use crate::backend::cuda::fast::{self, DecodeShape, DecodeWork, LATENT, PAGE, ROPE};
use crate::error::Result;

/// Bytes of one token in the fp8_ds_mla cache.
const FP8_TOKEN: usize = 656;

/// (bf16 µs, fp8 µs, fp8 kernel) of one shape at 64 heads.
fn fp8_vs_bf16(gpu: &Gpu, batch: usize, context: usize, seed: u64) -> Result<(f64, f64, String)> {
    let (width, heads) = (LATENT + ROPE, 64);
    let pages_per_seq = context.div_ceil(PAGE);
    let slots = batch * pages_per_seq * PAGE;
    let rows = random(gpu, slots * width, Elem::Bf16, seed, 1.0)?;
    let cache = gpu.alloc_vec::<u8>(slots * FP8_TOKEN)?;
    let all: Vec<i32> = (0..slots as i32).collect();
    gpu.kv_fp8_write(&rows, &gpu.upload_i32(&all)?, &cache, slots, 0)?;
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
    let bf16 = time(gpu, 15, || {
        fast::mla_decode(
            gpu, shape, &q, &rows, &table, &lens, scale, &out, &lse, &bf16_work,
        )
        .map(|_| ())
    })?;
    let fp8_work = DecodeWork::for_fp8(gpu, shape, None, None)?;
    let fp8 = time(gpu, 15, || {
        fast::mla_decode_fp8(
            gpu, shape, &q, &cache, &table, &lens, scale, &out, &lse, &fp8_work,
        )
        .map(|_| ())
    })?;
    Ok((bf16 * 1e3, fp8 * 1e3, fp8_work.kernel.to_string()))
}

/// The FP8-cache decode beside the bf16 one: batch 64 and 1 at 8k, 64 heads.
pub fn fp8_decode(gpu: &Gpu) -> Result<()> {
    writeln!(
        Out,
        "\nMLA decode over the FP8 latent cache (fp8_ds_mla) vs the bf16 cache, 64 heads"
    )?;
    writeln!(
        Out,
        "{:>6} {:>8} {:>10} {:>10} {:>14} {:>16}",
        "batch", "context", "bf16 us", "fp8 us", "fp8 seq/s ×", "fp8 kernel"
    )?;
    for (batch, context) in [(64, 8192), (1, 8192)] {
        let (bf16, fp8, kernel) = fp8_vs_bf16(gpu, batch, context, (batch + context) as u64)?;
        writeln!(
            Out,
            "{batch:>6} {context:>8} {bf16:>10.1} {fp8:>10.1} {:>13.2}× {kernel:>16}",
            bf16 / fp8
        )?;
    }
    Ok(())
}
