//! Random input never panics the debugger: key sequences (every bound key and others, with and
//! without Ctrl), mouse clicks and scrolls, `:` command lines (well-formed ones of every
//! command, garbage, very long input) and `/` searches over live sessions of the tiny layouts and over the
//! shipped sessions replayed, with the screen drawn at a random size after every input.
//!
//! Nothing typed can write outside a temporary directory: the app has no autosave and no log
//! file (only `mladb tui` sets them up), and every `:save` line is pointed into a temporary
//! directory before it is entered, whatever path was typed. The cases are bounded
//! (`MLADB_PROP_CASES`, default 64) and the random generator seeded (`MLADB_PROP_SEED`), so a
//! run is repeatable.

mod common;

use mladb::backend::cpu::CpuBackend;
use mladb::debug::Flags;
use mladb::engine::generate::Schedule;
use mladb::model::Model;
use mladb::session::{ModelSource, Session};
use mladb::tui::app::{App, Overlay};
use mladb::tui::driver::InlineDriver;
use mladb::tui::host::HostSpec;
use mladb::tui::keys::Keymap;
use mladb::tui::replay::ReplayDriver;
use mladb::tui::theme::Theme;
use mladb::tui::ui;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};
use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{
    KeyCode, KeyEvent, KeyModifiers, MouseButton, MouseEvent, MouseEventKind,
};
use ratatui::Terminal;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// What the debugger is opened on.
#[derive(Debug, Clone, Copy)]
enum Target {
    Live(&'static str),
    Replay(usize),
}

/// One input.
#[derive(Debug, Clone)]
enum Input {
    Key(KeyCode, bool),
    /// `:`, the text typed key by key, then Enter.
    Line(String),
    /// `/`, the text typed key by key, then Enter.
    Search(String),
    Mouse(MouseEventKind, u16, u16),
    /// The terminal's size from now on.
    Resize(u16, u16),
}

fn key_code() -> impl Strategy<Value = KeyCode> {
    let bound: Vec<char> = "kjgGsncRbmfidlh.[]?:q /NP{}oJK".chars().collect();
    prop_oneof![
        4 => prop::sample::select(bound).prop_map(KeyCode::Char),
        1 => any::<char>().prop_map(KeyCode::Char),
        2 => prop::sample::select(vec![
            KeyCode::Enter,
            KeyCode::Esc,
            KeyCode::Tab,
            KeyCode::Backspace,
            KeyCode::Up,
            KeyCode::Down,
            KeyCode::Left,
            KeyCode::Right,
            KeyCode::PageUp,
            KeyCode::PageDown,
            KeyCode::Home,
            KeyCode::End,
            KeyCode::Delete,
            KeyCode::F(5),
        ]),
    ]
}

fn pick(items: &[&str]) -> BoxedStrategy<String> {
    let v: Vec<String> = items.iter().map(|s| s.to_string()).collect();
    prop::sample::select(v).boxed()
}

fn number() -> BoxedStrategy<String> {
    prop_oneof![
        (0u64..6).prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        pick(&["-1", "", "x", "1e3", "99999999999999999999999", "0x10"]),
    ]
    .boxed()
}

fn real() -> BoxedStrategy<String> {
    prop_oneof![
        any::<f64>().prop_map(|x| x.to_string()),
        pick(&["0", "1e-4", "-1", "nan", "inf", "-inf", "1e400", "x", ""]),
    ]
    .boxed()
}

fn garbage(max: usize) -> BoxedStrategy<String> {
    prop::collection::vec(any::<char>(), 0..max)
        .prop_map(|c| c.into_iter().collect())
        .boxed()
}

/// A breakpoint spec: every kind, with odd numbers and patterns, or garbage.
fn spec() -> BoxedStrategy<String> {
    prop_oneof![
        number().prop_map(|n| format!("layer {n}")),
        pick(&[
            "*",
            "*attn_probs",
            "model.layers.1.*",
            "logits",
            "[",
            "**",
            "",
            "model.layers.99.x"
        ])
        .prop_map(|p| format!("op {p}")),
        pick(&["nan", "zero", "layer", "op", "absmax", "diff>"]),
        real().prop_map(|x| format!("absmax>{x}")),
        real().prop_map(|x| format!("diff>{x}")),
        garbage(12),
    ]
    .boxed()
}

/// A command line: well-formed ones of every command (with odd arguments), garbage, and very
/// long input.
fn line() -> BoxedStrategy<String> {
    let flag = pick(&[
        "mla-disable",
        "prefill-path",
        "decode-path",
        "force-dequant",
        "device",
        "dtype",
        "inject",
        "kv-cache-dtype",
        "bogus",
        "",
    ]);
    let value = pick(&[
        "on",
        "off",
        "naive",
        "absorbed",
        "cpu",
        "cuda",
        "auto",
        "f32",
        "bf16",
        "output-buffer-disconnect",
        "-output-buffer-disconnect",
        "softmax-scale-latent@decode",
        "skip-padded-rows@prefill",
        "kv-cache-off-by-one",
        "lse-base-mismatch,absorb-wrong-split",
        "q4k-scale-unpack",
        "fp8-scale-default@decode",
        "fp8_ds_mla",
        "none",
        "@",
        "",
    ]);
    prop_oneof![
        (flag, value).prop_map(|(f, v)| format!("set {f} {v}")),
        (pick(&["break", "b", "delete", "unbreak"]), spec()).prop_map(|(c, s)| format!("{c} {s}")),
        (pick(&["step", "s"]), number()).prop_map(|(c, n)| format!("{c} {n}")),
        number().prop_map(|n| format!("goto {n}")),
        number().prop_map(|n| format!("goto layer {n}")),
        pick(&[
            "run",
            "continue",
            "c",
            "next",
            "n",
            "restart",
            "bisect",
            "compare",
            "help",
            "quit",
            "step",
            "save",
            "load",
            "note",
            "goto",
            "set",
            "set mla-disable",
        ]),
        garbage(24).prop_map(|t| format!("note {t}")),
        (pick(&["save", "save --tensors"]), garbage(12)).prop_map(|(c, p)| format!("{c} {p}")),
        pick(&["/nonexistent/s.ron", "/", "/dev/null", "/dev/zero", "."])
            .prop_map(|p| format!("load {p}")),
        garbage(40),
        (garbage(4), 2000usize..6000).prop_map(|(t, n)| t.repeat(n / t.len().max(1) + 1)),
    ]
    .boxed()
}

fn input() -> impl Strategy<Value = Input> {
    let mouse_kind = prop::sample::select(vec![
        MouseEventKind::Down(MouseButton::Left),
        MouseEventKind::ScrollUp,
        MouseEventKind::ScrollDown,
    ]);
    prop_oneof![
        12 => (key_code(), prop::bool::weighted(0.1)).prop_map(|(k, c)| Input::Key(k, c)),
        3 => line().prop_map(Input::Line),
        1 => prop_oneof![
            pick(&["attn", "layers.1.", "", "q_absorbed", "LOGITS", "zzz", "."]),
            garbage(12),
        ]
        .prop_map(Input::Search),
        2 => (mouse_kind, 0u16..130, 0u16..45).prop_map(|(k, x, y)| Input::Mouse(k, x, y)),
        1 => (0u16..140, 0u16..50).prop_map(|(w, h)| Input::Resize(w, h)),
    ]
}

fn target() -> impl Strategy<Value = Target> {
    prop_oneof![
        Just(Target::Live("glm5-tiny")),
        Just(Target::Live("deepseek-v3-tiny")),
        (0usize..4).prop_map(Target::Replay),
    ]
}

/// The tiny models, built once.
fn model(layout: &str) -> Arc<Model> {
    static MODELS: OnceLock<Vec<(&'static str, Arc<Model>)>> = OnceLock::new();
    let models = MODELS.get_or_init(|| {
        ["glm5-tiny", "deepseek-v3-tiny"]
            .into_iter()
            .map(|l| (l, Arc::new(common::synthetic(l, 0))))
            .collect()
    });
    models.iter().find(|(l, _)| *l == layout).unwrap().1.clone()
}

/// The shipped sessions, parsed once.
fn sessions() -> &'static [(PathBuf, Session)] {
    static SESSIONS: OnceLock<Vec<(PathBuf, Session)>> = OnceLock::new();
    SESSIONS.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("sessions");
        let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "ron"))
            .collect();
        paths.sort();
        assert_eq!(paths.len(), 4, "the shipped sessions in {}", dir.display());
        paths
            .into_iter()
            .map(|p| {
                let s = Session::load(&p).unwrap();
                (p, s)
            })
            .collect()
    })
}

fn open(target: Target) -> App {
    let app = match target {
        Target::Live(layout) => {
            let model = model(layout);
            let spec = HostSpec {
                schedule: Schedule {
                    prompt: common::prompt(model.layout.vocab_size, 6),
                    prefill_len: 4,
                    decode_steps: 2,
                },
                layers: 0..model.layout.num_layers,
                source: ModelSource::Layout {
                    layout: layout.into(),
                    seed: 0,
                    quant: None,
                },
                model,
                backend: Arc::new(CpuBackend),
                flags: Flags::default(),
                max_memory_gb: None,
                text: None,
                reference: None,
            };
            let driver = InlineDriver::new(spec).unwrap();
            App::new(Box::new(driver), Keymap::default(), Theme::plain())
        }
        Target::Replay(n) => {
            let (path, session) = &sessions()[n];
            let driver = ReplayDriver::new(session.clone(), path).unwrap();
            App::new(Box::new(driver), Keymap::default(), Theme::plain())
        }
    };
    assert!(app.autosave.is_none(), "no autosave in tests");
    app
}

/// Points a `:save` line into `dir`, whatever path was typed (the only command that writes).
fn confine(input: &str, dir: &Path, n: usize) -> String {
    let line = input.trim();
    let (word, rest) = line
        .split_once(' ')
        .map_or((line, ""), |(w, r)| (w, r.trim()));
    if word != "save" {
        return input.to_string();
    }
    let file = dir.join(format!("saved-{n}.ron"));
    if rest.starts_with("--tensors ") {
        format!("save --tensors {}", file.display())
    } else {
        format!("save {}", file.display())
    }
}

fn press(app: &mut App, code: KeyCode, ctrl: bool, dir: &Path, n: usize) {
    // Enter on a command line: what would run, confined first.
    if let (KeyCode::Enter, Overlay::Command { input }) = (code, &app.overlay) {
        app.overlay = Overlay::Command {
            input: confine(input, dir, n),
        };
    }
    let modifiers = if ctrl {
        KeyModifiers::CONTROL
    } else {
        KeyModifiers::NONE
    };
    app.on_key(KeyEvent::new(code, modifiers));
}

/// Plays the inputs, drawing after each one; a panic is reported with the input that caused it.
fn play(target: Target, inputs: &[Input]) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let mut app = open(target);
    let mut size = (100u16, 30u16);
    for (n, input) in inputs.iter().enumerate() {
        let step = catch_unwind(AssertUnwindSafe(|| {
            match input {
                Input::Key(code, ctrl) => press(&mut app, *code, *ctrl, dir.path(), n),
                Input::Line(text) => {
                    press(&mut app, KeyCode::Char(':'), false, dir.path(), n);
                    for c in text.chars() {
                        press(&mut app, KeyCode::Char(c), false, dir.path(), n);
                    }
                    press(&mut app, KeyCode::Enter, false, dir.path(), n);
                }
                Input::Search(text) => {
                    press(&mut app, KeyCode::Char('/'), false, dir.path(), n);
                    for c in text.chars() {
                        press(&mut app, KeyCode::Char(c), false, dir.path(), n);
                    }
                    press(&mut app, KeyCode::Enter, false, dir.path(), n);
                }
                Input::Mouse(kind, x, y) => app.on_mouse(MouseEvent {
                    kind: *kind,
                    column: *x,
                    row: *y,
                    modifiers: KeyModifiers::NONE,
                }),
                Input::Resize(w, h) => size = (*w, *h),
            }
            app.tick();
            let mut terminal = Terminal::new(TestBackend::new(size.0, size.1)).unwrap();
            terminal.draw(|f| ui::draw(f, &mut app)).unwrap();
        }));
        if let Err(panic) = step {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            return Err(TestCaseError::fail(format!(
                "{target:?}: input #{n} {input:?} panicked: {why}"
            )));
        }
    }
    // Whatever was typed, nothing was written but into the temporary directory (which the
    // confined saves may have used).
    let written: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    prop_assert!(
        written
            .iter()
            .all(|f| f.to_string_lossy().starts_with("saved-")),
        "{written:?}"
    );
    Ok(())
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn random_input_never_panics() {
    // The panics are caught and reported as failures, shrunk to the fewest inputs; the default
    // hook would print each one's backtrace during shrinking.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let config = Config {
        cases: env_number("MLADB_PROP_CASES", 64) as u32,
        max_shrink_iters: 400,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(env_number("MLADB_PROP_SEED", 12)),
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let result = runner.run(
        &(target(), prop::collection::vec(input(), 1..40)),
        |(target, inputs)| play(target, &inputs),
    );
    std::panic::set_hook(hook);
    if let Err(e) = result {
        panic!("{e}");
    }
}
