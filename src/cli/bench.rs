//! `mladb bench`: per-layer wall time of the forward pass, split into weight fetching and
//! compute, plus peak memory. A benchmark, not a test: it reports, it does not judge.

use super::args::{default_prompt, parse_layers, ModelArgs};
use super::Out;
use crate::backend::cpu::CpuBackend;
use crate::engine::generate::{self, Schedule};
use crate::engine::{Engine, EngineOptions, LayerTiming, MlaPaths, NullObserver, Phase};
use crate::error::Result;
use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Layers to run: A..B, A..=B or A (default 0..2).
    #[arg(long, default_value = "0..2")]
    pub layers: String,
    /// Prompt length (prefill tokens).
    #[arg(long, default_value_t = 3)]
    pub prompt: usize,
    /// Decode steps after the prefill.
    #[arg(long, default_value_t = 2)]
    pub decode: usize,
    /// Disable MLA absorption (naive decode).
    #[arg(long)]
    pub mla_disable: bool,
    /// Tensor-parallel ranks for the whole-layer timing (on CUDA: one GPU each where the host
    /// has them, joined by NCCL; the same layers at TP=1 are timed beside them).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Also time `check` (all detectors) against a plain run, both with weights already fetched.
    #[arg(long)]
    pub check: bool,
    /// Where to run: cpu, or cuda (the device's ceilings, the tensor-core MLA decode and
    /// prefill kernels at GLM-5 dimensions, then the layers above on the device).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
    /// With --device cuda: a small grid of kernel shapes.
    #[arg(long)]
    pub quick: bool,
    /// With --device cuda: skip the kernel grids, time only the layers.
    #[arg(long)]
    pub no_kernels: bool,
    /// With --device cuda: the decode shapes as BATCH:CONTEXT,... (default: the full grid).
    #[arg(long)]
    pub decode_shapes: Option<String>,
    /// With --device cuda: the prefill lengths as N,... (default: 1024,2048,4096,8192).
    #[arg(long)]
    pub prefill_lengths: Option<String>,
    /// With --device cuda: skip the whole-layer timing.
    #[arg(long)]
    pub no_layers: bool,
    /// With --device cuda: the head counts of the decode grid as H,... (default 64, GLM-5's;
    /// a rank under tensor parallelism holds 64/TP, DeepSeek-V3's 128/TP).
    #[arg(long)]
    pub decode_heads: Option<String>,
    /// With --device cuda: force a decode kernel variant (wgmma, kt3, ks3, ks2, kt16, t32, t16) for
    /// the bf16 decode tables.
    #[arg(long)]
    pub decode_variant: Option<String>,
    /// With --device cuda: force the split count of the bf16 decode table (1 to 256) instead of
    /// the split model's choice, to weigh the model against the kernel.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=crate::backend::cuda::fast::MAX_SPLITS as i64))]
    pub decode_splits: Option<u16>,
    /// With --device cuda: force a prefill kernel variant (wgmma, k128t64, r128t64, k64t32,
    /// r64t64, r128t32, r64t32).
    #[arg(long)]
    pub prefill_variant: Option<String>,
    /// Measure how fast `mladb attach` takes a hook's frames over loopback instead (no model).
    /// It reads --quick only: the flags it would ignore are refused (--device cpu aside).
    #[arg(long, conflicts_with_all = UNREAD_BY_ATTACH.iter().chain(&UNREAD_BY_ATTACH_INGEST))]
    pub attach_ingest: bool,
    /// Measure what `mladb attach`'s live comparison costs per step and per tensor, on the CPU,
    /// for this model, layers, prompt and decode count (mladb's own run stands in for the
    /// engine). Flags it would ignore (the GPU bench's, --tp, --check, ...) are refused.
    #[arg(long, conflicts_with_all = UNREAD_BY_ATTACH.iter().chain(&["quick"]))]
    pub attach_verdict: bool,
    /// Also run the layers once more with the device synchronised after every op, and print the
    /// ops of the prefill and of a decode step, slowest first (a profile: it serialises the run).
    #[arg(long)]
    pub op_times: bool,
}

/// What neither attach bench reads, refused beside one rather than ignored without a word: the
/// layer timing's flags and the GPU bench's (those of [`CUDA_ONLY`] by clap id, a test holds
/// them to it), but --quick, and --device, which [`bench`] refuses only as `cuda`.
const UNREAD_BY_ATTACH: [&str; 12] = [
    "no_kernels",
    "no_layers",
    "decode_shapes",
    "prefill_lengths",
    "decode_heads",
    "decode_variant",
    "decode_splits",
    "prefill_variant",
    "mla_disable",
    "tp",
    "check",
    "op_times",
];

/// What `--attach-ingest` does not read either: it takes --quick alone (no model, no schedule).
const UNREAD_BY_ATTACH_INGEST: [&str; 10] = [
    "attach_verdict",
    "layers",
    "prompt",
    "decode",
    "layout",
    "model",
    "seed",
    "weight_cache_mb",
    "device_cache_gb",
    "quant",
];

/// Peak resident memory of this process in bytes, where the OS tells it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The flags only the CUDA bench reads, in the order [`cuda_only_flag`] tests them.
const CUDA_ONLY: [&str; 9] = [
    "--quick",
    "--no-kernels",
    "--no-layers",
    "--decode-shapes",
    "--prefill-lengths",
    "--decode-heads",
    "--decode-variant",
    "--decode-splits",
    "--prefill-variant",
];

/// The first flag given that only the CUDA bench reads: on the CPU it would be ignored
/// silently, and a figure the user asked for would be missing without a word.
fn cuda_only_flag(args: &BenchArgs) -> Option<&'static str> {
    let given = [
        args.quick,
        args.no_kernels,
        args.no_layers,
        args.decode_shapes.is_some(),
        args.prefill_lengths.is_some(),
        args.decode_heads.is_some(),
        args.decode_variant.is_some(),
        args.decode_splits.is_some(),
        args.prefill_variant.is_some(),
    ];
    given
        .into_iter()
        .zip(CUDA_ONLY)
        .find_map(|(given, flag)| given.then_some(flag))
}

pub fn bench(args: &BenchArgs) -> Result<()> {
    if args.device == "cuda" && (args.attach_ingest || args.attach_verdict) {
        let mode = if args.attach_ingest {
            "--attach-ingest"
        } else {
            "--attach-verdict"
        };
        return Err(crate::error::Error::invalid(format!(
            "{mode} measures on the CPU: it takes no --device cuda"
        )));
    }
    if args.attach_ingest {
        return super::bench_attach::run(args.quick);
    }
    if args.attach_verdict {
        return super::bench_verdict::run(args);
    }
    if args.device == "cuda" {
        return super::bench_gpu::bench_gpu(args);
    }
    if let Some(flag) = cuda_only_flag(args) {
        return Err(crate::error::Error::invalid(format!(
            "{flag} is a flag of the GPU bench: it needs --device cuda"
        )));
    }
    let model = args.model.load()?;
    let layers = parse_layers(&args.layers, model.layout.num_layers)?;
    let paths = if args.mla_disable {
        MlaPaths::disabled()
    } else {
        MlaPaths::production()
    };
    let backend = CpuBackend;
    let mut engine = Engine::new(
        &model,
        &backend,
        EngineOptions {
            layers: layers.clone(),
            tp: args.tp,
            ..EngineOptions::new(&model, paths)
        },
    )?;
    let schedule = Schedule {
        prompt: default_prompt(model.layout.vocab_size, args.prompt.max(1)),
        prefill_len: args.prompt.max(1),
        decode_steps: args.decode,
    };
    let start = std::time::Instant::now();
    generate::run(&mut engine, &schedule, &mut NullObserver)?;
    let total = start.elapsed().as_secs_f64();
    writeln!(
        Out,
        "mladb bench: {} layers {}..{}, prompt {} tokens, {} decode steps, {} threads, tp {}",
        model.layout.name,
        layers.start,
        layers.end,
        schedule.prefill_len,
        args.decode,
        rayon::current_num_threads(),
        args.tp
    )?;
    writeln!(
        Out,
        "{:<10} {:>5} {:>10} {:>10} {:>10} {:>12}",
        "phase", "layer", "total s", "weights s", "compute s", "all-reduce s"
    )?;
    for t in engine.timings() {
        writeln!(
            Out,
            "{:<10} {:>5} {:>10.3} {:>10.3} {:>10.3} {:>12.4}",
            t.phase.to_string(),
            t.layer,
            t.seconds,
            t.weight_seconds,
            t.seconds - t.weight_seconds,
            t.collective_seconds
        )?;
    }
    let (pf, pf_compute) = mean_per_layer(engine.timings(), |p| *p == Phase::Prefill);
    let (dc, dc_compute) = mean_per_layer(engine.timings(), |p| matches!(p, Phase::Decode(_)));
    writeln!(
        Out,
        "mean per layer: prefill {:.2} ms ({:.2} ms compute), decode {:.2} ms ({:.2} ms compute)",
        pf * 1e3,
        pf_compute * 1e3,
        dc * 1e3,
        dc_compute * 1e3
    )?;
    writeln!(
        Out,
        "whole run {total:.3}s (embedding, final norm and lm_head included)"
    )?;
    if args.op_times {
        let mut timer = super::bench_ops::OpTimer::new(&backend);
        let mut engine = Engine::new(
            &model,
            &backend,
            EngineOptions {
                layers: layers.clone(),
                tp: args.tp,
                ..EngineOptions::new(&model, paths)
            },
        )?;
        timer.restart()?;
        generate::run(&mut engine, &schedule, &mut timer)?;
        super::bench_ops::print(&timer, layers.len(), args.decode)?;
    }
    if args.check {
        for dtype in [
            crate::engine::StorageDtype::F32,
            crate::engine::StorageDtype::Bf16,
        ] {
            let flags = crate::debug::Flags {
                mla_disable: args.mla_disable,
                dtype,
                ..Default::default()
            };
            bench_check(&model, &layers, &schedule, flags, &CpuBackend)?;
        }
    }
    if let Some(rss) = peak_rss_bytes() {
        writeln!(
            Out,
            "peak resident memory {:.2} GiB",
            rss as f64 / (1u64 << 30) as f64
        )?;
    }
    Ok(())
}

/// Mean seconds per layer over the timings of the phases `want` picks: (in all, computing,
/// that is without fetching weights).
pub fn mean_per_layer(timings: &[LayerTiming], want: fn(&Phase) -> bool) -> (f64, f64) {
    let v: Vec<_> = timings.iter().filter(|t| want(&t.phase)).collect();
    let n = v.len().max(1) as f64;
    (
        v.iter().map(|t| t.seconds).sum::<f64>() / n,
        v.iter().map(|t| t.seconds - t.weight_seconds).sum::<f64>() / n,
    )
}

/// Mean seconds per layer the host spent before waiting for the device, over the timings of
/// the phases `want` picks.
pub fn mean_host(timings: &[LayerTiming], want: fn(&Phase) -> bool) -> f64 {
    let v: Vec<_> = timings.iter().filter(|t| want(&t.phase)).collect();
    v.iter().map(|t| t.host_seconds).sum::<f64>() / v.len().max(1) as f64
}

/// Mean seconds per layer spent in the all-reduces, over the timings of the phases `want` picks.
pub fn mean_collective(timings: &[LayerTiming], want: fn(&Phase) -> bool) -> f64 {
    let v: Vec<_> = timings.iter().filter(|t| want(&t.phase)).collect();
    v.iter().map(|t| t.collective_seconds).sum::<f64>() / v.len().max(1) as f64
}

/// Times a plain run and `check` on the same schedule with `flags` on `backend`, the weights
/// already fetched: the cost of the detectors, the comparison runs and the re-runs that force
/// selection flips.
pub fn bench_check(
    model: &crate::model::Model,
    layers: &std::ops::Range<usize>,
    schedule: &Schedule,
    flags: crate::debug::Flags,
    backend: &dyn crate::backend::Backend,
) -> Result<()> {
    use crate::debug::detect::{check, CheckOptions};
    use crate::debug::runner::Job;
    let start = std::time::Instant::now();
    let options = flags.engine_options(layers.clone(), false)?;
    let mut engine = Engine::new(model, backend, options)?;
    generate::run(&mut engine, schedule, &mut NullObserver)?;
    let plain = start.elapsed().as_secs_f64();
    let plain_ops = engine.counts().executed;
    let job = Job {
        model,
        backend,
        schedule,
        layers,
        poison: true,
    };
    let start = std::time::Instant::now();
    let report = check(
        &job,
        flags,
        &CheckOptions {
            tolerance: None,
            reference: None,
        },
    )?;
    let checked = start.elapsed().as_secs_f64();
    let flips = report
        .selection_notes
        .iter()
        .filter(|n| n.kind == "selection-flip")
        .count();
    writeln!(
        Out,
        "check ({} {}): {checked:.3}s against a plain run's {plain:.3}s ({:.2}×): {} ops computed against {plain_ops}; {flips} selection flips forced in {} re-runs; {} findings",
        backend.name(),
        flags.dtype,
        checked / plain,
        report.ops_executed,
        report.reruns,
        report.findings.len()
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every flag the CUDA bench alone reads (but --quick, which --attach-ingest takes) is one
    /// that the attach benches refuse, so a new GPU-bench flag cannot slip past them unread.
    #[test]
    fn the_attach_benches_refuse_every_cuda_only_flag() {
        for flag in CUDA_ONLY.into_iter().filter(|&f| f != "--quick") {
            let id = flag.trim_start_matches("--").replace('-', "_");
            assert!(UNREAD_BY_ATTACH.contains(&id.as_str()), "{flag}");
        }
    }
}
