//! Helpers shared by the integration tests.
#![allow(dead_code)]

use mladb::backend::cpu::CpuBackend;
use mladb::engine::generate::{self, Outcome, Schedule};
use mladb::engine::{Engine, EngineOptions, MlaPaths, Phase, Recorder};
use mladb::model::{Layout, Model};
use mladb::tensor::Tensor;

pub const BUDGET: usize = 1 << 30;

pub fn synthetic(layout: &str, seed: u64) -> Model {
    Model::synthetic(Layout::resolve(layout).unwrap(), seed, BUDGET).unwrap()
}

/// Runs a schedule on a fresh engine, recording every op.
pub fn record(
    model: &Model,
    paths: MlaPaths,
    prompt: &[u32],
    prefill: usize,
    decode: usize,
) -> (Recorder, Outcome) {
    let mut engine =
        Engine::new(model, &CpuBackend, EngineOptions::all_layers(model, paths)).unwrap();
    let mut rec = Recorder::default();
    let schedule = Schedule {
        prompt: prompt.to_vec(),
        prefill_len: prefill,
        decode_steps: decode,
    };
    let outcome = generate::run(&mut engine, &schedule, &mut rec).unwrap();
    (rec, outcome)
}

pub fn output<'a>(rec: &'a Recorder, phase: Phase, name: &str) -> &'a Tensor {
    rec.output(phase, name)
        .unwrap_or_else(|| panic!("no op {name} in {phase}"))
}

pub fn prompt(vocab: usize, len: usize) -> Vec<u32> {
    (0..len).map(|i| ((i * 7919 + 11) % vocab) as u32).collect()
}

/// Last row of a [rows, cols] tensor.
pub fn last_row(t: &Tensor) -> &[f32] {
    t.row(t.rows() - 1)
}

/// A CUDA backend storing `storage`. GPU tests are `#[ignore]`d by default, so that cargo
/// counts them as ignored, with the reason, where there is no GPU (CI); `tools/gpu_check.sh`
/// runs them with `--include-ignored` on a GPU machine, where a missing GPU fails them rather
/// than letting them pass.
pub fn cuda_backend(storage: mladb::engine::StorageDtype) -> mladb::backend::cuda::CudaBackend {
    if let Err(why) = mladb::backend::cuda::probe() {
        panic!("a GPU test was asked to run, and there is no usable GPU: {why}");
    }
    mladb::backend::cuda::CudaBackend::new(storage).expect("a probed GPU opens")
}

/// The GPU backends to test (f32 and bf16 storage), each with the relative error allowed for a
/// whole forward pass against the CPU. Fails where there is no GPU (see `cuda_backend`).
pub fn gpu_backends() -> Vec<(
    &'static str,
    std::sync::Arc<dyn mladb::backend::Backend>,
    f64,
)> {
    use mladb::engine::StorageDtype;
    // Per op (and, in f32, per logit vector) against the CPU at the same storage dtype: f32
    // checks the logic; bf16, two implementations of bf16 storage (the CPU's emulated
    // rounding, the device's), which were seen to differ by under 3e-2 per op on the tiny
    // layouts until a selection flips (gpu_forward.rs stops there). A real fault lands near 1.
    [
        ("cuda-f32", StorageDtype::F32, 1e-4),
        ("cuda-bf16", StorageDtype::Bf16, 5e-2),
    ]
    .into_iter()
    .map(|(name, storage, tol)| {
        let b: std::sync::Arc<dyn mladb::backend::Backend> =
            std::sync::Arc::new(cuda_backend(storage));
        (name, b, tol)
    })
    .collect()
}

/// Tests written once as `fn name(gpu: bool)` and declared twice, as `name::cpu` on the CPU
/// backends (always run) and `name::gpu` on the GPU backends (ignored by default, with the
/// reason; see `cuda_backend`).
#[macro_export]
macro_rules! cpu_and_gpu {
    ($($body:ident),+ $(,)?) => {$(
        mod $body {
            #[test]
            fn cpu() {
                super::$body(false)
            }
            #[test]
            #[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
            fn gpu() {
                super::$body(true)
            }
        }
    )+};
}

/// Fresh random inputs: a new seed per process (printed, to reproduce a failure).
pub fn seed() -> u64 {
    use std::sync::OnceLock;
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| {
        let s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        eprintln!("random inputs from seed {s}");
        s
    })
}

/// A small 64-bit LCG with an output mix (splitmix), for test inputs.
pub struct Lcg(u64);

impl Lcg {
    pub fn new(seed: u64) -> Lcg {
        Lcg(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// The debugger's app on glm5-tiny (seed 0, CPU, a 12-token prompt of which 9 are prefilled,
/// then 2 decode steps) with `flags`, driven inline: what the TUI and session tests start from.
pub fn tiny_app(flags: &str) -> mladb::tui::app::App {
    live_app("glm5-tiny", flags, 12, 9, 2)
}

/// The debugger's app on a built-in layout (seed 0, CPU) over a `total`-token prompt of which
/// `prefill` are prefilled, then `decode` decode steps, with `flags`, driven inline.
pub fn live_app(
    layout: &str,
    flags: &str,
    total: usize,
    prefill: usize,
    decode: usize,
) -> mladb::tui::app::App {
    use mladb::tui::{app::App, driver::InlineDriver, keys::Keymap, theme::Theme};
    let driver = InlineDriver::new(live_spec(layout, flags, total, prefill, decode)).unwrap();
    App::new(Box::new(driver), Keymap::default(), Theme::plain())
}

/// What `live_app` starts its debugger from, for tests that drive it another way or change it.
pub fn live_spec(
    layout: &str,
    flags: &str,
    total: usize,
    prefill: usize,
    decode: usize,
) -> mladb::tui::host::HostSpec {
    use mladb::debug::Flags;
    use mladb::session::ModelSource;
    use std::sync::Arc;
    let model = Arc::new(synthetic(layout, 0));
    let schedule = Schedule {
        prompt: prompt(model.layout.vocab_size, total),
        prefill_len: prefill,
        decode_steps: decode,
    };
    let layers = 0..model.layout.num_layers;
    let backend: Arc<dyn mladb::backend::Backend> = Arc::new(CpuBackend);
    mladb::tui::host::HostSpec {
        model,
        source: ModelSource::Layout {
            layout: layout.into(),
            seed: 0,
            quant: None,
        },
        backend,
        schedule,
        layers,
        flags: Flags::parse(flags).unwrap(),
        max_memory_gb: None,
        text: None,
        reference: None,
    }
}

/// The standard output of a finished `mladb` process, as text.
pub fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Its standard error, as text.
pub fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Bad input: exit code 2 and exactly one `error:` line naming the problem; never a panic.
#[track_caller]
pub fn assert_clean_error(o: &std::process::Output, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "exit code; stderr: {err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    assert!(err.contains(needle), "expected '{needle}' in: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Types `:line` and Enter into the debugger.
pub fn command(app: &mut mladb::tui::app::App, line: &str) {
    use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
    for c in std::iter::once(':').chain(line.chars()) {
        app.on_key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE));
    }
    app.on_key(KeyEvent::new(KeyCode::Enter, KeyModifiers::NONE));
}

/// Starts `mladb attach --listen 127.0.0.1:0 ARGS` with stdout piped; returns it and the address
/// it printed on stderr.
pub fn spawn_attach(args: &[&str]) -> (std::process::Child, String) {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(["attach", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    let address = line
        .trim()
        .strip_prefix("mladb attach: listening on ")
        .unwrap_or_else(|| panic!("no address on stderr: {line:?}"))
        .to_string();
    // The rest of stderr is read too: a closed pipe would fail attach's later lines.
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
    (child, address)
}

/// The debugger's whole screen, `w` × `h`, as text (one line per row).
pub fn screen_text(app: &mut mladb::tui::app::App, w: u16, h: u16) -> String {
    use ratatui::{backend::TestBackend, Terminal};
    let mut terminal = Terminal::new(TestBackend::new(w, h)).unwrap();
    terminal.draw(|f| mladb::tui::ui::draw(f, app)).unwrap();
    let b = terminal.backend().buffer().clone();
    (0..h)
        .map(|y| (0..w).map(|x| b[(x, y)].symbol()).collect::<String>() + "\n")
        .collect()
}

/// The screen with op `name` of `phase` of the current run selected and the Compare pane open.
pub fn compare_pane(app: &mut mladb::tui::app::App, phase: Phase, name: &str) -> String {
    let run = app.mirror.current().unwrap();
    let i = run
        .events
        .iter()
        .position(|e| e.phase == phase && e.name == name)
        .unwrap_or_else(|| panic!("{phase} {name}"));
    app.follow = false;
    app.select(mladb::tui::app::Node::Op(i));
    app.tab = mladb::tui::app::Tab::Compare;
    screen_text(app, 200, 60)
}

/// `check` over every layer on `backend`, poisoned, with the flags of `flags` (the device flag
/// follows the backend; `dtype=` is for the CPU, which rounds to it) and the table's
/// tolerances, against `reference` when one is given.
pub fn check_on(
    backend: &dyn mladb::backend::Backend,
    model: &Model,
    schedule: &Schedule,
    flags: &str,
    reference: Option<mladb::debug::external::ExternalDump>,
) -> mladb::debug::detect::CheckReport {
    use mladb::debug::detect::{check, CheckOptions};
    let layers = 0..model.layout.num_layers;
    let job = mladb::debug::runner::Job {
        model,
        backend,
        schedule,
        layers: &layers,
        poison: true,
    };
    let options = CheckOptions {
        tolerance: None,
        reference,
    };
    let mut flags = mladb::debug::Flags::parse(flags).unwrap();
    if !backend.name().starts_with("cpu") {
        flags.device = mladb::debug::flags::DeviceFlag::Cuda;
    }
    check(&job, flags, &options).unwrap()
}

/// A copy of `from` at `to` with the f32 tensor `key`'s values multiplied by `by`.
pub fn scaled_copy(from: &std::path::Path, to: &std::path::Path, key: &str, by: f32) {
    let bytes = std::fs::read(from).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().clone();
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::F32, "{name}");
            let mut data = v.data().to_vec();
            if name == key {
                for b in data.chunks_exact_mut(4) {
                    let x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * by;
                    b.copy_from_slice(&x.to_le_bytes());
                }
            }
            (name, v.shape().to_vec(), data)
        })
        .collect();
    assert!(
        tensors.iter().any(|(n, _, _)| n == key),
        "{key} is in the dump"
    );
    let views = tensors.iter().map(|(name, shape, data)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                .unwrap();
        (name.clone(), view)
    });
    std::fs::write(to, safetensors::serialize(views, meta).unwrap()).unwrap();
}
