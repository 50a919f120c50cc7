//! `mladb gguf`: inspect a GGUF file (metadata, tensor table, per-tensor statistics), dump one
//! tensor dequantized to safetensors, or time dequantization on this CPU.

use super::Out;
use crate::error::{Error, Result};
use crate::gguf::{dequantize_into, dequantize_into_par, GgmlType, GgufFile, TensorInfo};
use clap::Args;
use rayon::prelude::*;
use std::borrow::Cow;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug, Clone)]
pub struct GgufArgs {
    /// The GGUF file to inspect.
    #[arg(required_unless_present = "bench_dequant")]
    pub file: Option<PathBuf>,
    /// Show only this tensor (and select it for --dump and --stats).
    #[arg(long)]
    pub tensor: Option<String>,
    /// Write the --tensor dequantized to F32, under its own name and row-major shape.
    #[arg(long, value_name = "OUT.safetensors", requires = "tensor")]
    pub dump: Option<PathBuf>,
    /// Per-tensor statistics of the dequantized values (min, max, mean, std, NaN/Inf counts).
    #[arg(long)]
    pub stats: bool,
    /// Array items shown per metadata value before abbreviating.
    #[arg(long, default_value_t = 6)]
    pub max_items: usize,
    /// Time dequantization of every supported type on random valid blocks (no FILE needed).
    #[arg(long, conflicts_with_all = ["file", "tensor", "dump", "stats"])]
    pub bench_dequant: bool,
    /// With --bench-dequant: megabytes of quantized input per type.
    #[arg(long, default_value_t = 64, requires = "bench_dequant")]
    pub bench_mb: usize,
    /// With --bench-dequant: timed repetitions per type (best and median are reported).
    #[arg(long, default_value_t = 7, requires = "bench_dequant")]
    pub bench_reps: usize,
}

pub fn run(args: &GgufArgs) -> Result<()> {
    if args.bench_dequant {
        return bench_dequant(args.bench_mb, args.bench_reps);
    }
    let path = args
        .file
        .as_ref()
        .expect("clap requires FILE without --bench-dequant");
    let f = GgufFile::open(path)?;
    let selected: Vec<&TensorInfo> = match &args.tensor {
        Some(name) => vec![f.tensor(name)?],
        None => f.tensors().iter().collect(),
    };
    if let Some(out) = &args.dump {
        let t = selected[0];
        dump(&f, t, out)?;
        writeln!(
            Out,
            "wrote {} ({} {:?} → F32) to {}",
            clean(&t.name),
            t.ty,
            t.shape(),
            out.display()
        )?;
        return Ok(());
    }
    if args.stats {
        return print_stats(&f, &selected);
    }
    if args.tensor.is_none() {
        print_summary(&f, path, args.max_items)?;
    }
    print_tensors(&selected)
}

/// Control characters from a hostile file would drive the terminal: show them escaped.
fn clean(s: &str) -> Cow<'_, str> {
    if s.chars().any(char::is_control) {
        Cow::Owned(s.escape_debug().to_string())
    } else {
        Cow::Borrowed(s)
    }
}

/// Cuts a rendered value to `max` characters, saying how long it was.
fn cut(s: String, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        return s;
    }
    let head: String = s.chars().take(max).collect();
    format!("{head}… ({n} chars)")
}

fn print_summary(f: &GgufFile, path: &std::path::Path, max_items: usize) -> Result<()> {
    writeln!(
        Out,
        "{}: GGUF v{}, {} tensors, {} metadata entries, alignment {}, data at byte {}, {} bytes",
        path.display(),
        f.version(),
        f.tensors().len(),
        f.metadata().len(),
        f.alignment(),
        f.data_start(),
        f.file_len()
    )?;
    writeln!(Out, "\nmetadata")?;
    let width = f
        .metadata()
        .iter()
        .map(|(k, _)| k.chars().count())
        .max()
        .unwrap_or(0)
        .min(48);
    for (k, v) in f.metadata() {
        let ty = match v.as_array() {
            Some(a) => format!("[{}; {}]", a.element_type(), a.len()),
            None => v.value_type().to_string(),
        };
        let shown = cut(clean(&v.display(max_items)).into_owned(), 160);
        writeln!(Out, "  {:<width$}  {ty:<16} {shown}", clean(k))?;
    }
    writeln!(Out)
}

fn print_tensors(ts: &[&TensorInfo]) -> Result<()> {
    let width = ts
        .iter()
        .map(|t| t.name.chars().count())
        .max()
        .unwrap_or(4)
        .clamp(4, 64);
    writeln!(
        Out,
        "  {:<width$}  {:<7} {:<24} {:>14} {:>14}",
        "tensor", "type", "shape (row-major)", "bytes", "data offset"
    )?;
    for t in ts {
        writeln!(
            Out,
            "  {:<width$}  {:<7} {:<24} {:>14} {:>14}",
            clean(&t.name),
            t.ty.name(),
            format!("{:?}", t.shape()),
            t.n_bytes,
            t.offset
        )?;
    }
    let total: u64 = ts.iter().map(|t| t.n_bytes).sum();
    let values: u64 = ts.iter().map(|t| t.n_elements).sum();
    writeln!(
        Out,
        "  {} tensors, {values} values, {total} bytes",
        ts.len()
    )
}

/// Writes one tensor dequantized to f32, a buffer at a time (the values, not a byte copy beside
/// them).
fn dump(f: &GgufFile, t: &TensorInfo, out: &std::path::Path) -> Result<()> {
    let values = f.dequantize(&t.name)?;
    let shape: Vec<usize> = t.shape().iter().map(|&d| d as usize).collect();
    let tensor = crate::tensor_file::F32Tensor {
        name: t.name.clone(),
        shape: &shape,
        data: &values,
    };
    crate::tensor_file::write_f32(out, None, [tensor], "tensor").map(drop)
}

/// Running statistics over chunks (f64 sums), so a tensor never has to be dequantized whole.
#[derive(Default)]
struct Acc {
    n: u64,
    finite: u64,
    nan: u64,
    pos_inf: u64,
    neg_inf: u64,
    min: f64,
    max: f64,
    sum: f64,
    sum_sq: f64,
}

impl Acc {
    fn add(&mut self, v: &[f32]) {
        for &x in v {
            self.n += 1;
            if x.is_nan() {
                self.nan += 1;
            } else if x == f32::INFINITY {
                self.pos_inf += 1;
            } else if x == f32::NEG_INFINITY {
                self.neg_inf += 1;
            } else {
                let x = x as f64;
                if self.finite == 0 {
                    (self.min, self.max) = (x, x);
                }
                self.finite += 1;
                self.min = self.min.min(x);
                self.max = self.max.max(x);
                self.sum += x;
                self.sum_sq += x * x;
            }
        }
    }
}

fn num(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else if v != 0.0 && (v.abs() >= 1e5 || v.abs() < 1e-3) {
        format!("{v:.3e}")
    } else {
        format!("{v:.5}")
    }
}

fn tensor_stats(f: &GgufFile, t: &TensorInfo) -> Result<Acc> {
    // ~1M values per chunk, in whole blocks
    let blocks = (1usize << 20) / t.ty.block_size();
    let chunk_bytes = blocks.max(1) * t.ty.type_size();
    let chunk_vals = blocks.max(1) * t.ty.block_size();
    let mut buf = vec![0f32; chunk_vals.min(t.n_elements as usize)];
    let mut acc = Acc::default();
    for c in f.tensor_data(t).chunks(chunk_bytes) {
        let n = c.len() / t.ty.type_size() * t.ty.block_size();
        dequantize_into_par(t.ty, c, &mut buf[..n])?;
        acc.add(&buf[..n]);
    }
    Ok(acc)
}

fn print_stats(f: &GgufFile, ts: &[&TensorInfo]) -> Result<()> {
    let width = ts
        .iter()
        .map(|t| t.name.chars().count())
        .max()
        .unwrap_or(6)
        .clamp(6, 64);
    writeln!(
        Out,
        "  {:<width$}  {:<7} {:>11} {:>11} {:>11} {:>11} {:>8} {:>8}",
        "tensor", "type", "min", "max", "mean", "std", "nan", "inf"
    )?;
    for t in ts {
        if !t.ty.can_dequantize() {
            writeln!(
                Out,
                "  {:<width$}  {:<7} (dequantization of {} is not supported)",
                clean(&t.name),
                t.ty.name(),
                t.ty
            )?;
            continue;
        }
        let a = tensor_stats(f, t)?;
        let (mean, std) = if a.finite > 0 {
            let m = a.sum / a.finite as f64;
            (m, (a.sum_sq / a.finite as f64 - m * m).max(0.0).sqrt())
        } else {
            (f64::NAN, f64::NAN)
        };
        let (min, max) = if a.finite > 0 {
            (a.min, a.max)
        } else {
            (f64::NAN, f64::NAN)
        };
        writeln!(
            Out,
            "  {:<width$}  {:<7} {:>11} {:>11} {:>11} {:>11} {:>8} {:>8}",
            clean(&t.name),
            t.ty.name(),
            num(min),
            num(max),
            num(mean),
            num(std),
            a.nan,
            format!("{}/{}", a.pos_inf, a.neg_inf)
        )?;
    }
    Ok(())
}

// ---- the dequantization benchmark --------------------------------------------------------

/// Byte offsets of the f16 fields (scales, mins) in one block of `ty`: the bench fills them with
/// sane halves so the timed work is the ordinary path, not NaN/Inf arithmetic.
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q8_0 | Q4_0 | Q5_0 => &[0],
        Q4_1 | Q5_1 | Q4_K | Q5_K => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        _ => &[],
    }
}

/// `n_bytes` (rounded down to whole blocks) of random valid blocks of `ty`.
fn random_blocks(ty: GgmlType, n_bytes: usize, seed: u64) -> Vec<u8> {
    let ts = ty.type_size();
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let n = n_bytes / ts * ts;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        out.extend_from_slice(&next().to_le_bytes());
    }
    out.truncate(n);
    // a finite half of magnitude 2^-14 .. 2^1 with a random sign and mantissa
    let half = |r: u64| -> [u8; 2] {
        let exp = 1 + (r % 15) as u16; // biased exponents 1..=15
        ((((r >> 8) & 1) as u16) << 15 | (exp << 10) | ((r >> 16) as u16 & 0x3FF)).to_le_bytes()
    };
    match ty {
        GgmlType::F32 => {
            for c in out.chunks_exact_mut(4) {
                let v = (next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 | GgmlType::BF16 => {
            for c in out.chunks_exact_mut(2) {
                let v = (next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                let bits = if ty == GgmlType::F16 {
                    half::f16::from_f32(v).to_bits()
                } else {
                    half::bf16::from_f32(v).to_bits()
                };
                c.copy_from_slice(&bits.to_le_bytes());
            }
        }
        _ => {
            let fields = f16_fields(ty);
            for b in out.chunks_exact_mut(ts) {
                for &o in fields {
                    b[o..o + 2].copy_from_slice(&half(next()));
                }
            }
        }
    }
    out
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times dequantization of `mb` MB of random valid blocks per type, in 256 KiB input chunks
/// into a reused output buffer (as an on-the-fly quantized matmul would), on one thread and on
/// all of rayon's threads; reports GB/s of quantized input.
fn bench_dequant(mb: usize, reps: usize) -> Result<()> {
    if mb == 0 || reps == 0 || mb > 4096 {
        return Err(Error::invalid(
            "--bench-mb must be 1..=4096 and --bench-reps at least 1",
        ));
    }
    let threads = rayon::current_num_threads();
    writeln!(
        Out,
        "dequantization throughput: {mb} MB of quantized input per type, 256 KiB chunks, \
         best and median of {reps} runs; 1 thread and {threads} threads"
    )?;
    writeln!(
        Out,
        "  {:<6} {:>9} {:>11} {:>11} {:>13} {:>13} {:>11}",
        "type", "bits/val", "1T best", "1T median", "nT best", "nT median", "Gval/s nT"
    )?;
    for ty in GgmlType::DEQUANTIZABLE {
        let input = random_blocks(ty, mb << 20, 0x9E37_79B9 + ty.id() as u64);
        let chunk_blocks = ((256 << 10) / ty.type_size()).max(1);
        let chunk_bytes = chunk_blocks * ty.type_size();
        let chunk_vals = chunk_blocks * ty.block_size();
        let n_vals = input.len() / ty.type_size() * ty.block_size();
        let gb = input.len() as f64 / 1e9;

        let mut buf = vec![0f32; chunk_vals];
        let mut single = Vec::with_capacity(reps);
        for _ in 0..reps + 1 {
            let t0 = Instant::now();
            for c in input.chunks(chunk_bytes) {
                let n = c.len() / ty.type_size() * ty.block_size();
                dequantize_into(ty, c, &mut buf[..n])?;
            }
            single.push(t0.elapsed().as_secs_f64());
        }
        single.remove(0); // warm-up
        let mut multi = Vec::with_capacity(reps);
        for _ in 0..reps + 1 {
            let t0 = Instant::now();
            input.par_chunks(chunk_bytes).try_for_each_init(
                || vec![0f32; chunk_vals],
                |buf, c| {
                    let n = c.len() / ty.type_size() * ty.block_size();
                    dequantize_into(ty, c, &mut buf[..n])
                },
            )?;
            multi.push(t0.elapsed().as_secs_f64());
        }
        multi.remove(0);
        let best1 = single.iter().copied().fold(f64::INFINITY, f64::min);
        let bestn = multi.iter().copied().fold(f64::INFINITY, f64::min);
        let (med1, medn) = (median(&mut single), median(&mut multi));
        writeln!(
            Out,
            "  {:<6} {:>9.3} {:>6.2} GB/s {:>6.2} GB/s {:>8.2} GB/s {:>8.2} GB/s {:>11.2}",
            ty.name(),
            8.0 * ty.type_size() as f64 / ty.block_size() as f64,
            gb / best1,
            gb / med1,
            gb / bestn,
            gb / medn,
            n_vals as f64 / bestn / 1e9
        )?;
        std::hint::black_box(&buf);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_bench_blocks_are_finite() {
        for ty in GgmlType::DEQUANTIZABLE {
            let b = random_blocks(ty, 10_000, 5);
            assert_eq!(b.len() % ty.type_size(), 0);
            let v = crate::gguf::dequantize(ty, &b).unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "{ty}");
        }
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(clean("blk.0"), "blk.0");
        assert_eq!(clean("a\u{1b}[2Jb"), "a\\u{1b}[2Jb");
        assert_eq!(cut("abcdef".into(), 3), "abc… (6 chars)");
    }
}
