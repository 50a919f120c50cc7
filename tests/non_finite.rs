//! NaN and Inf never look like agreement or like real tokens: tokens greedy decoding took from
//! non-finite logits are flagged wherever generated tokens are shown (`run`'s summary and JSON,
//! `check`, a recorded session's outcome, the debugger's log), and the debugger's Compare pane
//! counts NaN / Inf before any figure.

mod common;

use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use ratatui::Terminal;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use std::path::Path;
use std::process::{Command, Output};

fn mladb(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(args)
        .output()
        .expect("the mladb binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A copy of the glm5-sparse HF fixture whose lm_head rows `rows` are NaN: the logits of those
/// vocabulary entries are NaN at every step.
fn checkpoint_with_nan_logits(dir: &Path, rows: std::ops::Range<usize>) {
    checkpoint_with_nan_rows(dir, "lm_head.weight", rows)
}

/// A copy of the glm5-sparse HF fixture whose weight `name` has its rows `rows` NaN.
fn checkpoint_with_nan_rows(dir: &Path, name: &str, rows: std::ops::Range<usize>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/glm5-sparse");
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let weight = st.tensor(name).unwrap();
    assert_eq!(weight.dtype(), safetensors::Dtype::F32);
    let width = weight.shape()[1];
    let mut data = weight.data().to_vec();
    for r in rows {
        for c in 0..width {
            let at = (r * width + c) * 4;
            data[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        }
    }
    let mut views: Vec<(String, TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != name)
        .collect();
    views.push((
        name.into(),
        TensorView::new(weight.dtype(), weight.shape().to_vec(), &data).unwrap(),
    ));
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
}

fn json_summary(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", stderr(o));
    let out = stdout(o);
    serde_json::from_str(out.lines().last().unwrap()).unwrap()
}

#[test]
fn tokens_from_nan_logits_are_flagged_not_listed_as_real() {
    let dir = tempfile::tempdir().unwrap();
    let all = dir.path().join("all-nan");
    let one = dir.path().join("one-nan");
    std::fs::create_dir_all(&all).unwrap();
    std::fs::create_dir_all(&one).unwrap();
    checkpoint_with_nan_logits(&all, 0..256);
    checkpoint_with_nan_logits(&one, 17..18);
    let run = |model: &Path, extra: &[&str]| {
        let mut args = vec!["run", "--model", model.to_str().unwrap(), "--decode", "2"];
        args.extend_from_slice(extra);
        mladb(&args)
    };

    for model in [&all, &one] {
        let s = json_summary(&run(model, &["--json"]));
        assert_eq!(s["generated"], serde_json::json!([null, null]), "{s}");
        assert_eq!(s["generated_non_finite"], serde_json::json!([0, 1]), "{s}");
        assert!(s["next_token"].is_null(), "{s}");
        let o = run(model, &[]);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = stdout(&o);
        assert!(
            out.contains(
                "generated [none, none] (2 of 2 taken from non-finite logits: not real tokens)"
            ) && out.contains("next token none (non-finite logits)"),
            "{out}"
        );
    }

    // The untouched fixture's tokens are real.
    let clean = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/glm5-sparse");
    let s = json_summary(&run(&clean, &["--json"]));
    assert!(s["generated"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t.is_u64()));
    assert_eq!(s["generated_non_finite"], serde_json::json!([]));

    // check says so among its notes; a recorded session keeps the flags.
    let a = all.to_str().unwrap();
    let o = mladb(&["check", "--model", a, "--decode", "2"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("note: generated [none, none] (2 of 2 taken from non-finite logits"),
        "{}",
        stdout(&o)
    );
    let session = dir.path().join("s.ron");
    let o = run(&all, &["--record", session.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = mladb(&["replay", session.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let first: serde_json::Value =
        serde_json::from_str(stdout(&o).lines().next().unwrap()).unwrap();
    assert_eq!(first["type"], "run");
    assert_eq!(
        first["outcome"]["non_finite"],
        serde_json::json!([0, 1]),
        "{first}"
    );
    assert_eq!(first["outcome"]["next_non_finite"], true, "{first}");
}

/// bisect names the first op whose output is NaN by its NaN count, with no figure: there is no
/// element finite on both sides to compute one over.
#[test]
fn bisect_reports_nan_counts_not_perfect_figures() {
    let o = mladb(&[
        "bisect",
        "--layout",
        "glm5-tiny",
        "--decode",
        "1",
        "--a",
        "inject=output-buffer-disconnect",
        "--b",
        "",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let out = stdout(&o);
    let first = out
        .lines()
        .find(|l| l.starts_with("first divergent:"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        first.contains("model.layers.0.self_attn.attn_output: non-finite values: NaN ")
            && first.contains(" vs 0 (here vs reference)")
            && first.contains("no element is finite on both sides"),
        "{first}"
    );
    assert!(
        !first.contains("cosine") && !first.contains("max |Δ|"),
        "{first}"
    );
}

fn screen(app: &mut mladb::tui::app::App) -> String {
    let mut terminal = Terminal::new(TestBackend::new(120, 40)).unwrap();
    terminal.draw(|f| mladb::tui::ui::draw(f, app)).unwrap();
    terminal.backend().to_string()
}

fn press(app: &mut mladb::tui::app::App, code: KeyCode) {
    app.on_key(KeyEvent::new(code, KeyModifiers::NONE));
}

fn command(app: &mut mladb::tui::app::App, line: &str) {
    for c in format!(":{line}").chars() {
        press(app, KeyCode::Char(c));
    }
    press(app, KeyCode::Enter);
}

/// A fault that leaves the attention output unwritten (poison NaN) after a clean run: the log
/// flags the tokens, and the Compare pane counts NaN against the clean run before any figure.
#[test]
fn the_debugger_flags_nan_tokens_and_counts_nan_in_its_comparison() {
    let mut app = common::tiny_app("");
    press(&mut app, KeyCode::Char('c'));
    command(&mut app, "set inject output-buffer-disconnect");
    press(&mut app, KeyCode::Char('c'));
    let log = app.log.join("\n");
    assert!(
        log.contains("run 1 finished: generated [none, none] (2 of 2 taken from non-finite logits"),
        "{log}"
    );
    // The position is the last op (the logits of the last decode step): compare it.
    press(&mut app, KeyCode::Tab);
    press(&mut app, KeyCode::Tab);
    let text = screen(&mut app);
    assert!(text.contains("non-finite values: NaN"), "{text}");
    assert!(!text.contains("cos 1.000000"), "{text}");
}

/// Two runs of a model whose last prompt token embeds to NaN hold the same NaN in that row of
/// every op after the embedding, and agree in the other rows. Where they agree, bisect says so
/// (with a note on the NaN), and a fault planted after the embedding is still found at its op:
/// the NaN alike used to be the first divergence, and carried an infinite error that passed every
/// later op.
#[test]
fn nan_alike_in_both_runs_is_not_a_divergence_and_hides_none_after_it() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint_with_nan_rows(dir.path(), "model.embed_tokens.weight", 7..8);
    let model = dir.path().to_str().unwrap();
    let bisect = |b: &str| {
        let args = ["--model", model, "--tokens", "1,2,3,7", "--decode", "1"];
        mladb(&[&["bisect"][..], &args, &["--a", "", "--b", b]].concat())
    };
    let o = bisect("");
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{out}{}", stderr(&o));
    assert!(out.contains("no op differs beyond its tolerance"), "{out}");
    assert!(out.contains("hold the same NaN/Inf on both sides"), "{out}");

    let o = bisect("inject=rope-noninterleaved@prefill");
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "{out}{}", stderr(&o));
    let first = out
        .lines()
        .find(|l| l.starts_with("first divergent:"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        first.contains("prefill model.layers.0.self_attn.q_rope"),
        "{first}"
    );
}
