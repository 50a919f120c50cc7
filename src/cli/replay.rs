//! `mladb replay FILE`: a recorded session in the debugger without recomputation; `--verify`
//! recomputes every recorded op and compares; `--json` and `--dump` export what was recorded;
//! `--bench` measures the file's size and load time.

use super::args::DeviceArg;
use super::Out;
use crate::backend::Backend;
use crate::debug::detect::default_tolerance;
use crate::debug::flags::DeviceFlag;
use crate::debug::runner::Job;
use crate::engine::trace::OpEvent;
use crate::error::{Error, Result};
use crate::fsutil::write_atomic;
use crate::session::recorded::{sample_indices, sample_of, RecordedOp, RecordedRun, RunRole};
use crate::session::Session;
use crate::stats::TensorStats;
use crate::tensor_file::F32Tensor;
use clap::Args;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args, Debug, Clone)]
pub struct ReplayArgs {
    /// The session file (RON, version 2 with recorded results; `mladb run --record`, `mladb
    /// check --record` or the debugger's `:save` write one).
    pub file: PathBuf,
    /// Recompute every recorded op on this machine and compare: bit-exact on the CPU when the
    /// session was recorded on the CPU, within the dtype's tolerance otherwise. Exit 0 when
    /// everything matches, 1 at the first mismatch (named), 2 when the file cannot be read.
    #[arg(long)]
    pub verify: bool,
    /// Where --verify recomputes: cpu (default), cuda or auto.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Print the recorded events as JSON lines (one `"type":"op"` object per op, with its run and
    /// sample, one `"type":"run"` per run), then a summary.
    #[arg(long)]
    pub json: bool,
    /// Write the recorded values to a safetensors file: `runN/PHASE/OP` is the full output when
    /// tensors were recorded, else the sample (1-D), with its element indices as
    /// `runN/PHASE/OP.index` (I64).
    #[arg(long)]
    pub dump: Option<PathBuf>,
    /// Report the file's size and how long it takes to load (parse, and build the replay).
    #[arg(long)]
    pub bench: bool,
    /// Key bindings to override (as `mladb tui --keys`).
    #[arg(long)]
    pub keys: Option<PathBuf>,
    /// Open as a tour: at the first note, the notes pane open (`}` / `{` go from note to note,
    /// each moving the selection to the note's op and switching to its pane). A session with no
    /// notes placed in its timeline is refused. (Any replay of a session with notes opens at the
    /// first; this says that one is wanted.)
    #[arg(long, conflicts_with_all = ["verify", "json", "dump", "bench"])]
    pub tour: bool,
    /// With --verify: refuse a recomputation whose largest buffers would need more than this
    /// many GB (default: the memory the machine has available), as `mladb run` does.
    #[arg(long)]
    pub max_memory_gb: Option<f64>,
}

/// Runs `mladb replay`; returns whether `--verify` found a mismatch.
pub fn run(args: &ReplayArgs) -> Result<bool> {
    if !(args.verify || args.json || args.dump.is_some() || args.bench) {
        crate::tui::run_replay(&args.file, args.keys.clone(), args.tour)?;
        return Ok(false);
    }
    if let Some(out) = &args.dump {
        crate::fsutil::check_output(out)?;
    }
    let session = Session::load(&args.file)?;
    if session.runs.is_empty() {
        return Err(Error::parse(
            &args.file,
            "nothing recorded (a version 1 session): `mladb tui` then `:load FILE` recomputes it",
        ));
    }
    if args.verify {
        // A companion from another save is refused here too, not only where it is read.
        session.verify_companion(&args.file)?;
    }
    if args.bench {
        bench(&args.file)?;
    }
    if args.json {
        print_json(&session, &mut std::io::stdout().lock()).map_err(Error::stdout)?;
    }
    if let Some(out) = &args.dump {
        dump(&session, &args.file, out)?;
    }
    if args.verify {
        let mut stdout = std::io::stdout();
        return Ok(
            verify_within(&session, args.device, args.max_memory_gb, &mut stdout)?.is_some(),
        );
    }
    Ok(false)
}

fn print_json(session: &Session, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    for (n, run) in session.runs.iter().enumerate() {
        writeln!(
            out,
            "{}",
            json!({
                "type": "run",
                "run": n,
                "role": run.role,
                "flags": run.flags,
                "first_affected": run.first_affected,
                "started_at": run.started_at,
                "compared_with": run.compared_with,
                "outcome": run.outcome,
                "error": run.error,
                "ops": run.ops.len(),
            })
        )?;
        for op in &run.ops {
            let mut v = serde_json::to_value(&op.event).unwrap_or_default();
            v["type"] = json!("op");
            v["run"] = json!(n);
            v["sample"] = json!(op.sample);
            v["sample_index"] = json!(sample_indices(op.event.shape.iter().product()));
            writeln!(out, "{v}")?;
        }
    }
    writeln!(
        out,
        "{}",
        json!({
            "type": "summary",
            "version": session.version,
            // In words, as the dump's metadata has it (`layout glm5-tiny, seed 0`).
            "model": super::dump::model_text(&session.model),
            "runs": session.runs.len(),
            "ops": session.runs.iter().map(|r| r.ops.len()).sum::<usize>(),
            "findings": session.check.as_ref().map(|c| &c.findings),
            "notes": session.notes,
            "annotations": session.annotations,
        })
    )
}

fn dump(session: &Session, file: &Path, out: &Path) -> Result<()> {
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    // The session's schedule and flags (later runs may have changed flags: see the session).
    let generated = session
        .runs
        .first()
        .and_then(|r| r.outcome.as_ref())
        .map(|o| o.generated.clone())
        .unwrap_or_default();
    let meta = crate::debug::external::DumpMeta::of_mladb(
        &session.schedule(),
        &generated,
        super::dump::model_text(&session.model),
        &session.flags,
    );
    let name = |n: usize, op: &RecordedOp| format!("run{n}/{}", op.event.dump_name());
    // Full outputs from the companion: written a tensor at a time, as `run --dump` writes.
    if let Some(tensors) = session.load_tensors(file)? {
        let mut count = 0;
        let entries = session.runs.iter().enumerate().flat_map(|(n, run)| {
            run.ops
                .iter()
                .zip(&tensors[n])
                .map(move |(op, t)| F32Tensor {
                    name: name(n, op),
                    shape: t.shape(),
                    data: t.data(),
                })
        });
        super::dump::write_dump(out, &meta, entries.inspect(|_| count += 1))?;
        eprintln!("dumped {count} tensors to {}", out.display());
        return Ok(());
    }
    // Samples only: each op's sampled values and their flat indices (small, written whole).
    let mut entries: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (n, run) in session.runs.iter().enumerate() {
        for op in &run.ops {
            let name = name(n, op);
            let idx = sample_indices(op.event.shape.iter().product());
            let bytes = idx.iter().flat_map(|&i| (i as i64).to_le_bytes()).collect();
            entries.push((format!("{name}.index"), Dtype::I64, vec![idx.len()], bytes));
            let values = op.sample.iter().flat_map(|x| x.to_le_bytes()).collect();
            entries.push((name, Dtype::F32, vec![op.sample.len()], values));
        }
    }
    let views: Vec<(String, TensorView<'_>)> = entries
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| Error::invalid(format!("dump of {name}: {e}")))
        })
        .collect::<Result<_>>()?;
    let bytes = safetensors::serialize(views, Some(meta.to_map()))
        .map_err(|e| Error::invalid(format!("writing {}: {e}", out.display())))?;
    write_atomic(out, &bytes)?;
    eprintln!("dumped {} tensors to {}", entries.len(), out.display());
    Ok(())
}

/// How recorded and recomputed values must agree.
#[derive(Debug, Clone, Copy)]
pub enum Agreement {
    /// Bit for bit (NaN payloads aside: RON keeps NaN, not its bits).
    Exact,
    /// Within a relative tolerance (against the op's abs-max for values).
    Within(f64),
}

fn same_f64(a: f64, b: f64, scale: f64, how: Agreement) -> bool {
    if a.is_nan() || b.is_nan() {
        return a.is_nan() && b.is_nan();
    }
    match how {
        Agreement::Exact => a.to_bits() == b.to_bits() || (a == 0.0 && b == 0.0 && a == b),
        Agreement::Within(tol) => {
            a == b || (a - b).abs() <= tol * scale.abs().max(a.abs()).max(1e-30)
        }
    }
}

/// The first statistic that differs, as `stats.NAME recorded X, recomputed Y`.
fn stats_differ(a: &TensorStats, b: &TensorStats, how: Agreement) -> Option<String> {
    let counts = [
        ("count", a.count, b.count),
        ("nan", a.nan, b.nan),
        ("pos_inf", a.pos_inf, b.pos_inf),
        ("neg_inf", a.neg_inf, b.neg_inf),
        ("unwritten", a.unwritten, b.unwritten),
    ];
    for (name, x, y) in counts {
        if x != y {
            return Some(format!("stats.{name} recorded {x}, recomputed {y}"));
        }
    }
    if matches!(how, Agreement::Exact) && a.zeros != b.zeros {
        return Some(format!(
            "stats.zeros recorded {}, recomputed {}",
            a.zeros, b.zeros
        ));
    }
    let scale = a.abs_max.max(b.abs_max);
    let l2_scale = a.l2.max(b.l2);
    let values = [
        ("min", a.min, b.min, scale),
        ("max", a.max, b.max, scale),
        ("mean", a.mean, b.mean, scale),
        ("std", a.std, b.std, scale),
        ("abs_max", a.abs_max, b.abs_max, scale),
        ("l2", a.l2, b.l2, l2_scale),
    ];
    for (name, x, y, s) in values {
        if !same_f64(x, y, s, how) {
            return Some(format!("stats.{name} recorded {x:e}, recomputed {y:e}"));
        }
    }
    None
}

/// How a recorded op differs from the recomputed one, if it does.
pub fn op_differs(
    recorded: &OpEvent,
    sample: &[f32],
    event: &OpEvent,
    values: &[f32],
    how: Agreement,
) -> Option<String> {
    if (recorded.phase, &recorded.name) != (event.phase, &event.name) {
        return Some(format!(
            "recomputed op is {} {} instead",
            event.phase, event.name
        ));
    }
    // Where the op stands: its index, layer and token positions are the same on every device.
    if (recorded.index, recorded.layer, recorded.positions)
        != (event.index, event.layer, event.positions)
    {
        return Some(format!(
            "index/layer/positions recorded {} {:?} {:?}, recomputed {} {:?} {:?}",
            recorded.index,
            recorded.layer,
            recorded.positions,
            event.index,
            event.layer,
            event.positions
        ));
    }
    if recorded.kind != event.kind {
        return Some(format!(
            "kind recorded {}, recomputed {}",
            recorded.kind.name(),
            event.kind.name()
        ));
    }
    if recorded.shape != event.shape || recorded.dtype != event.dtype {
        return Some(format!(
            "shape/dtype recorded {:?} {}, recomputed {:?} {}",
            recorded.shape,
            recorded.dtype.name(),
            event.shape,
            event.dtype.name()
        ));
    }
    let disconnected = |e: &OpEvent| e.kernel_wrote.is_some_and(|k| k.id != e.output.id);
    if disconnected(recorded) != disconnected(event) {
        return Some(format!(
            "buffers: recorded {}, recomputed {}",
            if disconnected(recorded) {
                "disconnected"
            } else {
                "connected"
            },
            if disconnected(event) {
                "disconnected"
            } else {
                "connected"
            }
        ));
    }
    if recorded.inputs.len() != event.inputs.len() {
        return Some(format!(
            "inputs: recorded {}, recomputed {}",
            recorded.inputs.len(),
            event.inputs.len()
        ));
    }
    // Buffer sizes and roles (addresses differ between processes); bit for bit on one device.
    if matches!(how, Agreement::Exact) {
        let sizes = |e: &OpEvent| {
            let mut v = vec![(e.output.bytes, e.output.role)];
            v.extend(e.kernel_wrote.iter().map(|b| (b.bytes, b.role)));
            v.extend(e.inputs.iter().map(|b| (b.bytes, b.role)));
            v
        };
        let (a, b) = (sizes(recorded), sizes(event));
        if a != b {
            return Some(format!(
                "buffer bytes/roles recorded {a:?}, recomputed {b:?}"
            ));
        }
    }
    if let Some(d) = stats_differ(&recorded.stats, &event.stats, how) {
        return Some(d);
    }
    let now = sample_of(values);
    let idx = sample_indices(values.len());
    let scale = recorded.stats.abs_max.max(event.stats.abs_max);
    // A choice (top-k positions, expert ids) is the same or another: a tolerance scaled by the
    // largest position would pass a neighbouring key as agreement.
    let choice = crate::debug::selection::is_selection(recorded);
    for (k, (&a, &b)) in sample.iter().zip(&now).enumerate() {
        let same = match how {
            Agreement::Exact => a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            Agreement::Within(_) if choice => a == b,
            Agreement::Within(_) => same_f64(a as f64, b as f64, scale, how),
        };
        if !same {
            return Some(if choice {
                format!(
                    "choice [{}] recorded {a}, recomputed {b} (across devices a choice within \
                     noise can flip: verify on the recording's device to compare bit for bit)",
                    idx[k]
                )
            } else {
                format!("value [{}] recorded {a:e}, recomputed {b:e}", idx[k])
            });
        }
    }
    if sample.len() != now.len() {
        return Some(format!(
            "sample of {} values recorded, {} recomputed",
            sample.len(),
            now.len()
        ));
    }
    None
}

/// Recomputes every recorded run and compares it op by op. Returns the first mismatch (also
/// printed), or `None` when everything matched.
pub fn verify(
    session: &Session,
    device: DeviceArg,
    out: &mut dyn std::io::Write,
) -> Result<Option<String>> {
    verify_within(session, device, None, out)
}

/// [`verify`], refusing before anything is computed a recomputation that would need more than
/// `max_memory_gb` (default: the memory available).
pub fn verify_within(
    session: &Session,
    device: DeviceArg,
    max_memory_gb: Option<f64>,
    out: &mut dyn std::io::Write,
) -> Result<Option<String>> {
    let io = Error::stdout;
    let model = crate::setup::load_model(&session.model)?;
    let layers = session.layers.0..session.layers.1;
    if layers.is_empty() || layers.end > model.layout.num_layers {
        return Err(Error::invalid(format!(
            "the session's layers {:?} do not fit the model",
            session.layers
        )));
    }
    let context = session
        .runs
        .iter()
        .filter_map(|r| r.schedule.as_ref())
        .map(|s| s.prompt.len().saturating_add(s.decode))
        .chain([session.prompt.len().saturating_add(session.decode)])
        .max()
        .unwrap_or(0);
    crate::memory::check(&model, context, &layers, max_memory_gb)?;
    let mut backends: Vec<((DeviceFlag, crate::engine::StorageDtype), Box<dyn Backend>)> =
        Vec::new();
    let mut checked = 0usize;
    for (n, run) in session.runs.iter().enumerate() {
        let backend_choice = crate::backend::DeviceChoice::from(device);
        let device_flag = match backend_choice {
            crate::backend::DeviceChoice::Cuda => DeviceFlag::Cuda,
            _ => DeviceFlag::Cpu,
        };
        let key = (device_flag, run.flags.dtype);
        if !backends.iter().any(|(k, _)| *k == key) {
            let (b, note) = crate::backend::select(backend_choice, run.flags.dtype)?;
            if let Some(note) = note {
                eprintln!("{note}");
            }
            backends.push((key, b));
        }
        let backend = &backends.iter().find(|(k, _)| *k == key).expect("added").1;
        let on_cpu = backend.name().starts_with("cpu");
        let mut flags = run.flags;
        flags.device = if on_cpu {
            DeviceFlag::Cpu
        } else {
            DeviceFlag::Cuda
        };
        // The fast GPU kernels trace ops of their own (log-sum-exps, split partials, the merge)
        // where the reference kernels trace probabilities: a run recorded on one is recomputed
        // on the same kind of kernel, or not at all.
        if !on_cpu && run.flags.device == DeviceFlag::Cpu {
            flags.kernels.kernel = crate::ops::AttnKernel::Reference;
        }
        if on_cpu && run.ops.iter().any(|op| op.event.ran_fast_kernel()) {
            return Err(Error::invalid(format!(
                "run {n} attended on the fast GPU kernels, whose ops (attn_lse, split partials) \
                 the CPU does not have: verify it with --device cuda"
            )));
        }
        let how = if on_cpu && run.flags.device == DeviceFlag::Cpu {
            Agreement::Exact
        } else {
            // Another device: its own tolerance (the GPU agrees with the CPU within 2e-5 in f32,
            // a bf16 rounding step in bf16).
            Agreement::Within(default_tolerance(flags.dtype).max(1e-4))
        };
        let schedule = run
            .schedule
            .as_ref()
            .map(|s| s.schedule())
            .unwrap_or_else(|| session.schedule());
        let job = Job {
            model: &model,
            backend: backend.as_ref(),
            schedule: &schedule,
            layers: &layers,
            poison: run.poison,
        };
        let forced =
            std::sync::Arc::new(crate::engine::ForcedSelections::from_entries(&run.forced));
        let record = job.run_forced(flags, &schedule, &forced, None)?;
        if let Some(m) = compare_run(n, run, &record, how) {
            writeln!(out, "mismatch: {m}").map_err(io)?;
            return Ok(Some(m));
        }
        checked += run.ops.len();
        writeln!(
            out,
            "run {n} ({}; {}): {} ops match{}",
            role_name(&run.role),
            run.flags,
            run.ops.len(),
            match how {
                Agreement::Exact => " bit for bit".to_string(),
                Agreement::Within(t) => format!(" within {t:.0e}"),
            }
        )
        .map_err(io)?;
    }
    if checked == 0 {
        // "All match" over nothing compared would be a verdict on nothing.
        return Err(Error::invalid(
            "the session holds no recorded ops: there is nothing to verify",
        ));
    }
    writeln!(
        out,
        "verified {checked} ops of {} run(s): all match",
        session.runs.len()
    )
    .map_err(io)?;
    Ok(None)
}

fn role_name(role: &RunRole) -> String {
    match role {
        RunRole::Main => "main".into(),
        RunRole::Check => "check".into(),
        RunRole::Aux { of, kind } => format!("{kind} of run {of}"),
    }
}

fn compare_run(
    n: usize,
    run: &RecordedRun,
    record: &crate::debug::RunRecord,
    how: Agreement,
) -> Option<String> {
    for (i, op) in run.ops.iter().enumerate() {
        let e = &op.event;
        let Some(now) = record.events.get(i) else {
            return Some(format!(
                "run {n}, op #{i} {} {}: recorded, but the recomputed run has only {} ops",
                e.phase,
                e.name,
                record.len()
            ));
        };
        if let Some(d) = op_differs(e, &op.sample, now, record.outputs[i].data(), how) {
            return Some(format!("run {n}, op #{i} {} {}: {d}", e.phase, e.name));
        }
    }
    // A run recorded with its outcome ran to its end: the recomputation must end where it did
    // and with the same outcome. One recorded without (stopped midway) may run on past it.
    let Some(a) = &run.outcome else {
        return None;
    };
    if record.len() != run.ops.len() {
        return Some(format!(
            "run {n}: recorded complete with {} ops, the recomputed run has {}",
            run.ops.len(),
            record.len()
        ));
    }
    let Some(b) = &record.outcome else {
        return Some(format!(
            "run {n}, outcome: recorded tokens {:?} next {}, the recomputed run has none ({})",
            a.generated,
            a.next_token,
            record.error.as_deref().unwrap_or("no error given")
        ));
    };
    let logit_same = match how {
        Agreement::Exact => a.next_logit.to_bits() == b.next_logit.to_bits(),
        Agreement::Within(t) => same_f64(
            a.next_logit as f64,
            b.next_logit as f64,
            1.0,
            Agreement::Within(t),
        ),
    };
    if a.tokens != b.tokens || a.next_token != b.next_token || !logit_same {
        return Some(format!(
            "run {n}, outcome: recorded tokens {:?} next {} ({}), recomputed {:?} next {} ({})",
            a.generated, a.next_token, a.next_logit, b.generated, b.next_token, b.next_logit
        ));
    }
    None
}

/// `--bench`: the file's size, the time to parse it and to build the replay's runs from it.
fn bench(file: &Path) -> Result<()> {
    let bytes = std::fs::metadata(file)
        .map_err(|e| Error::io(file, e))?
        .len();
    let mut parse = Vec::new();
    let mut build = Vec::new();
    let mut session = None;
    for _ in 0..5 {
        let t = Instant::now();
        let s = Session::load(file)?;
        parse.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let tensors = s.load_tensors(file)?;
        let records: Vec<_> = s
            .runs
            .iter()
            .enumerate()
            .map(|(n, r)| r.to_record(tensors.as_ref().map(|t| &t[n][..])))
            .collect();
        std::hint::black_box(&records);
        build.push(t.elapsed().as_secs_f64());
        session = Some(s);
    }
    let s = session.expect("five loads");
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let ops: usize = s.runs.iter().map(|r| r.ops.len()).sum();
    let companion = s
        .tensors
        .as_ref()
        .and_then(|t| std::fs::metadata(file.parent().unwrap_or(Path::new(".")).join(t)).ok())
        .map(|m| m.len());
    writeln!(
        Out,
        "{}: {} bytes ({:.2} MB), {} run(s), {ops} ops ({:.0} bytes/op){}",
        file.display(),
        bytes,
        bytes as f64 / 1e6,
        s.runs.len(),
        bytes as f64 / ops.max(1) as f64,
        companion
            .map(|c| format!(", companion tensors {:.2} MB", c as f64 / 1e6))
            .unwrap_or_default()
    )?;
    writeln!(
        Out,
        "load (parse + validate): {:.1} ms; replay build (runs{}): {:.1} ms (median of 5)",
        median(&mut parse) * 1e3,
        if companion.is_some() {
            " and full tensors"
        } else {
            " from samples"
        },
        median(&mut build) * 1e3
    )?;
    Ok(())
}
