//! Every pane and view of the debugger on every op: each shipped session replayed as `mladb
//! replay` does (sampled values, comparison runs recorded or not), and live tiny runs with decode
//! steps, comparisons and a flag change. For each op: the Tensor tab (for every head where the op
//! has heads), the Buffers and Compare tabs, the Learn view, the help and the fault menu, rendered
//! into a TestBackend; none may panic.

mod common;

use mladb::debug::compare::heads_of;
use mladb::debug::sample::NEEDS_TENSORS;
use mladb::engine::trace::Phase;
use mladb::tui::app::{App, Node, Overlay, Tab};
use mladb::tui::keys::{Action, Keymap};
use mladb::tui::replay::ReplayDriver;
use mladb::tui::theme::Theme;
use mladb::tui::ui;
use ratatui::backend::TestBackend;
use ratatui::Terminal;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// Draws the screen; a panic is reported with what was on it.
fn draw(app: &mut App, terminal: &mut Terminal<TestBackend>, what: &dyn Fn() -> String) {
    let drawn = catch_unwind(AssertUnwindSafe(|| {
        terminal.draw(|f| ui::draw(f, app)).unwrap();
    }));
    if drawn.is_err() {
        panic!("drawing panicked: {}", what());
    }
}

/// Selects every op of the current run in turn and draws every tab and view of it; returns how
/// many ops it drew.
fn draw_every_op(app: &mut App, context: &str) -> usize {
    let mut terminal = Terminal::new(TestBackend::new(100, 30)).unwrap();
    let run = app.mirror.current_number();
    let ops = app.mirror.current().map_or(0, |r| r.len());
    app.follow = false;
    for i in 0..ops {
        app.select(Node::Op(i));
        let name = app
            .selected_op()
            .map(|(_, e)| format!("{} {}", e.phase, e.name));
        let has_heads = app.selected_op().is_some_and(|(_, e)| {
            let heads = app.mirror.layout().map_or(1, |l| l.num_heads);
            heads_of(e, heads).is_some()
        });
        let views = Tab::ALL
            .map(|t| (Some(t), Overlay::None))
            .into_iter()
            .chain([
                (None, Overlay::Learn { scroll: 0 }),
                (None, Overlay::Help),
                (
                    None,
                    Overlay::Inject {
                        selected: 0,
                        scope: mladb::engine::faults::Scope::All,
                    },
                ),
            ]);
        for (tab, overlay) in views {
            if let Some(tab) = tab {
                app.tab = tab;
            }
            app.overlay = overlay.clone();
            // Every head of the per-head figures and heat maps, on the Tensor tab.
            let heads = if has_heads && app.tab == Tab::Tensor && overlay == Overlay::None {
                app.mirror.layout().map_or(1, |l| l.num_heads)
            } else {
                1
            };
            for head in 0..heads {
                app.head = head;
                draw(app, &mut terminal, &|| {
                    format!(
                        "{context}, run {run}, op #{i} {name:?}, {tab:?} {overlay:?}, head {head}"
                    )
                });
            }
        }
        app.overlay = Overlay::None;
    }
    // The Learn view scrolled past its end.
    app.overlay = Overlay::Learn { scroll: u16::MAX };
    draw(app, &mut terminal, &|| {
        format!("{context}, Learn scrolled to the end")
    });
    app.overlay = Overlay::None;
    // A phase row, and nothing selected.
    for node in [Node::Phase(Phase::Prefill), Node::Op(usize::MAX)] {
        app.select(node);
        for tab in Tab::ALL {
            app.tab = tab;
            draw(app, &mut terminal, &|| {
                format!("{context}, {node:?}, {tab:?}")
            });
        }
    }
    ops
}

/// Where each run of a replayed timeline ends: (run number, ops, finished), found by stepping
/// through it all.
fn run_ends(app: &mut App) -> Vec<(usize, usize, bool)> {
    let state = |app: &App| {
        let m = &app.mirror;
        let r = m.current().expect("a replay shows a run");
        (m.current_number(), r.len(), r.finished())
    };
    let mut ends: Vec<(usize, usize, bool)> = Vec::new();
    let mut unchanged = 0;
    for _ in 0..100_000 {
        let before = state(app);
        app.act(Action::Step);
        let after = state(app);
        if after.0 != before.0 {
            ends.push(before);
        }
        unchanged = if after == before { unchanged + 1 } else { 0 };
        if unchanged == 2 {
            ends.push(after);
            return ends;
        }
    }
    panic!("stepping never reached the end of the recording");
}

fn shipped_sessions() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("sessions");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "ron"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 3,
        "the shipped sessions are in {}",
        dir.display()
    );
    files
}

/// Every op of every run of every shipped session, as `mladb replay FILE` shows it.
#[test]
fn every_view_of_every_op_of_every_shipped_session() {
    for path in shipped_sessions() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let open = || {
            let driver = ReplayDriver::open(&path).unwrap();
            App::new(Box::new(driver), Keymap::default(), Theme::plain())
        };
        // At the saved cursor, as the replay opens.
        let mut app = open();
        let at_cursor = draw_every_op(&mut app, &format!("{name} at its cursor"));
        assert!(at_cursor > 0, "{name}");
        // Then every run at its end, stepped to from the start.
        app.act(Action::Restart);
        let ends = run_ends(&mut app);
        app.act(Action::Restart);
        let mut drawn = 0;
        for &(run, ops, finished) in &ends {
            let reached = |app: &App| {
                let m = &app.mirror;
                m.current_number() == run
                    && m.current()
                        .is_some_and(|r| r.len() == ops && r.finished() == finished)
            };
            let mut steps = 0;
            while !reached(&app) {
                app.act(Action::Step);
                steps += 1;
                assert!(steps < 100_000, "{name}: run {run} never reached");
            }
            // With the comparisons asked for, as `d` does.
            app.act(Action::Compare);
            drawn += draw_every_op(&mut app, &format!("{name}, end of run {run}"));
        }
        eprintln!(
            "{name}: {} run(s), {drawn} ops drawn in every view",
            ends.len()
        );
    }
}

/// Live runs on both tiny layouts with decode steps: finished, compared (`d`), and again after an
/// MLA toggle (so "vs run 0" has a run to compare with) and a bisect.
#[test]
fn every_view_of_every_op_of_live_tiny_runs() {
    for layout in ["glm5-tiny", "deepseek-v3-tiny"] {
        let mut app = common::live_app(layout, "", 10, 7, 2);
        draw_every_op(&mut app, &format!("{layout}, first op"));
        app.act(Action::Continue);
        assert!(app.mirror.current().unwrap().finished(), "{layout}");
        app.act(Action::Compare);
        let ops = draw_every_op(&mut app, &format!("{layout}, finished and compared"));
        assert!(ops > 100, "{layout}: {ops} ops");
        app.act(Action::ToggleMla);
        app.execute("bisect");
        app.act(Action::Compare);
        draw_every_op(&mut app, &format!("{layout}, after MLA disable"));
        assert_eq!(app.mirror.comparison, Some(0), "{layout}");
    }
}

/// Regression: `mladb replay sessions/output-buffer-disconnect.ron`, then `d`, panicked in the
/// prefill-vs-decode comparison (a token's row cut from a 32-value sample). The Compare pane now
/// compares the samples where both sides hold the same elements and says what needs the tensors;
/// a comparison that compared nothing never reads as agreement.
#[test]
fn compare_pane_of_a_sampled_replay_says_what_it_compared() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("sessions/output-buffer-disconnect.ron");
    let driver = ReplayDriver::open(&path).unwrap();
    let mut app = App::new(Box::new(driver), Keymap::default(), Theme::plain());
    // The replay opens at its first note; the last is at the end of run 2, after `d`.
    for _ in 0..app.tour.notes.len() {
        app.act(Action::NextNote);
    }
    assert_eq!(app.mirror.current_number(), 2);
    app.act(Action::Compare);
    let run = app.mirror.current().unwrap();
    let i = run
        .events
        .iter()
        .position(|e| e.name.ends_with("0.self_attn.attn_probs") && e.phase == Phase::Decode(0))
        .unwrap();
    app.follow = false;
    app.select(Node::Op(i));
    app.tab = Tab::Compare;
    let (w, h) = (220, 40);
    let mut terminal = Terminal::new(TestBackend::new(w, h)).unwrap();
    terminal.draw(|f| ui::draw(f, &mut app)).unwrap();
    let b = terminal.backend().buffer().clone();
    let screen: String = (0..h)
        .map(|y| (0..w).map(|x| b[(x, y)].symbol()).collect::<String>() + "\n")
        .collect();
    for needle in [
        "replay of sampled values: figures compare the 32 values recorded of each side",
        // Run 2 against run 1: samples of the same elements, compared.
        "vs run 1 (mla-disable on → off)",
        "rel L2 1.86e-7  tolerance 1.00e-4",
        "max |Δ| 1.49e-7 at [1, 0, 9]",
        // A token's row of the whole prefill is not in its sample.
        "decode vs the same token in a whole prefill",
        NEEDS_TENSORS,
        "prefill vs decode: no op could be compared",
    ] {
        assert!(screen.contains(needle), "'{needle}' missing from\n{screen}");
    }
    assert!(!screen.contains("prefill vs decode: all"), "{screen}");
}

/// Regression: a damaged session must draw or be refused, never panic. The companion tensors
/// need only hold as many values as each op (their own shape was used, so a flat one panicked
/// in the heat map and per-head figures), and a shape whose size overflows a usize is refused.
#[test]
fn damaged_sessions_draw_or_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.ron");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(["run", "--layout", "glm5-tiny", "--tokens", "1,2,3,4,5"])
        .args(["--decode", "1", "--record", path.to_str().unwrap()])
        .arg("--record-tensors")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Every companion tensor stored flat.
    let companion = dir.path().join("t.tensors.safetensors");
    let bytes = std::fs::read(&companion).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let flat: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| (name, vec![v.shape().iter().product()], v.data().to_vec()))
        .collect();
    let views = flat.iter().map(|(name, shape, data)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data);
        (name.clone(), view.unwrap())
    });
    std::fs::write(&companion, safetensors::serialize(views, None).unwrap()).unwrap();
    // The rewritten companion no longer matches the hash the session holds; without one (as
    // saved before the hash existed) the pair is taken as it is.
    let text = std::fs::read_to_string(&path).unwrap();
    let text: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("tensors_hash:"))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&path, text).unwrap();
    let driver = ReplayDriver::open(&path).unwrap();
    assert!(driver.host().full());
    let mut app = App::new(Box::new(driver), Keymap::default(), Theme::plain());
    app.act(Action::Continue);
    let drawn = draw_every_op(&mut app, "flat companion tensors");
    assert!(drawn > 100);

    // An output too large to count.
    let text = std::fs::read_to_string(&path).unwrap();
    let huge = text.replacen("shape: [", "shape: [4294967296, 4294967296, ", 1);
    let err = mladb::session::Session::parse(&huge).unwrap_err();
    assert!(err.contains("runs[0].ops[0].event.shape"), "{err}");
}
