//! Sessions (format v2): recording from the debugger, `run` and `check`; replay in the TUI with
//! no recomputation (the same screens as live); `replay --verify`; damaged files rejected with
//! line and field named; nothing overwritten by a failed save; the autosave.

mod common;

use mladb::backend::cpu::CpuBackend;
use mladb::debug::Flags;
use mladb::engine::generate::Schedule;
use mladb::session::{ModelSource, Session};
use mladb::tui::app::{App, Autosave, Tab};
use mladb::tui::driver::InlineDriver;
use mladb::tui::host::HostSpec;
use mladb::tui::keys::Keymap;
use mladb::tui::replay::ReplayDriver;
use mladb::tui::theme::Theme;
use mladb::tui::ui;
use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use ratatui::Terminal;
use std::path::Path;
use std::process::Command as Process;
use std::sync::Arc;

fn replay(path: &Path) -> App {
    let driver = ReplayDriver::open(path).unwrap();
    App::new(Box::new(driver), Keymap::default(), Theme::plain())
}

fn press(app: &mut App, keys: &str) {
    for c in keys.chars() {
        app.on_key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE));
    }
}

fn command(app: &mut App, line: &str) {
    press(app, ":");
    press(app, line);
    app.on_key(KeyEvent::new(KeyCode::Enter, KeyModifiers::NONE));
}

/// The rendered screen, without the log pane (the replay logs what it replays).
fn screen(app: &mut App, w: u16, h: u16) -> Vec<String> {
    let mut terminal = Terminal::new(TestBackend::new(w, h)).unwrap();
    terminal.draw(|f| ui::draw(f, app)).unwrap();
    let buffer = terminal.backend().buffer().clone();
    (0..h)
        .filter(|&y| !(h - 5..h - 1).contains(&y))
        .map(|y| {
            (0..w)
                .map(|x| buffer[(x, y)].symbol().to_string())
                .collect()
        })
        .collect()
}

fn same_screens(a: &mut App, b: &mut App, what: &str) {
    for tab in Tab::ALL {
        a.tab = tab;
        b.tab = tab;
        let (x, y) = (screen(a, 120, 34), screen(b, 120, 34));
        assert_eq!(
            x,
            y,
            "{what}, {tab:?}: live\n{}\nreplay\n{}",
            x.join("\n"),
            y.join("\n")
        );
    }
}

fn mladb(args: &[&str]) -> (i32, String, String) {
    let out = Process::new(env!("CARGO_BIN_EXE_mladb"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn replay_shows_the_live_screens_step_by_step() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hunt.ron");
    // The live hunt, a screen after every command.
    let mut a = common::tiny_app("inject=output-buffer-disconnect");
    let script = ["s", "n", "n", "c", "m"];
    let mut screens = vec![screen(&mut a, 120, 34)];
    for keys in script {
        press(&mut a, keys);
        a.tab = Tab::Tensor;
        screens.push(screen(&mut a, 120, 34));
    }
    command(&mut a, "note MLA disable routes around the garbage");
    command(&mut a, &format!("save --tensors {}", path.display()));
    assert!(a.log.last().unwrap().contains("saved"), "{:?}", a.log);

    // Opened at its note, which is where the cursor was saved: the same screens, every tab,
    // once the notes pane is hidden.
    let mut b = replay(&path);
    assert_eq!(b.tour.at, Some(0));
    assert!(b.tour.open);
    press(&mut b, "o");
    same_screens(&mut a, &mut b, "at the saved cursor");
    assert!(b.log.iter().any(|l| l.contains("replaying")));

    // From the start (R goes back there), stepping through the recorded ops and the flag change
    // in order: a flag change is crossed with a step where the live session pressed `m`.
    press(&mut b, "R");
    assert!(
        !b.tour.open && b.tour.at.is_none(),
        "back at the start, before any note"
    );
    b.tab = Tab::Tensor;
    assert_eq!(screen(&mut b, 120, 34), screens[0], "start");
    for (i, keys) in script.iter().enumerate() {
        press(&mut b, if *keys == "m" { "s" } else { keys });
        b.tab = Tab::Tensor;
        assert_eq!(
            screen(&mut b, 120, 34),
            screens[i + 1],
            "after {keys}: replay\n{}",
            screen(&mut b, 120, 34).join("\n")
        );
    }
    assert!(b.log.iter().any(|l| l.contains("flags changed to")));
    assert!(b
        .log
        .iter()
        .any(|l| l.contains("note: MLA disable routes around the garbage")));

    // Back to the start and on to the cursor again.
    press(&mut b, "R");
    assert_eq!(b.mirror.runs.len(), 1);
    press(&mut b, "cs");
    assert_eq!(b.mirror.runs.len(), 2);

    // Computing commands are refused with a clear line; nothing changes.
    let runs = b.mirror.runs.len();
    press(&mut b, "m");
    assert!(
        b.log.last().unwrap().contains("needs recomputation"),
        "{:?}",
        b.log.last()
    );
    assert_eq!(b.mirror.runs.len(), runs);
    assert!(b.mirror.flags.mla_disable, "the recorded flags stay");
}

#[test]
fn replay_without_tensors_shows_statistics_and_samples() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.ron");
    let mut a = common::tiny_app("");
    press(&mut a, "nn");
    command(&mut a, &format!("save {}", path.display()));
    assert!(!dir.path().join("s.tensors.safetensors").exists());
    let mut b = replay(&path);
    let (x, y) = (screen(&mut a, 120, 34), screen(&mut b, 120, 34));
    // The header, the tree, the statistics and the first values are the same.
    for row in 0..7 {
        assert_eq!(x[row], y[row], "row {row}");
    }
    // No histogram in the replay: the first and last values come a row earlier.
    assert!(x[7].contains("histogram") && !y[7].contains("histogram"));
    let pane = |l: &String| l.chars().skip(48).collect::<String>();
    assert_eq!(pane(&x[8]), pane(&y[7]));
    assert_eq!(pane(&x[9]), pane(&y[8]));
    assert!(
        y.iter().any(|l| l.contains("values recorded")),
        "{}",
        y.join("\n")
    );
    assert_eq!(
        a.mirror.position().unwrap().name,
        b.mirror.position().unwrap().name
    );
}

#[test]
fn a_saved_session_records_every_run_and_loads_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("all.ron");
    let mut a = common::tiny_app("");
    press(&mut a, "c");
    press(&mut a, "m");
    press(&mut a, "d"); // comparison runs of run 1
    command(&mut a, "note after the comparisons");
    command(&mut a, &format!("save {}", path.display()));
    let s = Session::load(&path).unwrap();
    assert_eq!(s.version, 2);
    let main: Vec<_> = s.runs.iter().filter(|r| r.is_main()).collect();
    assert_eq!(main.len(), 2);
    assert!(!main[0].flags.mla_disable && main[1].flags.mla_disable);
    assert_eq!(main[1].first_affected, Some(149));
    assert_eq!(main[1].compared_with, Some(0));
    assert!(main[0].outcome.is_some() && main[1].outcome.is_some());
    assert_eq!(s.runs.len(), 4, "two comparison runs recorded");
    assert_eq!(s.annotations.len(), 1);
    assert_eq!(s.annotations[0].run, 1);
    // The note records where the user stood: the op selected and the pane shown (d showed
    // the Compare pane).
    let about = s.annotations[0].about.clone().unwrap();
    let (_, e) = a.selected_op().unwrap();
    assert_eq!((about.phase, about.op.as_str()), (e.phase, e.name.as_str()));
    assert_eq!(
        s.annotations[0].pane,
        Some(mladb::session::recorded::Pane::Compare)
    );
    let op = &main[0].ops[40];
    assert_eq!(op.sample.len(), 32.min(op.event.shape.iter().product()));
    // A v2 file still opens live (recomputing) through :load.
    let mut b = common::tiny_app("");
    command(&mut b, &format!("load {}", path.display()));
    assert!(b.mirror.flags.mla_disable);
}

#[test]
fn a_note_typed_over_the_learn_view_is_about_it() {
    use mladb::session::recorded::Pane;
    use mladb::tui::app::Overlay;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("learn.ron");
    let mut a = common::tiny_app("");
    press(&mut a, "c");
    press(&mut a, "l");
    press(&mut a, "jj");
    // `:` opens the command line over the view, which comes back once the note is typed.
    command(&mut a, "note the latent is 64 wide");
    assert_eq!(a.overlay, Overlay::Learn { scroll: 2 });
    press(&mut a, ":");
    a.on_key(KeyEvent::new(KeyCode::Esc, KeyModifiers::NONE));
    assert_eq!(a.overlay, Overlay::Learn { scroll: 2 }, "Esc too");
    a.on_key(KeyEvent::new(KeyCode::Esc, KeyModifiers::NONE));
    assert_eq!(a.overlay, Overlay::None);
    a.tab = Tab::Buffers;
    command(&mut a, "note and here the buffers");
    command(&mut a, &format!("save {}", path.display()));
    let s = Session::load(&path).unwrap();
    let panes: Vec<_> = s.annotations.iter().map(|n| n.pane).collect();
    assert_eq!(panes, [Some(Pane::Learn), Some(Pane::Buffers)]);
    // A live session has nothing to tour: the keys say so.
    press(&mut a, "}");
    assert!(a.notice.as_ref().unwrap().contains("no notes placed"));
}

#[test]
fn damaged_files_are_rejected_with_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.ron");
    let (rc, _, err) = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--tokens",
        "1,2,3",
        "--decode",
        "1",
        "--record",
        path.to_str().unwrap(),
    ]);
    assert_eq!(rc, 0, "{err}");
    let text = std::fs::read_to_string(&path).unwrap();

    let truncated = dir.path().join("truncated.ron");
    std::fs::write(&truncated, &text[..text.len() * 2 / 3]).unwrap();
    let (rc, _, err) = mladb(&["replay", truncated.to_str().unwrap(), "--verify"]);
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.contains("truncated.ron") && err.contains("line "),
        "{err}"
    );

    let corrupt = dir.path().join("corrupt.ron");
    let at = text.find("nan: 0,").unwrap();
    let bad = format!("{}nan: \"zero\",{}", &text[..at], &text[at + 7..]);
    std::fs::write(&corrupt, bad).unwrap();
    let (rc, _, err) = mladb(&["replay", corrupt.to_str().unwrap(), "--verify"]);
    assert_eq!(rc, 2);
    assert!(
        err.contains("field runs[0].ops[0].event.stats.nan") && err.contains("line "),
        "{err}"
    );
    let line = text[..at].lines().count();
    assert!(err.contains(&format!("line {line},")), "{err}");

    // A wrong sample length is named too.
    let err = Session::parse(&text.replacen("sample: [", "sample: [1.0, ", 1)).unwrap_err();
    assert!(err.contains("runs[0].ops[0].sample"), "{err}");

    let (rc, _, err) = mladb(&["replay", "/nonexistent/x.ron", "--verify"]);
    assert_eq!(rc, 2, "{err}");
}

#[test]
fn verify_passes_bit_exact_and_names_the_first_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.ron");
    let (rc, out, _) = mladb(&[
        "check",
        "--layout",
        "glm5-tiny",
        "--prefill",
        "9",
        "--decode",
        "2",
        "--inject",
        "output-buffer-disconnect",
        "--record",
        path.to_str().unwrap(),
    ]);
    assert_eq!(rc, 1, "check has findings: {out}");
    let s = Session::load(&path).unwrap();
    assert!(s
        .check
        .as_ref()
        .unwrap()
        .findings
        .iter()
        .any(|f| f.kind.to_string() == "buffer-disconnect"));
    let (rc, out, err) = mladb(&["replay", path.to_str().unwrap(), "--verify"]);
    assert_eq!(rc, 0, "{out}{err}");
    assert!(out.contains("bit for bit"), "{out}");
    assert!(
        out.contains("other-path of run 0") && out.contains("whole-prefill of run 0"),
        "the comparison runs are recorded and verified: {out}"
    );
    // The replay's Compare pane shows them once the run has ended.
    let mut b = replay(&path);
    press(&mut b, "c");
    assert!(b.mirror.aux(mladb::tui::host::AuxKind::OtherPath).is_some());
    b.tab = Tab::Compare;
    let text = screen(&mut b, 120, 34).join("\n");
    assert!(
        text.contains("absorbed vs naive") && text.contains("whole prefill"),
        "{text}"
    );
    assert!(!text.contains("press d to compute"), "{text}");

    // One recorded statistic changed in its last digit: verify names the op and the field.
    let text = std::fs::read_to_string(&path).unwrap();
    let mut s = Session::parse(&text).unwrap();
    let op = &mut s.runs[0].ops[5].event;
    op.stats.l2 = f64::from_bits(op.stats.l2.to_bits() + 1);
    let name = op.name.clone();
    let edited = dir.path().join("edited.ron");
    s.save(&edited).unwrap();
    let (rc, out, _) = mladb(&["replay", edited.to_str().unwrap(), "--verify"]);
    assert_eq!(rc, 1, "{out}");
    assert!(
        out.contains(&format!("run 0, op #5 prefill {name}: stats.l2")),
        "{out}"
    );
    // A sampled value changed.
    let mut s = Session::parse(&text).unwrap();
    s.runs[0].ops[9].sample[3] += 1.0;
    s.save(&edited).unwrap();
    let (rc, out, _) = mladb(&["replay", edited.to_str().unwrap(), "--verify"]);
    assert_eq!(rc, 1);
    assert!(out.contains("op #9") && out.contains("value [3]"), "{out}");
    // A complete run cut short in the file: every op left still matches, but the recomputation
    // runs on past them, so the recording is not what it recomputes.
    let mut s = Session::parse(&text).unwrap();
    let all = s.runs[0].ops.len();
    s.runs[0].ops.truncate(all - 3);
    s.save(&edited).unwrap();
    let (rc, out, _) = mladb(&["replay", edited.to_str().unwrap(), "--verify"]);
    assert_eq!(rc, 1, "{out}");
    assert!(
        out.contains(&format!(
            "run 0: recorded complete with {} ops, the recomputed run has {all}",
            all - 3
        )),
        "{out}"
    );
    // Runs stopped before their first op (no outcome): nothing was compared, which is no
    // "all match".
    let mut s = Session::parse(&text).unwrap();
    for run in &mut s.runs {
        run.ops.clear();
        run.outcome = None;
    }
    s.check = None;
    s.annotations.clear();
    s.save(&edited).unwrap();
    let (rc, out, err) = mladb(&["replay", edited.to_str().unwrap(), "--verify"]);
    assert_eq!(rc, 2, "{out}{err}");
    assert!(
        err.contains("error: the session holds no recorded ops"),
        "{err}"
    );
    assert!(!out.contains("all match"), "{out}");

    // Export: JSON lines and a safetensors dump of the samples.
    let (rc, out, _) = mladb(&["replay", path.to_str().unwrap(), "--json"]);
    assert_eq!(rc, 0);
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The checked run and the two comparison runs behind its verdicts.
    assert_eq!(
        lines.iter().filter(|v| v["type"] == "op").count(),
        780 + 788 + 130
    );
    assert_eq!(lines.last().unwrap()["type"], "summary");
    assert_eq!(lines.last().unwrap()["model"], "layout glm5-tiny, seed 0");
    let dump = dir.path().join("d.safetensors");
    let (rc, _, err) = mladb(&[
        "replay",
        path.to_str().unwrap(),
        "--dump",
        dump.to_str().unwrap(),
    ]);
    assert_eq!(rc, 0, "{err}");
    let bytes = std::fs::read(&dump).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("run0/prefill/logits").unwrap();
    assert_eq!(t.shape(), &[32]);
    assert!(st.tensor("run0/prefill/logits.index").is_ok());
}

#[test]
fn a_failed_save_leaves_the_old_session_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keep.ron");
    let mut a = common::tiny_app("");
    command(&mut a, &format!("save {}", path.display()));
    let before = std::fs::read(&path).unwrap();
    press(&mut a, "nn");
    // The companion file's place is taken by a directory: the save fails before the session
    // is written.
    let blocker = dir.path().join("keep.tensors.safetensors");
    std::fs::create_dir(&blocker).unwrap();
    std::fs::write(blocker.join("x"), b"x").unwrap();
    command(&mut a, &format!("save --tensors {}", path.display()));
    assert!(
        a.log.last().unwrap().starts_with("error:"),
        "{:?}",
        a.log.last()
    );
    assert_eq!(std::fs::read(&path).unwrap(), before);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn autosave_writes_the_session_and_never_fails_loudly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state").join("autosave.ron");
    let mut a = common::tiny_app("");
    press(&mut a, "n");
    a.autosave = Some(Autosave {
        path: path.clone(),
        every: std::time::Duration::from_secs(0),
        last: std::time::Instant::now(),
    });
    a.autosave_if_due();
    let s = Session::load(&path).unwrap();
    assert_eq!(s.runs.len(), 1);
    assert_eq!(
        s.cursor.unwrap().op,
        a.mirror.position().unwrap().name,
        "the cursor is where the user stood"
    );
    // An impossible location: logged, not raised.
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    a.autosave = Some(Autosave {
        path: file.join("sub").join("autosave.ron"),
        every: std::time::Duration::from_secs(0),
        last: std::time::Instant::now(),
    });
    a.autosave_now();
    assert!(
        a.log.last().unwrap().contains("autosave failed"),
        "{:?}",
        a.log.last()
    );
}

// ---------------------------------------------------------------------------------------------
// The example sessions in sessions/: recorded by the debugger itself, driven by key presses and
// commands as a user would. Regenerate with
//     cargo test --test sessions record_example_sessions -- --ignored
// and every one is checked by `mladb replay --verify` below.

fn sessions_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("sessions")
}

/// How an example session's debugger starts: a built-in layout with synthetic weights, a few
/// of its layers (the files stay a few hundred KB), a prompt and a schedule.
struct Setup<'a> {
    layout: &'a str,
    quant: Option<&'a str>,
    seed: u64,
    flags: &'a str,
    prompt: Vec<u32>,
    prefill: usize,
    decode: usize,
    layers: std::ops::Range<usize>,
}

impl Setup<'_> {
    /// glm5-tiny's layer 0 over a 10-token prompt: 9 prefilled, the 10th decoded.
    fn tiny(flags: &str) -> Setup<'_> {
        Setup {
            layout: "glm5-tiny",
            quant: None,
            seed: 0,
            flags,
            prompt: common::prompt(2048, 10),
            prefill: 9,
            decode: 1,
            layers: 0..1,
        }
    }
}

fn debugger(s: Setup) -> App {
    let mut args = mladb::cli::args::ModelArgs::with_layout(s.layout);
    args.quant = s.quant.map(str::to_string);
    args.seed = s.seed;
    let model = Arc::new(args.load().unwrap());
    let spec = HostSpec {
        schedule: Schedule {
            prompt: s.prompt,
            prefill_len: s.prefill,
            decode_steps: s.decode,
        },
        layers: s.layers,
        model,
        source: ModelSource::Layout {
            layout: s.layout.into(),
            seed: s.seed,
            quant: s.quant.map(str::to_string),
        },
        backend: Arc::new(CpuBackend),
        flags: Flags::parse(s.flags).unwrap(),
        max_memory_gb: None,
        text: None,
        reference: None,
    };
    App::new(
        Box::new(InlineDriver::new(spec).unwrap()),
        Keymap::default(),
        Theme::plain(),
    )
}

/// Selects the op of the current run named so in `phase` (the last one matching `*name`, when
/// the name starts with `*`).
fn select(app: &mut App, phase: mladb::engine::trace::Phase, name: &str) {
    let run = app.mirror.current().unwrap();
    let i = match name.strip_prefix('*') {
        Some(end) => run
            .events
            .iter()
            .rposition(|e| e.phase == phase && e.name.ends_with(end))
            .unwrap(),
        None => run.find(phase, name).unwrap(),
    };
    app.follow = false;
    app.select(mladb::tui::app::Node::Op(i));
}

fn note(app: &mut App, text: &str) {
    command(app, &format!("note {text}"));
}

fn outcome(app: &App) -> String {
    let o = app.mirror.current().unwrap().outcome.clone().unwrap();
    format!(
        "generated {}, next token {} (logit {})",
        o.generated_text(),
        o.next_text(),
        o.next_logit
    )
}

fn save(app: &mut App, name: &str) {
    command(
        app,
        &format!("save {}", sessions_dir().join(name).display()),
    );
    assert!(
        app.log.last().unwrap().contains("saved"),
        "{:?}",
        app.log.last()
    );
}

/// The selected op's event.
fn selected(app: &App) -> mladb::engine::trace::OpEvent {
    app.selected_op().unwrap().1.clone()
}

#[test]
#[ignore = "regenerates sessions/*.ron"]
fn record_example_sessions() {
    std::fs::create_dir_all(sessions_dir()).unwrap();
    record_output_buffer_disconnect();
    record_weight_absorption();
    record_force_dequant();
    record_dsa_tie();
}

/// The garbage-output hunt: prefill right and decode garbage; MLA disable fixes it; prefill vs
/// decode isolates the decode attention; the Buffers pane shows the disconnect.
fn record_output_buffer_disconnect() {
    use mladb::engine::trace::Phase;
    let (pre, dec) = (Phase::Prefill, Phase::Decode(0));
    let mut a = debugger(Setup::tiny("inject=output-buffer-disconnect@decode"));
    a.tab = Tab::Tensor;
    note(&mut a, "The hunt for garbage output, in seven stops (} next, { back; s/n/c still step). glm5-tiny, layer 0 only to keep the file small: 9 prompt tokens prefilled, the 10th decoded. A bug is planted in the MLA decode backend (fault output-buffer-disconnect@decode), as in vLLM reports of MLA models answering with garbage. We pretend not to know where.");
    press(&mut a, "c");
    assert!(
        a.mirror
            .current()
            .unwrap()
            .outcome
            .as_ref()
            .unwrap()
            .next_non_finite
    );
    select(&mut a, pre, "logits");
    let e = selected(&a);
    assert_eq!(e.stats.nan, 0);
    note(&mut a, &format!("Run 0 has finished. Prefill is right: the prefill logits are finite (nan 0, min {:.3}, max {:.3}) and look like any logits in the Tensor pane. Nothing in prefill hints at a problem.", e.stats.min, e.stats.max));
    select(&mut a, dec, "logits");
    let e = selected(&a);
    assert_eq!(e.stats.nan, e.stats.count);
    note(&mut a, &format!("Decode is garbage: all {} decode logits are NaN, so the token taken from them means nothing (the log says it came from non-finite logits). In the tree, decode's self_attn.attn_latent is marked x (disconnected) and every op after it ! (NaN).", e.stats.count));
    press(&mut a, "m");
    let clean = outcome(&a);
    select(&mut a, dec, "logits");
    assert_eq!(selected(&a).stats.nan, 0);
    a.tab = Tab::Compare;
    note(&mut a, &format!("MLA disable on (m, run 1): naive attention in every phase, served around the MLA backend, as VLLM_MLA_DISABLE=1 does. The decode logits are clean again ({clean}); the Compare pane puts them against run 0's NaN. The bug lives in the MLA backend, not in the model."));
    press(&mut a, "m");
    press(&mut a, "d");
    let heads = a.mirror.layout().unwrap().num_heads;
    let run = a.mirror.current().unwrap();
    let whole = a
        .mirror
        .aux(mladb::tui::host::AuxKind::WholePrefill)
        .unwrap();
    let tolerances = mladb::debug::tolerance::Tolerances::Table(run.flags.dtype);
    let list = mladb::debug::compare::prefill_vs_decode(run, whole, heads, &tolerances);
    let first = mladb::debug::compare::first_divergence(&list)
        .unwrap()
        .clone();
    assert!(
        first.name.ends_with("self_attn.attn_output"),
        "{}",
        first.name
    );
    assert_eq!(first.phase, dec);
    select(&mut a, first.phase, &first.name);
    a.tab = Tab::Compare;
    note(&mut a, &format!("MLA disable off again (run 2: the garbage is back), then d: the same tokens prefilled at once, as one whole-sequence prefill. Each decode op is compared with its token's row there: everything agrees up to the attention, and the first op that differs is {} {}, the attention's output. The op just before it, self_attn.attn_latent, is the absorbed decode kernel, which the naive prefill has no counterpart of.", first.phase, first.name));
    select(&mut a, dec, "model.layers.0.self_attn.attn_latent");
    a.tab = Tab::Buffers;
    let e = selected(&a);
    let (wrote, handed) = (e.kernel_wrote.unwrap().id.0, e.output.id.0);
    assert_ne!(wrote, handed);
    note(&mut a, &format!("The Buffers pane of that op: its kernel wrote buffer #{wrote}, but the op handed on buffer #{handed}, which no kernel wrote: all {} elements are still the poison the debugger fills buffers with.", e.stats.count));
    let run = a.mirror.current().unwrap();
    let reader = run
        .events
        .iter()
        .find(|r| r.phase == dec && r.inputs.iter().any(|b| b.id.0 == handed))
        .unwrap()
        .clone();
    assert!(!run
        .events
        .iter()
        .any(|r| r.phase == dec && r.inputs.iter().any(|b| b.id.0 == wrote)));
    select(&mut a, dec, &reader.name);
    note(&mut a, &format!("{}, the next op of the chain, reads buffer #{handed} (the poison) and nothing reads #{wrote}, where the attention output really is: the kernel writes one buffer and the wrapper hands on another. That is the vLLM garbage-output bug; the fix is to hand the kernel the output buffer the wrapper returns.", reader.name));
    save(&mut a, "output-buffer-disconnect.ron");
}

/// Weight absorption, walked through the Learn view on the recorded numbers.
fn record_weight_absorption() {
    use mladb::engine::trace::Phase;
    let (pre, dec) = (Phase::Prefill, Phase::Decode(0));
    let mut a = debugger(Setup::tiny(""));
    let l = a.mirror.layout().unwrap().clone();
    let (h, r, nope, rope, v) = (
        l.num_heads,
        l.kv_lora_rank,
        l.qk_nope_head_dim,
        l.qk_rope_head_dim,
        l.v_head_dim,
    );
    note(&mut a, &format!("MLA weight absorption on glm5-tiny's layer 0: {h} heads, a latent (kv_lora_rank) of {r}, qk_nope {nope}, qk_rope {rope}, v_head_dim {v}. Default paths, as production runs them: naive prefill, absorbed decode. The run goes to its end, then d computes the same tokens on the other path; the next stops walk the Learn view (l)."));
    press(&mut a, "c");
    press(&mut a, "d");
    assert!(a.mirror.aux(mladb::tui::host::AuxKind::OtherPath).is_some());
    press(&mut a, "l");
    let name = |op: &str| format!("model.layers.0.self_attn.{op}");
    select(&mut a, pre, &name("kv_a_proj_with_mqa"));
    note(&mut a, &format!("The latent: kv_a_proj_with_mqa squeezes each token's hidden state into {r} latent values plus {rope} RoPE values. That is all MLA caches per token and layer, {} values shared by the {h} heads, where plain multi-head attention would cache {h}x({}+{v}) = {} for K and V.", r + rope, nope + rope, h * (nope + rope + v)));
    select(&mut a, pre, &name("kv_b_proj"));
    note(&mut a, &format!("The naive path (prefill): kv_b_proj decompresses the latent of every cached token into per-head K_nope ({nope}) and V ({v}), then attention runs as usual. Cheap when many queries share the work; in decode it means re-expanding the whole cache for one query."));
    select(&mut a, dec, &name("q_absorbed"));
    note(&mut a, &format!("The absorbed path (decode): W_UK, the K half of kv_b_proj, is folded into the query instead: q_absorbed = q_nope x W_UK, {h} heads x {r}. A score q.k equals q_absorbed.latent, so no K is ever built. The Learn view's live values compute one score both ways."));
    select(&mut a, dec, &name("attn_latent"));
    note(&mut a, &format!("attn_latent: attention over the {}-wide latent cache directly, the same cache rows for every head. The cost table in the Learn view shows why this pays at long contexts: the naive path reads the expanded K and V, the absorbed one only the latent.", r + rope));
    select(&mut a, dec, &name("attn_output"));
    note(&mut a, "attn_output: W_UV, the V half of kv_b_proj, applied after attention, to the latent output of each head. The Learn view puts this output beside the same op of the naive-path run (d computed it): both paths give the same numbers within float rounding, which is the whole point of absorption.");
    a.overlay = mladb::tui::app::Overlay::None;
    a.tab = Tab::Compare;
    note(&mut a, "The Compare pane says the same op by op: absorbed vs naive over every op of the run, each within its tolerance. Flip a path live (:set decode-path naive in mladb tui) and the run re-executes from the first attention op it changes.");
    save(&mut a, "weight-absorption.ron");
}

/// A Q4_K kv_b_proj: W_UK / W_UV through the identity matrix, then force-dequantized.
fn record_force_dequant() {
    use mladb::engine::trace::Phase;
    let mut a = debugger(Setup {
        layout: "glm5-tiny-wide",
        quant: Some("q4_k"),
        flags: "decode-path=absorbed",
        ..Setup::tiny("")
    });
    note(&mut a, "glm5-tiny-wide (layer 0) with its projections quantized to Q4_K (--quant q4_k), as a GGUF checkpoint would store them. The absorbed path needs W_UK and W_UV as plain matrices; without force-dequant they come from running the quantized kv_b_proj on the identity matrix.");
    command(&mut a, "break op *kv_b_identity");
    press(&mut a, "c");
    command(&mut a, "delete all");
    let e = selected(&a);
    assert!(e.name.ends_with("kv_b_identity"), "{}", e.name);
    note(&mut a, &format!("kv_b_identity: the quantized matmul applied to I ({:?}), which yields kv_b_proj's dequantized values through the very kernel production runs, Q4_K block scales included. Absorption then splits them into W_UK and W_UV.", e.shape));
    press(&mut a, "c");
    let before = outcome(&a);
    command(&mut a, "set force-dequant on");
    let after = outcome(&a);
    let cur = a.mirror.current().unwrap();
    let at = cur
        .events
        .iter()
        .find(|e| e.name.ends_with("self_attn.kv_b_dequant"))
        .unwrap();
    let (ph, name) = (at.phase, at.name.clone());
    select(&mut a, ph, &name);
    a.tab = Tab::Tensor;
    note(&mut a, "force-dequant on (f, here :set force-dequant on; run 1): kv_b_proj is dequantized once up front instead (op self_attn.kv_b_dequant), and the run re-executes from the first op that uses it.");
    select(&mut a, Phase::Decode(0), "*self_attn.attn_output");
    a.tab = Tab::Compare;
    note(&mut a, &format!("The two derivations side by side: run 0 {before}; run 1 {after}. The Compare pane shows how far the two routes to W_UV are apart at the absorbed attention output: the rounding of one dequantization against another, not a bug."));
    save(&mut a, "force-dequant.ron");
}

/// A DSA top-k choice on an exact bf16 tie, broken the other way by the comparison run.
fn record_dsa_tie() {
    use mladb::engine::trace::Phase;
    let dec = Phase::Decode(0);
    let mut a = debugger(Setup {
        seed: 10,
        flags: "dtype=bf16",
        prompt: mladb::setup::default_prompt(2048, 11),
        prefill: 10,
        decode: 0,
        layers: 0..2,
        ..Setup::tiny("")
    });
    note(&mut a, "DeepSeek sparse attention (DSA) chooses which keys each query attends to: an indexer scores every cached key and keeps the top 8. glm5-tiny, seed 10, layers 0 and 1, bf16 storage: 10 tokens prefilled, the 11th decoded, so at position 10 the indexer keeps 8 of 11 keys.");
    press(&mut a, "c");
    let scores_name = "model.layers.1.self_attn.indexer.scores";
    let topk_name = "model.layers.1.self_attn.indexer.topk";
    let run = a.mirror.current().unwrap();
    let scores = run.output(dec, scores_name).unwrap().data().to_vec();
    let kept: Vec<usize> = run
        .output(dec, topk_name)
        .unwrap()
        .data()
        .iter()
        .map(|&k| k as usize)
        .collect();
    let left: Vec<usize> = (0..scores.len()).filter(|k| !kept.contains(k)).collect();
    // The lowest kept score equals the highest left out: a tie at the boundary.
    let low = kept
        .iter()
        .map(|&k| scores[k])
        .fold(f32::INFINITY, f32::min);
    let high = left
        .iter()
        .map(|&k| scores[k])
        .fold(f32::NEG_INFINITY, f32::max);
    assert_eq!(low, high, "scores {scores:?}, kept {kept:?}");
    let tied: Vec<usize> = (0..scores.len()).filter(|&k| scores[k] == low).collect();
    select(&mut a, dec, scores_name);
    note(&mut a, &format!("Layer 1's indexer scores for the decoded token (one per cached key). Keys {tied:?} score exactly the same, {low}, in bf16, and that value sits right at the top-k boundary: one of them must be left out, and nothing in the scores says which."));
    select(&mut a, dec, topk_name);
    note(&mut a, &format!("The top-k keeps {kept:?} and leaves out {left:?}: the tie was broken by index. Another run whose scores differ by one rounding step may break it the other way, and attention then reads a different set of keys."));
    press(&mut a, "d");
    let flip = a
        .log
        .iter()
        .find(|l| l.contains("selection flip within noise") && l.contains(topk_name))
        .unwrap_or_else(|| panic!("{:#?}", a.log))
        .clone();
    let other = a.mirror.aux(mladb::tui::host::AuxKind::OtherPath).unwrap();
    assert!(!other.forced.is_empty());
    let heads = a.mirror.layout().unwrap().num_heads;
    let run = a.mirror.current().unwrap();
    let tolerances = mladb::debug::tolerance::Tolerances::Table(run.flags.dtype);
    let list = mladb::debug::compare::compare_runs(run, other, heads, &tolerances);
    assert!(mladb::debug::compare::first_divergence(&list).is_none());
    a.tab = Tab::Compare;
    let detail = flip.split_once(": ").map_or(flip.as_str(), |(_, d)| d);
    note(&mut a, &format!("d ran the same tokens on the other MLA path. Its layer 1 input differs from this run's by bf16 rounding, and its indexer broke the tie the other way. The log said: {detail}. A flip on a tie is not a bug, so the comparison run was made again with this run's choice there."));
    select(&mut a, dec, "logits");
    note(&mut a, "With the choice forced, every op agrees with the other path within its tolerance: no op of the tree is marked as diverging, down to the logits. Without the forcing, each op after the top-k would differ. mladb check does the same and prints a selection-flip note, not a finding (try mladb check --layout glm5-tiny --seed 10 --dtype bf16 --layers 0..2 --prefill 10 --decode 1).");
    save(&mut a, "dsa-topk-tie.ron");
}

/// The example sessions, in a stable order.
fn example_sessions() -> Vec<std::path::PathBuf> {
    let mut found: Vec<_> = std::fs::read_dir(sessions_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "ron"))
        .collect();
    found.sort();
    found
}

#[test]
fn example_sessions_replay_and_verify() {
    let found = example_sessions();
    let names: Vec<String> = found
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for want in [
        "dsa-topk-tie.ron",
        "force-dequant.ron",
        "output-buffer-disconnect.ron",
        "weight-absorption.ron",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "sessions/ lacks {want}: {names:?}"
        );
    }
    for path in &found {
        let s = Session::load(path).unwrap();
        assert!(
            s.runs.len() >= 2 && s.annotations.len() >= 4,
            "{}",
            path.display()
        );
        // Small enough to read and to keep in the repository.
        let size = std::fs::metadata(path).unwrap().len();
        assert!(size < 600_000, "{}: {size} bytes", path.display());
        // Opens without a model, at its first note.
        let mut app = replay(path);
        screen(&mut app, 120, 34);
        assert_eq!(app.tour.at, Some(0), "{}", path.display());
        assert!(app.tour.open);
        assert!(
            app.log.iter().any(|l| l.starts_with("note:")),
            "{}",
            path.display()
        );
        let (rc, out, err) = mladb(&["replay", path.to_str().unwrap(), "--verify"]);
        assert_eq!(rc, 0, "{}: {out}{err}", path.display());
        assert!(out.contains("all match"), "{out}");
    }
}

/// Where a tour stands: the selected op and the pane shown are the note's.
fn assert_at_note(app: &mut App, i: usize, what: &str) {
    use mladb::session::recorded::Pane;
    use mladb::tui::app::Overlay;
    let note = app.tour.notes[i].clone();
    assert_eq!(app.tour.at, Some(i), "{what}");
    let about = note
        .about
        .as_ref()
        .expect("every shipped note names its op");
    let (_, e) = app
        .selected_op()
        .unwrap_or_else(|| panic!("{what}: nothing selected"));
    assert_eq!(
        (e.phase, e.name.as_str()),
        (about.phase, about.op.as_str()),
        "{what}: note {i}"
    );
    let learn = matches!(app.overlay, Overlay::Learn { .. });
    match note.pane.expect("every shipped note names its pane") {
        Pane::Learn => assert!(learn, "{what}: note {i} opens the Learn view"),
        pane => {
            assert!(!learn, "{what}: note {i} closes the Learn view");
            let tab = match pane {
                Pane::Tensor => Tab::Tensor,
                Pane::Buffers => Tab::Buffers,
                _ => Tab::Compare,
            };
            assert_eq!(app.tab, tab, "{what}: note {i}");
        }
    }
    // The notes pane shows the note's start and says which it is.
    let text = screen(app, 120, 34).join("\n");
    let start: String = note.text.chars().take(30).collect();
    let first_word = start.split(' ').next().unwrap();
    assert!(
        text.contains(&format!("note {} of {}", i + 1, app.tour.notes.len()))
            && text.contains(first_word),
        "{what}: note {i}\n{text}"
    );
}

#[test]
fn every_tour_stops_at_each_notes_op_and_pane() {
    for path in example_sessions() {
        let what = path.display().to_string();
        let mut app = replay(&path);
        let n = app.tour.notes.len();
        assert!(n >= 4, "{what}");
        assert_at_note(&mut app, 0, &what);
        for i in 1..n {
            press(&mut app, "}");
            assert_at_note(&mut app, i, &what);
        }
        // Past the last: it stays, and says so.
        press(&mut app, "}");
        assert_eq!(app.tour.at, Some(n - 1));
        assert!(app.notice.as_ref().unwrap().contains("the last note"));
        // Back, across runs too (the replay returns to the start and replays forward).
        for i in (0..n - 1).rev() {
            press(&mut app, "{");
            assert_at_note(&mut app, i, &what);
        }
        // Hidden and shown again.
        press(&mut app, "o");
        assert!(!app.tour.open);
        press(&mut app, "o");
        assert!(app.tour.open);
    }
}

#[test]
fn the_weight_absorption_tour_shows_the_side_by_side() {
    use mladb::tui::app::Overlay;
    let mut app = replay(&sessions_dir().join("weight-absorption.ron"));
    while !matches!(app.overlay, Overlay::Learn { .. }) {
        press(&mut app, "}");
    }
    let mut seen = String::new();
    for _ in 0..12 {
        seen.push_str(&screen(&mut app, 120, 40).join("\n"));
        press(&mut app, &"j".repeat(15));
    }
    let seen = seen.replace(['│', '\n'], " ");
    let seen = seen.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(seen.contains("The two paths' outputs"), "{seen}");
    assert!(!seen.contains("no comparison runs"), "{seen}");
    assert!(!seen.contains("finish the run"), "{seen}");
}

#[test]
fn a_tour_of_a_session_without_notes_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plain.ron");
    let (rc, _, err) = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--layers",
        "0..1",
        "--decode",
        "1",
        "--record",
        path.to_str().unwrap(),
    ]);
    assert_eq!(rc, 0, "{err}");
    let (rc, out, err) = mladb(&["replay", path.to_str().unwrap(), "--tour"]);
    assert_eq!(rc, 2, "{out}{err}");
    assert!(
        err.starts_with("error: ") && err.contains("no notes") && err.lines().count() == 1,
        "{err}"
    );
    let (rc, _, err) = mladb(&["replay", path.to_str().unwrap(), "--tour", "--verify"]);
    assert_eq!(rc, 2, "{err}");
    // In the debugger, the keys say it plainly.
    let mut app = replay(&path);
    press(&mut app, "}");
    assert!(
        app.notice.as_ref().unwrap().contains("no notes placed"),
        "{:?}",
        app.notice
    );
    assert_eq!(app.tour.at, None);
    // A file naming a pane that does not exist: one error line, exit 2.
    let mut s = Session::load(&path).unwrap();
    s.annotations.push(mladb::session::recorded::Annotation {
        run: 0,
        op: 3,
        text: "x".into(),
        about: None,
        pane: Some(mladb::session::recorded::Pane::Buffers),
    });
    let text = s
        .to_ron()
        .unwrap()
        .replace("Some(buffers)", "Some(histogram)");
    let bad = dir.path().join("bad.ron");
    std::fs::write(&bad, text).unwrap();
    let (rc, _, err) = mladb(&["replay", bad.to_str().unwrap(), "--tour"]);
    assert_eq!(rc, 2, "{err}");
    assert!(
        err.starts_with("error: ") && err.contains("histogram") && err.contains("pane"),
        "{err}"
    );
}

fn snapshot(name: &str, text: &str) {
    let mut settings = insta::Settings::clone_current();
    settings.add_filter(r"@0x[0-9a-f]{12}", "@[address    ]");
    settings.set_snapshot_path("snapshots");
    settings.bind(|| insta::assert_snapshot!(name, text));
}

fn full_screen(app: &mut App, w: u16, h: u16) -> String {
    let mut terminal = Terminal::new(TestBackend::new(w, h)).unwrap();
    terminal.draw(|f| ui::draw(f, app)).unwrap();
    terminal.backend().to_string()
}

#[test]
fn snapshot_notes_pane_80x24() {
    let mut app = replay(&sessions_dir().join("output-buffer-disconnect.ron"));
    let first = full_screen(&mut app, 80, 24);
    while app.tab != Tab::Buffers {
        press(&mut app, "}");
    }
    let buffers = full_screen(&mut app, 80, 24);
    snapshot(
        "notes_80x24",
        &format!("{first}\n--- the Buffers stop ---\n{buffers}"),
    );
}

#[test]
fn a_note_longer_than_its_pane_scrolls() {
    let mut app = replay(&sessions_dir().join("output-buffer-disconnect.ron"));
    // 60×20: the first note takes more lines than the pane's rows.
    let rows = |app: &mut App| full_screen(app, 60, 20);
    let text = rows(&mut app);
    assert!(text.contains("scroll (1/"), "{text}");
    press(&mut app, "J");
    let text = rows(&mut app);
    assert!(text.contains("scroll (2/"), "{text}");
    assert_eq!(app.tour.scroll, 1);
    press(&mut app, &"J".repeat(40));
    rows(&mut app);
    let most = app.tour.scroll;
    press(&mut app, "K");
    assert_eq!(
        app.tour.scroll,
        most - 1,
        "K scrolls back; the bottom was clamped"
    );
}

#[test]
fn snapshot_notes_pane_160x48() {
    let mut app = replay(&sessions_dir().join("output-buffer-disconnect.ron"));
    while app.tab != Tab::Buffers {
        press(&mut app, "}");
    }
    let buffers = full_screen(&mut app, 160, 48);
    let mut app = replay(&sessions_dir().join("weight-absorption.ron"));
    while !matches!(app.overlay, mladb::tui::app::Overlay::Learn { .. }) {
        press(&mut app, "}");
    }
    let learn = full_screen(&mut app, 160, 48);
    snapshot(
        "notes_160x48",
        &format!("{buffers}\n--- weight absorption, the first Learn stop ---\n{learn}"),
    );
}

#[test]
fn the_buffers_stop_shows_the_whole_chain_at_80x24_and_160x48() {
    for (w, h) in [(80, 24), (160, 48)] {
        let mut app = replay(&sessions_dir().join("output-buffer-disconnect.ron"));
        while app.tab != Tab::Buffers {
            press(&mut app, "}");
        }
        let text = full_screen(&mut app, w, h);
        for want in [
            "attention chain, layer 0, decode.0",
            "kernel (self_attn.attn_latent) wrote buf 588",
            "→ the wrapper returned buf 587",
            "→ self_attn.attn_output read buf 587",
            "DISCONNECTED ✗",
        ] {
            assert!(text.contains(want), "{w}×{h}: no {want:?} in\n{text}");
        }
    }
}

#[test]
fn a_live_load_keeps_the_notes_places_through_a_save() {
    let file = sessions_dir().join("output-buffer-disconnect.ron");
    let original = Session::load(&file).unwrap();
    assert!(original.annotations.iter().all(|a| a.about.is_some()));
    let dir = tempfile::tempdir().unwrap();
    let again = dir.path().join("again.ron");
    let mut a = common::tiny_app("");
    command(&mut a, &format!("load {}", file.display()));
    command(&mut a, &format!("save {}", again.display()));
    let saved = Session::load(&again).unwrap();
    let places = |s: &Session| {
        s.annotations
            .iter()
            .map(|a| (a.text.clone(), a.about.clone(), a.pane))
            .collect::<Vec<_>>()
    };
    assert_eq!(places(&saved), places(&original));
    assert_eq!(
        saved.notes, original.notes,
        "placed notes are not plain notes"
    );
    // The saved file tours as the original does: the Buffers note moves to its op.
    let mut r = replay(&again);
    while r.tab != Tab::Buffers {
        press(&mut r, "}");
    }
    let (_, e) = r.selected_op().unwrap();
    assert!(e.name.ends_with("self_attn.attn_latent"), "{}", e.name);
}

#[test]
fn quitting_says_where_the_session_was_saved_or_why_not() {
    let wait = std::time::Duration::from_secs(30);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state").join("autosave.ron");
    let mut a = common::tiny_app("");
    press(&mut a, "n");
    a.autosave = Some(Autosave {
        path: path.clone(),
        every: std::time::Duration::from_secs(300),
        last: std::time::Instant::now(),
    });
    a.save_on_quit();
    let p = path.display();
    assert_eq!(
        a.quit_line(wait).unwrap(),
        format!("session saved to {p} (mladb replay {p})")
    );
    assert_eq!(Session::load(&path).unwrap().runs.len(), 1);
    // A place it cannot write to: said plainly.
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    a.autosave.as_mut().unwrap().path = file.join("autosave.ron");
    a.save_on_quit();
    let line = a.quit_line(wait).unwrap();
    assert!(
        line.starts_with("session not saved: autosave failed: ") && line.contains("a-file"),
        "{line}"
    );
    // Autosave off in a live session: said too.
    let mut b = common::tiny_app("");
    b.autosave_off = Some("autosave is off (MLADB_AUTOSAVE=off)".into());
    b.save_on_quit();
    assert_eq!(
        b.quit_line(wait).unwrap(),
        "session not saved: autosave is off (MLADB_AUTOSAVE=off) (:save FILE saves one)"
    );
    // A replay saves nothing unasked and has nothing to say.
    let mut r = replay(&sessions_dir().join("output-buffer-disconnect.ron"));
    r.save_on_quit();
    assert_eq!(r.quit_line(wait), None);
}

/// `replay --dump` of a session with companion tensors writes the full outputs (a tensor at a
/// time), the same values the companion holds, under the same names, with the run's metadata.
#[test]
fn replay_dumps_full_outputs_from_the_companion() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.ron");
    let (rc, _, err) = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--tokens",
        "1,2,3",
        "--decode",
        "1",
        "--dtype",
        "bf16",
        "--record",
        path.to_str().unwrap(),
        "--record-tensors",
    ]);
    assert_eq!(rc, 0, "{err}");
    let dump = dir.path().join("d.safetensors");
    let (rc, _, err) = mladb(&[
        "replay",
        path.to_str().unwrap(),
        "--dump",
        dump.to_str().unwrap(),
    ]);
    assert_eq!(rc, 0, "{err}");
    let companion = std::fs::read(dir.path().join("s.tensors.safetensors")).unwrap();
    let companion = safetensors::SafeTensors::deserialize(&companion).unwrap();
    let bytes = std::fs::read(&dump).unwrap();
    let dumped = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(dumped.len(), companion.len());
    for (name, t) in companion.tensors() {
        let d = dumped.tensor(&name).unwrap();
        assert_eq!(d.data(), t.data(), "{name}");
    }
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header.metadata().clone().unwrap();
    assert_eq!(meta["tokens"], "[1,2,3]");
    assert_eq!(meta["dtype"], "bf16", "a bf16 run's dump says so");
}

/// Verified on another device, a value agrees within the dtype's tolerance of the op's largest
/// value; a choice (the DSA top-k's key positions) agrees exactly or not at all. A neighbouring
/// key used to pass as agreement: 1 is within 3e-2 of a position past 33.
#[test]
fn verify_across_devices_holds_choices_exactly() {
    use mladb::engine::trace::OpKind;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.ron");
    let tokens: Vec<String> = (0..72).map(|i| (1 + i * 7 % 97).to_string()).collect();
    let (rc, out, err) = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--dtype",
        "bf16",
        "--tokens",
        &tokens.join(","),
        "--decode",
        "0",
        "--record",
        path.to_str().unwrap(),
    ]);
    assert_eq!(rc, 0, "{out}{err}");
    // As if recorded on a GPU's reference kernels: the CPU verifies it within bf16's tolerance.
    let mut s = Session::load(&path).unwrap();
    s.runs[0].flags.device = mladb::debug::flags::DeviceFlag::Cuda;
    s.runs[0].flags.kernels.kernel = mladb::ops::AttnKernel::Reference;
    let edited = dir.path().join("edited.ron");
    s.save(&edited).unwrap();
    let (rc, out, err) = mladb(&["replay", edited.to_str().unwrap(), "--verify"]);
    assert_eq!(rc, 0, "{out}{err}");
    assert!(out.contains("match within 3e-2"), "{out}");

    // One sampled key position of the top-k moved to its neighbour.
    let (i, k) = s.runs[0]
        .ops
        .iter()
        .enumerate()
        .filter(|(_, op)| op.event.kind == OpKind::IndexTopK)
        .find_map(|(i, op)| Some((i, op.sample.iter().position(|&p| p >= 40.0)?)))
        .expect("a top-k sample holding a position past 40");
    s.runs[0].ops[i].sample[k] -= 1.0;
    s.save(&edited).unwrap();
    let (rc, out, err) = mladb(&["replay", edited.to_str().unwrap(), "--verify"]);
    assert_eq!(rc, 1, "{out}{err}");
    assert!(
        out.contains(&format!("run 0, op #{i}")) && out.contains("choice ["),
        "{out}"
    );
}
