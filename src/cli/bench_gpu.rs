//! `mladb bench --device cuda`: the device's own ceilings (copy bandwidth, cuBLAS bf16 GEMM
//! rate), then the tensor-core MLA kernels at GLM-5 dimensions (64 heads, latent 512 + 64) in
//! GB/s and TFLOP/s against those ceilings, each shape checked against the f64 reference, then
//! whole decoder layers through the engine with and without trace statistics.
//!
//! Inputs are random (never zeros), outputs poisoned before the run; every time is the median
//! of event-timed samples after a warm-up; the decode caches rotate among copies, so that no
//! call reads what an earlier one left in L2 (see [`super::bench_timing`]).

use super::bench::BenchArgs;
use super::bench_timing::{call_times, median, random, rotating_copies, time, CallTimes};
use super::Out;
use crate::backend::cuda::device::{DevBuf, Elem, Gpu};
use crate::backend::cuda::fast::{self, DecodeShape, DecodeWork, LATENT, PAGE, ROPE};
use crate::backend::cuda::CudaBackend;
use crate::engine::generate::{self, Schedule};
use crate::engine::trace::StatsObserver;
use crate::engine::{Engine, EngineOptions, MlaPaths, NullObserver, Phase, StorageDtype};
use crate::error::{Error, Result};
use crate::ops::{DecodeVariant, PrefillVariant};

const GLM5_HEADS: usize = 64;
pub struct Ceilings {
    pub copy_gbs: f64,
    pub gemm_tflops: f64,
}

/// Device-to-device copy of 2 GiB (bytes read + written), and an 8192³ bf16 GEMM.
fn ceilings(gpu: &Gpu) -> Result<Ceilings> {
    let len = 1usize << 30; // bf16 elements: 2 GiB
    let src = random(gpu, len, Elem::Bf16, 1, 1.0)?;
    let dst = gpu.alloc(len, Elem::Bf16)?;
    let ms = median(gpu.time_ms(3, 20, 1, || gpu.copy(&src, 0, &dst, 0, len))?);
    let copy_gbs = 2.0 * (len * 2) as f64 / (ms * 1e-3) / 1e9;
    drop((src, dst));
    let n = 8192;
    let a = random(gpu, n * n, Elem::Bf16, 2, 1.0)?;
    let b = random(gpu, n * n, Elem::Bf16, 3, 1.0)?;
    let c = gpu.alloc(n * n, Elem::Bf16)?;
    let ms = median(gpu.time_ms(3, 20, 1, || gpu.gemm_xwt(&a, &b, &c, n, n, n))?);
    let gemm_tflops = 2.0 * (n * n * n) as f64 / (ms * 1e-3) / 1e12;
    Ok(Ceilings {
        copy_gbs,
        gemm_tflops,
    })
}

/// One decode shape's figures.
struct DecodeTimes {
    /// Milliseconds per call.
    times: CallTimes,
    /// GB/s of the stream figure.
    gbs: f64,
    /// The worst relative error of the sampled heads against the f64 reference.
    err: f64,
    splits: usize,
}

/// One decode shape, timed and checked.
fn decode_shape(
    gpu: &Gpu,
    (batch, context, heads): (usize, usize, usize),
    variant: Option<&str>,
    splits: Option<usize>,
    seed: u64,
) -> Result<DecodeTimes> {
    let width = LATENT + ROPE;
    let pages_per_seq = context.div_ceil(PAGE);
    let pages = batch * pages_per_seq;
    let cache_bytes = pages * PAGE * width * 2;
    let copies = rotating_copies(cache_bytes);
    let caches: Vec<DevBuf> = (0..copies)
        .map(|i| {
            random(
                gpu,
                pages * PAGE * width,
                Elem::Bf16,
                seed + 10 + i as u64,
                1.0,
            )
        })
        .collect::<Result<_>>()?;
    let q = random(gpu, batch * heads * width, Elem::Bf16, seed, 1.0)?;
    // A shuffled block table, as a paged allocator hands pages out after churn.
    let mut order: Vec<i32> = (0..pages as i32).collect();
    let mut x = seed | 1;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let table = gpu.upload_i32(&order)?;
    let lens = gpu.upload_i32(&vec![context as i32; batch])?;
    let out = gpu.alloc(batch * heads * LATENT, Elem::Bf16)?;
    let lse = gpu.alloc(batch * heads, Elem::F32)?;
    gpu.fill(&out, true)?;
    let shape = DecodeShape {
        batch,
        heads,
        max_pages: pages_per_seq,
        max_len: context,
    };
    let work = match splits {
        Some(splits) => DecodeWork::with_variant(gpu, shape, splits, variant)?,
        None => DecodeWork::for_variant(gpu, shape, variant)?,
    };
    let scale = 1.0 / (192.0f32 + 64.0).sqrt();
    let mut turn = 0;
    let times = call_times(gpu, 15, || {
        turn = (turn + 1) % copies;
        fast::mla_decode(
            gpu,
            shape,
            &q,
            &caches[turn],
            &table,
            &lens,
            scale,
            &out,
            &lse,
            &work,
        )
        .map(|_| ())
    })?;
    // Check sequences 0 and the last, heads 0 and 63, against the f64 reference (last run's cache).
    fast::mla_decode(
        gpu, shape, &q, &caches[0], &table, &lens, scale, &out, &lse, &work,
    )?;
    let mut worst: f64 = 0.0;
    for b in [0, batch - 1] {
        let mut rows = Vec::with_capacity(context * width);
        for p in 0..pages_per_seq {
            let page = order[b * pages_per_seq + p] as usize;
            let take = (context - p * PAGE).min(PAGE);
            rows.extend(gpu.download_range(&caches[0], page * PAGE * width, take * width)?);
        }
        for h in [0, heads - 1] {
            let qv = gpu.download_range(&q, (b * heads + h) * width, width)?;
            let got = gpu.download_range(&out, (b * heads + h) * LATENT, LATENT)?;
            let want = fast::reference_attention(
                &qv,
                rows.chunks(width).map(|r| (r, &r[..LATENT])),
                scale as f64,
            );
            worst = worst.max(fast::relative_error(&got, &want));
        }
    }
    let bytes = (batch * context * width * 2 + batch * heads * (width + LATENT) * 2) as f64;
    Ok(DecodeTimes {
        gbs: bytes / (times.stream * 1e-3) / 1e9,
        times,
        err: worst,
        splits: work.splits,
    })
}

/// One causal prefill shape at GLM-5's head dims (256/256): (ms, TFLOP/s, worst error).
fn prefill_shape(gpu: &Gpu, n: usize, variant: Option<&str>, seed: u64) -> Result<(f64, f64, f64)> {
    let heads = GLM5_HEADS;
    let (dqk, dv) = (256, 256);
    let q = random(gpu, n * heads * dqk, Elem::Bf16, seed, 1.0)?;
    let k = random(gpu, n * heads * dqk, Elem::Bf16, seed + 1, 1.0)?;
    let v = random(gpu, n * heads * dv, Elem::Bf16, seed + 2, 1.0)?;
    let out = gpu.alloc(n * heads * dv, Elem::Bf16)?;
    gpu.fill(&out, true)?;
    let scale = 1.0 / (dqk as f32).sqrt();
    let ms = time(gpu, 10, || {
        let dims = (dqk, dv);
        fast::flash_prefill_variant(gpu, variant, n, heads, dims, &q, &k, &v, scale, &out, None)
            .map(|_| ())
    })?;
    let flops = 2.0 * heads as f64 * (dqk + dv) as f64 * (n as f64 * (n as f64 + 1.0) / 2.0);
    let mut worst: f64 = 0.0;
    for (row, h) in [(0, 0), (n / 2, 17), (n - 1, heads - 1)] {
        let qv = gpu.download_range(&q, (row * heads + h) * dqk, dqk)?;
        let mut keys = Vec::with_capacity((row + 1) * dqk);
        let mut vals = Vec::with_capacity((row + 1) * dv);
        for j in 0..=row {
            keys.extend(gpu.download_range(&k, (j * heads + h) * dqk, dqk)?);
            vals.extend(gpu.download_range(&v, (j * heads + h) * dv, dv)?);
        }
        let got = gpu.download_range(&out, (row * heads + h) * dv, dv)?;
        let want =
            fast::reference_attention(&qv, keys.chunks(dqk).zip(vals.chunks(dv)), scale as f64);
        worst = worst.max(fast::relative_error(&got, &want));
    }
    Ok((ms, flops / (ms * 1e-3) / 1e12, worst))
}

/// The decode grid's head counts: --decode-heads, or GLM-5's 64.
fn decode_heads(args: &BenchArgs) -> Result<Vec<usize>> {
    let Some(text) = &args.decode_heads else {
        return Ok(vec![GLM5_HEADS]);
    };
    text.split(',')
        .map(|h| match parse_count(h, "--decode-heads")? {
            h if h <= 128 => Ok(h),
            h => Err(Error::invalid(format!(
                "--decode-heads: {h} heads (1 to 128)"
            ))),
        })
        .collect()
}

fn parse_count(text: &str, what: &str) -> Result<usize> {
    match text.trim().parse::<usize>() {
        Ok(v) if (1..=1 << 20).contains(&v) => Ok(v),
        _ => Err(Error::invalid(format!(
            "{what}: '{text}' is not a count from 1 to 1048576"
        ))),
    }
}

/// The decode grid: --decode-shapes, or batch 1/16/64/128 × context 1k..32k (--quick: fewer).
fn decode_shapes(args: &BenchArgs) -> Result<Vec<(usize, usize)>> {
    if let Some(list) = &args.decode_shapes {
        return list
            .split(',')
            .map(|pair| match pair.split_once(':') {
                Some((b, c)) => Ok((
                    parse_count(b, "--decode-shapes")?,
                    parse_count(c, "--decode-shapes")?,
                )),
                None => Err(Error::invalid(format!(
                    "--decode-shapes: '{pair}' is not BATCH:CONTEXT"
                ))),
            })
            .collect();
    }
    let batches: &[usize] = if args.quick {
        &[1, 64]
    } else {
        &[1, 16, 64, 128]
    };
    let contexts: &[usize] = if args.quick {
        &[1024, 8192]
    } else {
        &[1024, 2048, 4096, 8192, 16384, 32768]
    };
    Ok(batches
        .iter()
        .flat_map(|&b| contexts.iter().map(move |&c| (b, c)))
        .collect())
}

/// The prefill lengths: --prefill-lengths, or 1k..8k (--quick: 1k and 4k).
fn prefill_lengths(args: &BenchArgs) -> Result<Vec<usize>> {
    match &args.prefill_lengths {
        Some(list) => list
            .split(',')
            .map(|n| parse_count(n, "--prefill-lengths"))
            .collect(),
        None => Ok(if args.quick {
            vec![1024, 4096]
        } else {
            vec![1024, 2048, 4096, 8192]
        }),
    }
}

/// Bytes of bf16 weights one decode step of layer `l` reads: everything of the layer but the
/// routed experts, plus `routed` of them.
fn decode_weight_bytes(model: &crate::model::Model, l: usize, routed: usize) -> usize {
    let catalog = crate::model::catalog::Catalog::new(&model.layout);
    let prefix = format!("{}.", crate::model::catalog::layer_prefix(l));
    let experts = format!("{prefix}mlp.experts.");
    let mut total = 0;
    let mut expert0 = 0;
    for (name, spec) in catalog.iter().filter(|(n, _)| n.starts_with(&prefix)) {
        let bytes = spec.shape.iter().product::<usize>() * 2;
        if let Some(rest) = name.strip_prefix(&experts) {
            if rest.starts_with("0.") {
                expert0 += bytes;
            }
        } else {
            total += bytes;
        }
    }
    total + routed * expert0
}

pub fn bench_gpu(args: &BenchArgs) -> Result<()> {
    let backend = CudaBackend::new(StorageDtype::Bf16)?;
    let gpu = backend.gpu();
    writeln!(
        Out,
        "mladb bench on {} (sm_{}, {} multiprocessors, {} KB shared memory per block), {}",
        gpu.name,
        gpu.arch,
        gpu.multiprocessors(),
        gpu.max_shared_per_block() / 1024,
        chrono_free_date()
    )?;
    for why in &gpu.unavailable {
        writeln!(Out, "note: not built, the portable kernels stand in: {why}")?;
    }
    let c = ceilings(gpu)?;
    writeln!(Out, "ceilings: device-to-device copy {:.0} GB/s (read + write), cuBLAS bf16 GEMM 8192³ {:.0} TFLOP/s", c.copy_gbs, c.gemm_tflops)?;

    if !args.no_kernels {
        let decode_variant = args
            .decode_variant
            .as_deref()
            .map(|v| v.parse::<DecodeVariant>().map(DecodeVariant::kernel))
            .transpose()?;
        let prefill_variant = args
            .prefill_variant
            .as_deref()
            .map(|v| v.parse::<PrefillVariant>().map(PrefillVariant::tag))
            .transpose()?;
        let forced_splits = args.decode_splits.map(usize::from);
        writeln!(
        Out,
            "\nMLA decode (absorbed, paged latent cache 512+64, bf16), one query token per sequence, kernel {}; \
             time: calls back to back on the stream; graph: the same calls replayed from a CUDA graph; \
             host: the host's time to issue a call (near the stream's time, the stream's figure is the launches'), \
             launch and maps: the driver's kernel launches and tensor-map encodes in it",
            fast::decode_kernel(gpu, decode_variant)?
        )?;
        writeln!(
            Out,
            "{:>6} {:>6} {:>8} {:>10} {:>9} {:>8} {:>9} {:>8} {:>7} {:>5} {:>7} {:>10}",
            "heads",
            "batch",
            "context",
            "time us",
            "GB/s",
            "of copy",
            "graph us",
            "host us",
            "launch",
            "maps",
            "splits",
            "rel err"
        )?;
        let mut no_graph = None;
        for heads in decode_heads(args)? {
            for (b, ctx) in decode_shapes(args)? {
                let seed = (b * 100_000 + ctx + heads) as u64;
                let t = decode_shape(gpu, (b, ctx, heads), decode_variant, forced_splits, seed)?;
                let err = t.err;
                let graph = match &t.times.graph {
                    Ok(ms) => format!("{:.1}", ms * 1e3),
                    Err(why) => {
                        no_graph.get_or_insert(why.clone());
                        "-".into()
                    }
                };
                writeln!(
                    Out,
                    "{heads:>6} {b:>6} {ctx:>8} {:>10.1} {:>9.0} {:>7.0}% {graph:>9} {:>8.1} {:>7.1} {:>5.1} {:>7} {err:>10.1e}",
                    t.times.stream * 1e3,
                    t.gbs,
                    100.0 * t.gbs / c.copy_gbs,
                    t.times.host * 1e3,
                    t.times.host_launch * 1e3,
                    t.times.host_maps * 1e3,
                    t.splits
                )?;
                if err.is_nan() || err >= 1e-2 {
                    return Err(Error::invalid(format!("MLA decode at batch {b}, context {ctx} disagrees with the reference (relative error {err:.2e})")));
                }
            }
        }
        if let Some(why) = no_graph {
            writeln!(Out, "note: no graph replay ('-'): {why}")?;
        }
        writeln!(
            Out,
            "\nMLA prefill (causal flash attention, 64 heads, head dims 256/256, bf16)"
        )?;
        writeln!(
            Out,
            "{:>8} {:>10} {:>9} {:>8} {:>10}",
            "tokens", "time ms", "TFLOP/s", "of GEMM", "rel err"
        )?;
        for n in prefill_lengths(args)? {
            let (ms, tflops, err) = prefill_shape(gpu, n, prefill_variant, n as u64)?;
            writeln!(
                Out,
                "{n:>8} {ms:>10.3} {tflops:>9.0} {:>7.0}% {err:>10.1e}",
                100.0 * tflops / c.gemm_tflops
            )?;
            if err.is_nan() || err >= 1e-2 {
                return Err(Error::invalid(format!("MLA prefill at {n} tokens disagrees with the reference (relative error {err:.2e})")));
            }
        }
    }

    if !args.no_kernels {
        // A forced variant with a sparse twin (`--decode-variant ks3`) runs the bf16 sparse rows too.
        let forced_sparse = args
            .decode_variant
            .as_deref()
            .map(|v| v.parse::<DecodeVariant>().map(DecodeVariant::kernel))
            .transpose()?
            .and_then(fast::sparse_twin);
        super::bench_sparse::sparse_decode(gpu, c.copy_gbs, args.quick, forced_sparse)?;
        super::bench_fp8::fp8_decode(gpu)?;
        super::bench_traced::traced_decode(&backend, args.quick)?;
    }
    if args.no_layers {
        return Ok(());
    }
    // Whole decoder layers through the engine (every op's output also copied back to the host,
    // as the debugger needs), with weights already resident: a warm-up run fetches them.
    let model = args.model.load()?;
    let layers = super::args::parse_layers(&args.layers, model.layout.num_layers)?;
    let paths = if args.mla_disable {
        MlaPaths::disabled()
    } else {
        MlaPaths::production()
    };
    let schedule = Schedule {
        prompt: super::args::default_prompt(model.layout.vocab_size, args.prompt.max(1)),
        prefill_len: args.prompt.max(1),
        decode_steps: args.decode,
    };
    let options = |tp: usize| EngineOptions {
        layers: layers.clone(),
        tp,
        ..EngineOptions::new(&model, paths)
    };
    writeln!(
        Out,
        "\nwhole layers: {} layers {}..{}, prompt {} tokens, {} decode steps, bf16 on the device",
        model.layout.name, layers.start, layers.end, schedule.prefill_len, args.decode
    )?;
    let tps: Vec<usize> = match args.tp {
        1 => vec![1],
        tp => vec![1, tp],
    };
    // Whether the ranks' all-reduce is one collective whose time is counted (the last warm-up's).
    let mut across = false;
    for &tp in &tps {
        let warm = std::time::Instant::now();
        let mut engine = Engine::new(&model, &backend, options(tp))?;
        generate::run(&mut engine, &schedule, &mut NullObserver)?;
        across = engine.sums_across_devices();
        writeln!(
            Out,
            "tp {tp}: warm-up run (fetches and uploads the weights) {:.1} s{}",
            warm.elapsed().as_secs_f64(),
            engine
                .ranks_note()
                .map(|n| format!("; {n}"))
                .unwrap_or_default()
        )?;
    }
    // Per layer and phase: (seconds, seconds in the all-reduces, the host's seconds).
    let per_phase = |stats: bool, tp: usize| -> Result<[(f64, f64, f64); 2]> {
        let mut engine = Engine::new(&model, &backend, options(tp))?;
        if stats {
            generate::run(&mut engine, &schedule, &mut StatsObserver { events: 0 })?;
        } else {
            generate::run(&mut engine, &schedule, &mut NullObserver)?;
        }
        let t = engine.timings();
        let of = |want: fn(&Phase) -> bool| {
            (
                super::bench::mean_per_layer(t, want).0,
                super::bench::mean_collective(t, want),
                super::bench::mean_host(t, want),
            )
        };
        Ok([
            of(|p| *p == Phase::Prefill),
            of(|p| matches!(p, Phase::Decode(_))),
        ])
    };
    writeln!(
        Out,
        "{:<28} {:>4} {:>12} {:>12} {:>9} {:>16} {:>15}",
        "per layer (median of 3 runs)",
        "tp",
        "no stats ms",
        "stats ms",
        "overhead",
        "all-reduce share",
        "host ms (stats)"
    )?;
    let phases: &[&str] = match args.decode {
        0 => &["prefill"],
        _ => &["prefill", "decode step"],
    };
    for (i, phase) in phases.iter().enumerate() {
        for &tp in &tps {
            let (mut plain, mut with_stats, mut share) = (Vec::new(), Vec::new(), Vec::new());
            let (mut host, mut host_stats) = (Vec::new(), Vec::new());
            for _ in 0..3 {
                let p = per_phase(false, tp)?[i];
                plain.push(p.0);
                host.push(p.2);
                share.push(p.1 / p.0.max(f64::MIN_POSITIVE));
                let s = per_phase(true, tp)?[i];
                with_stats.push(s.0);
                host_stats.push(s.2);
            }
            let (t, ts) = (median(plain), median(with_stats));
            let host = format!(
                "{:.2} ({:.2})",
                median(host) * 1e3,
                median(host_stats) * 1e3
            );
            let share = match tp {
                1 => "-".to_string(),
                _ if !across => "one device".to_string(),
                _ => format!("{:.1}%", 100.0 * median(share)),
            };
            writeln!(
                Out,
                "{phase:<28} {tp:>4} {:>12.2} {:>12.2} {:>8.1}% {share:>16} {host:>15}",
                t * 1e3,
                ts * 1e3,
                100.0 * (ts / t - 1.0)
            )?;
        }
    }
    if args.op_times {
        let mut timer = super::bench_ops::OpTimer::new(&backend);
        let mut engine = Engine::new(&model, &backend, options(1))?;
        timer.restart()?;
        generate::run(&mut engine, &schedule, &mut timer)?;
        super::bench_ops::print(&timer, layers.len(), args.decode)?;
    }
    if args.decode > 0 {
        if let Some(moe) = &model.layout.moe {
            let bytes = decode_weight_bytes(&model, layers.start, moe.num_experts_per_tok);
            let floor_ms = bytes as f64 / (c.copy_gbs * 1e9 / 2.0) * 1e3;
            writeln!(
        Out,
                "decode weight-read floor of layer {}: {:.2} GB of bf16 weights ({} routed experts) / {:.0} GB/s read = {:.3} ms",
                layers.start,
                bytes as f64 / 1e9,
                moe.num_experts_per_tok,
                c.copy_gbs / 2.0,
                floor_ms
            )?;
        }
    }
    if args.check {
        let flags = crate::debug::Flags {
            mla_disable: args.mla_disable,
            device: crate::debug::flags::DeviceFlag::Cuda,
            dtype: StorageDtype::Bf16,
            ..Default::default()
        };
        super::bench::bench_check(&model, &layers, &schedule, flags, &backend)?;
    }
    Ok(())
}

/// Today's date (UTC) from the system clock, as YYYY-MM-DD.
fn chrono_free_date() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = (secs / 86_400) as i64;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}
