//! The TUI at full size: layers collapsed by default with a one-line summary each, `/` search
//! over op names, `:goto layer N`, and the progress gauge's estimate of the time left. Driven
//! inline like tests/tui.rs (no sleeps: the gauge's clock is a fake one moved by hand).

mod common;

use common::{command, screen_text};
use mladb::engine::trace::Phase;
use mladb::engine::OpKind;
use mladb::tui::app::{App, Node, Overlay};
use mladb::tui::driver::{Driver, FeedDriver, InlineDriver};
use mladb::tui::host::{Command, Update};
use mladb::tui::keys::Keymap;
use mladb::tui::theme::Theme;
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn press(app: &mut App, keys: &str) {
    for c in keys.chars() {
        app.on_key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE));
    }
}

fn key(app: &mut App, code: KeyCode) {
    app.on_key(KeyEvent::new(code, KeyModifiers::NONE));
}

fn search(app: &mut App, text: &str) {
    press(app, "/");
    press(app, text);
    key(app, KeyCode::Enter);
}

fn selected_name(app: &App) -> (Phase, String) {
    let (_, e) = app.selected_op().expect("an op is selected");
    (e.phase, e.name.clone())
}

/// The layers whose ops the tree shows.
fn open_layers(app: &App) -> Vec<(Phase, usize)> {
    let run = app.mirror.current().unwrap();
    let mut open: Vec<(Phase, usize)> = app
        .rows()
        .iter()
        .filter_map(|r| match r.node {
            Node::Op(i) => run.events[i].layer.map(|l| (run.events[i].phase, l)),
            _ => None,
        })
        .collect();
    open.dedup();
    open
}

/// Every (phase, layer) of the current run, in order.
fn layers_of_run(app: &App) -> Vec<(Phase, usize)> {
    let mut all: Vec<(Phase, usize)> = app
        .mirror
        .current()
        .unwrap()
        .events
        .iter()
        .filter_map(|e| e.layer.map(|l| (e.phase, l)))
        .collect();
    all.dedup();
    all
}

/// The status line: the last line of the screen.
fn status(app: &mut App, w: u16, h: u16) -> String {
    screen_text(app, w, h).lines().last().unwrap().to_string()
}

#[test]
fn layers_start_collapsed_and_only_the_selections_layer_opens() {
    let mut app = common::tiny_app("");
    press(&mut app, "c");
    // At the end the position is the logits, in no layer: every layer row is closed.
    let layer_rows = app
        .rows()
        .iter()
        .filter(|r| matches!(r.node, Node::Layer(..)))
        .count();
    assert_eq!(layer_rows, layers_of_run(&app).len());
    assert_eq!(layer_rows, 6 * 4, "6 phases of 4 layers, a row each");
    assert!(open_layers(&app).is_empty(), "{:?}", open_layers(&app));
    assert!(!app.is_open(Node::Layer(Phase::Decode(4), 3)));

    // Stepping into the run opens the position's layer alone, and the next layer closes it.
    let mut app = common::tiny_app("");
    command(&mut app, "step 40");
    let (phase, layer) = {
        let e = app.mirror.position().unwrap();
        (e.phase, e.layer.expect("op 40 is inside a layer"))
    };
    assert_eq!(open_layers(&app), vec![(phase, layer)]);
    press(&mut app, "n");
    let next = app.mirror.position().unwrap().layer.unwrap();
    assert_eq!(next, layer + 1);
    assert_eq!(open_layers(&app), vec![(phase, next)]);
    assert!(!app.is_open(Node::Layer(phase, layer)));
    // The ops of the open layer are all there, each once.
    let shown = app
        .rows()
        .iter()
        .filter(|r| matches!(r.node, Node::Op(i) if app.mirror.current().unwrap().events[i].layer == Some(next)))
        .count();
    assert_eq!(
        shown,
        app.mirror.current().unwrap().len() - {
            let run = app.mirror.current().unwrap();
            run.events
                .iter()
                .position(|e| e.layer == Some(next))
                .unwrap()
        }
    );
}

#[test]
fn the_tree_never_leaves_blank_rows_when_layers_close() {
    let mut app = common::tiny_app("");
    // Deep in layer 0 with its ops open, the tree scrolls down to the position.
    command(&mut app, "step 30");
    screen_text(&mut app, 100, 30);
    assert!(app.scroll > 0);
    // The next layer closes layer 0: the few rows left are all shown, from the top.
    press(&mut app, "n");
    let screen = screen_text(&mut app, 100, 30);
    assert_eq!(
        app.rows().len(),
        5,
        "prefill, embedding, layer 0, layer 1, its first op"
    );
    assert_eq!(app.scroll, 0);
    let tree: Vec<&str> = screen.lines().skip(2).take(5).collect();
    assert!(tree[0].contains("▾ prefill (9 tokens)"), "{screen}");
    assert!(tree[4].contains("▶ · input_layernorm"), "{screen}");
}

#[test]
fn enter_toggles_a_layer_and_what_the_user_opened_stays_open() {
    let mut app = common::tiny_app("");
    command(&mut app, "step 40");
    let e = app.mirror.position().unwrap();
    let here = Node::Layer(e.phase, e.layer.unwrap());
    // Up from the layer's first op is its row: Enter closes the layer the step opened.
    let first = app.rows().iter().position(|r| r.node == here).unwrap();
    app.selected = Some(here);
    key(&mut app, KeyCode::Enter);
    assert!(!app.is_open(here));
    let rows = app.rows().len();
    assert!(app.rows().iter().all(|r| r.depth < 2), "no layer open");
    key(&mut app, KeyCode::Enter);
    assert!(app.is_open(here));
    assert!(app.rows().len() > rows);
    assert_eq!(app.rows()[first].node, here);
    // Opened by hand, it stays open when the execution moves on to the next layer.
    press(&mut app, "n");
    let (p, l) = match here {
        Node::Layer(p, l) => (p, l),
        _ => unreachable!(),
    };
    assert_eq!(open_layers(&app), vec![(p, l), (p, l + 1)]);
    press(&mut app, "n");
    assert_eq!(open_layers(&app), vec![(p, l), (p, l + 2)]);
}

#[test]
fn search_moves_to_the_next_match_wraps_and_repeats() {
    let mut app = common::tiny_app("");
    press(&mut app, "c");
    let run = app.mirror.current().unwrap();
    let matches: Vec<usize> = (0..run.len())
        .filter(|&i| run.events[i].name.contains("attn_probs"))
        .collect();
    assert_eq!(matches.len(), 24, "one per layer and phase");
    // From the logits of the last step, the next match wraps to the first.
    search(&mut app, "attn_probs");
    assert_eq!(app.selected, Some(Node::Op(matches[0])));
    assert_eq!(
        selected_name(&app),
        (
            Phase::Prefill,
            "model.layers.0.self_attn.attn_probs".to_string()
        )
    );
    assert_eq!(
        app.notice.as_deref(),
        Some("/attn_probs: match 1 of 24, wrapped")
    );
    assert!(status(&mut app, 80, 24).contains("/attn_probs: match 1 of 24, wrapped"));
    // Its phase and layer open; the other layers stay closed.
    assert_eq!(open_layers(&app), vec![(Phase::Prefill, 0)]);
    assert!(!app.follow);
    // N: the next one, in the next layer; P: back.
    press(&mut app, "N");
    assert_eq!(app.selected, Some(Node::Op(matches[1])));
    assert_eq!(open_layers(&app), vec![(Phase::Prefill, 1)]);
    assert_eq!(app.notice.as_deref(), Some("/attn_probs: match 2 of 24"));
    press(&mut app, "P");
    assert_eq!(app.selected, Some(Node::Op(matches[0])));
    // Back from the first wraps to the last.
    press(&mut app, "P");
    assert_eq!(app.selected, Some(Node::Op(matches[23])));
    assert_eq!(
        selected_name(&app),
        (
            Phase::Decode(4),
            "model.layers.3.self_attn.attn_probs".to_string()
        )
    );
    assert!(app
        .notice
        .as_deref()
        .unwrap()
        .ends_with("match 24 of 24, wrapped"));
    // Any key clears the notice from the status line.
    press(&mut app, "j");
    assert!(app.notice.is_none());
    assert!(status(&mut app, 80, 24).contains("finished"));
    // Case does not matter; every op is searched, not only those shown.
    search(&mut app, "Q_ABSORBED");
    assert_eq!(selected_name(&app).1, "model.layers.0.self_attn.q_absorbed");
}

#[test]
fn search_starts_after_the_selection_and_inside_a_selected_layer() {
    let mut app = common::tiny_app("");
    press(&mut app, "c");
    command(&mut app, "goto layer 2");
    assert_eq!(app.selected, Some(Node::Layer(Phase::Decode(4), 2)));
    // From a layer row, its own ops come first.
    search(&mut app, "input_layernorm");
    assert_eq!(
        selected_name(&app),
        (
            Phase::Decode(4),
            "model.layers.2.input_layernorm".to_string()
        )
    );
    // From an op, the next match after it: the next layer's.
    press(&mut app, "N");
    assert_eq!(
        selected_name(&app),
        (
            Phase::Decode(4),
            "model.layers.3.input_layernorm".to_string()
        )
    );
}

#[test]
fn a_search_with_no_match_says_so_and_leaves_the_selection() {
    let mut app = common::tiny_app("");
    press(&mut app, "c");
    let at = app.selected;
    search(&mut app, "no_such_op");
    assert_eq!(app.selected, at);
    let line = "/no_such_op: no op name contains it (780 ops searched)";
    assert_eq!(app.notice.as_deref(), Some(line));
    assert!(status(&mut app, 80, 24).contains(line));
    assert_eq!(app.log.last().unwrap(), line);
    // N repeats it, with the same answer.
    press(&mut app, "N");
    assert_eq!(app.selected, at);
    assert_eq!(app.notice.as_deref(), Some(line));
    // An empty search, Esc in the prompt, and N before any search.
    search(&mut app, "");
    assert!(app
        .notice
        .as_deref()
        .unwrap()
        .contains("type part of an op name"));
    press(&mut app, "/x");
    assert_eq!(
        app.overlay,
        Overlay::Search {
            input: "x".to_string()
        }
    );
    assert!(status(&mut app, 80, 24).starts_with("/x"));
    key(&mut app, KeyCode::Backspace);
    key(&mut app, KeyCode::Esc);
    assert_eq!(app.overlay, Overlay::None);
    let mut fresh = common::tiny_app("");
    press(&mut fresh, "N");
    assert!(fresh
        .notice
        .as_deref()
        .unwrap()
        .starts_with("no search yet"));
    // Ctrl-C quits from the prompt; it is not typed into it.
    press(&mut fresh, "/c");
    fresh.on_key(KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL));
    assert!(fresh.quit);
    assert_eq!(
        fresh.overlay,
        Overlay::Search {
            input: "c".to_string()
        }
    );
}

#[test]
fn searches_and_jumps_in_an_empty_trace_say_why() {
    // Nothing has arrived from the debugger: no model, no run.
    let (_tx, rx) = std::sync::mpsc::channel::<Update>();
    let driver = FeedDriver::new(rx, "nothing to drive");
    let mut app = App::new(Box::new(driver), Keymap::default(), Theme::plain());
    search(&mut app, "attn");
    assert_eq!(app.notice.as_deref(), Some("/attn: no ops to search yet"));
    command(&mut app, "goto layer 1");
    assert_eq!(
        app.notice.as_deref(),
        Some("goto layer: no model loaded yet")
    );
    assert!(app.selected.is_none());
    screen_text(&mut app, 80, 24);
}

#[test]
fn goto_layer_selects_and_opens_a_layer_of_the_current_phase() {
    let mut app = common::tiny_app("");
    // Not run yet: the run stands at the embedding of the prefill.
    command(&mut app, "goto layer 2");
    assert_eq!(
        app.notice.as_deref(),
        Some("goto layer: layer 2 of prefill has not run yet")
    );
    press(&mut app, "c");
    command(&mut app, "goto layer 2");
    let node = Node::Layer(Phase::Decode(4), 2);
    assert_eq!(app.selected, Some(node));
    assert!(app.is_open(node));
    assert_eq!(open_layers(&app), vec![(Phase::Decode(4), 2)]);
    assert_eq!(app.notice.as_deref(), Some("layer 2 of decode.4"));
    // The phase is that of the selection: from a prefill op, the prefill's layer.
    search(&mut app, "layers.0.input_layernorm");
    assert_eq!(selected_name(&app).0, Phase::Prefill);
    command(&mut app, "g layer 3");
    assert_eq!(app.selected, Some(Node::Layer(Phase::Prefill, 3)));
    assert_eq!(open_layers(&app), vec![(Phase::Prefill, 3)]);
    // The row is on screen, selected, at 80×24.
    let screen = screen_text(&mut app, 80, 24);
    assert!(screen.contains("▾  layer 3"), "{screen}");
    // Bad input: one clear line each, the selection unchanged.
    for (line, says) in [
        (
            "goto layer 9",
            "goto layer: layer 9 is not in the run (layers 0..4)",
        ),
        (
            "goto layer",
            "usage: goto layer N (this run has layers 0..4)",
        ),
        (
            "goto layer -1",
            "usage: goto layer N (this run has layers 0..4)",
        ),
        (
            "goto layer 99999999999999999999999",
            "usage: goto layer N (this run has layers 0..4)",
        ),
        (
            "goto layer 18446744073709551615",
            "goto layer: layer 18446744073709551615 is not in the run (layers 0..4)",
        ),
    ] {
        command(&mut app, line);
        assert_eq!(app.notice.as_deref(), Some(says), "{line}");
        assert_eq!(app.log.last().map(String::as_str), Some(says), "{line}");
        assert_eq!(app.selected, Some(Node::Layer(Phase::Prefill, 3)), "{line}");
    }
    // goto N and its usage are as they were.
    command(&mut app, "goto 5");
    assert_eq!(app.selected, Some(Node::Op(5)));
    command(&mut app, "goto nowhere");
    assert!(app.log.last().unwrap().contains("goto layer N"));
}

/// Each layer's summary against what its ops say: the largest difference the Compare pane
/// computes for any of them, whether any is marked as diverging, and the NaN/Inf and unwritten
/// elements of their statistics.
fn assert_summaries_match_the_ops(app: &mut App) {
    // Summaries are brought up to date in the update step; drawing runs it too.
    screen_text(app, 80, 24);
    let run = app.mirror.current().unwrap();
    for (phase, layer) in layers_of_run(app) {
        let ops: Vec<usize> = (0..run.len())
            .filter(|&i| run.events[i].phase == phase && run.events[i].layer == Some(layer))
            .collect();
        let mut non_finite = 0;
        let mut unwritten = 0;
        for &i in &ops {
            let s = &run.events[i].stats;
            let neg_inf = if run.events[i].kind == OpKind::IndexScores {
                0
            } else {
                s.neg_inf
            };
            non_finite += s.nan - s.unwritten + s.pos_inf + neg_inf;
            unwritten += s.unwritten;
        }
        let diffs: Vec<f64> = ops
            .iter()
            .filter_map(|&i| match mladb::tui::ui::diff_with_comparison(app, i) {
                Some(Ok(d)) => Some(d.rel_l2),
                _ => None,
            })
            .collect();
        let diverges = ops
            .iter()
            .any(|&i| app.judged_against_comparison(i).is_some_and(|(d, _)| d));
        let s = app
            .layer_summary(phase, layer)
            .unwrap_or_else(|| panic!("no summary of {phase} layer {layer}"));
        let at = format!("{phase} layer {layer}: {s:?}");
        assert_eq!(s.non_finite, non_finite, "{at}");
        assert_eq!(s.unwritten, unwritten, "{at}");
        assert_eq!(s.compared, !diffs.is_empty(), "{at}");
        assert_eq!(s.diverges, diverges, "{at}");
        if diffs.iter().any(|d| d.is_nan()) {
            assert!(s.max_error.is_nan(), "{at}");
        } else if let Some(max) = diffs.iter().copied().reduce(f64::max) {
            assert_eq!(s.max_error, max, "{at}");
        }
    }
}

/// A run compared with one of the other dtype (f32 after bf16, as a user switching back sees
/// it) is judged by bf16's tolerances in the tree's marks and by `goto first-divergent`: the
/// embedding, the first op, differs by bf16's rounding only (the f32 table marked it).
#[test]
fn a_run_against_one_of_the_other_dtype_is_judged_by_bf16_tolerances() {
    let mut app = common::tiny_app("");
    press(&mut app, "c");
    command(&mut app, "set dtype bf16");
    press(&mut app, "c");
    command(&mut app, "set dtype f32");
    press(&mut app, "c");
    let run = app.mirror.current().unwrap();
    assert_eq!(run.flags.dtype, mladb::engine::StorageDtype::F32);
    let other = app
        .mirror
        .comparison_run()
        .expect("the bf16 run is the comparison");
    assert_eq!(other.flags.dtype, mladb::engine::StorageDtype::Bf16);
    screen_text(&mut app, 80, 24);
    let (diverges, tolerance) = app.judged_against_comparison(0).expect("op 0 compared");
    assert!(
        !diverges && tolerance > 1e-3,
        "the embedding: tolerance {tolerance}"
    );
    command(&mut app, "goto first-divergent");
    let said = app.log.last().unwrap().clone();
    let run = app.mirror.current().unwrap();
    match app.selected_op() {
        Some((i, _)) if said.contains("first divergent op") => assert!(
            matches!(run.events[i].kind, OpKind::Router | OpKind::IndexTopK),
            "only a near-tie choice may flip with bf16's rounding: {said}"
        ),
        _ => assert!(
            said.contains("no op differs beyond its tolerance"),
            "{said}"
        ),
    }
}

#[test]
fn layer_summaries_show_where_a_decode_fault_diverges() {
    let mut app = common::tiny_app("");
    press(&mut app, "c");
    command(&mut app, "set inject softmax-scale-latent@decode");
    assert_eq!(app.mirror.comparison, Some(0));
    assert_summaries_match_the_ops(&mut app);
    // Again from the start, watched as it streams in: up to the middle of decode.2, then on.
    press(&mut app, "R");
    assert_eq!(app.mirror.comparison, Some(0));
    command(&mut app, "step 400");
    assert_eq!(app.mirror.current().unwrap().len(), 401);
    assert_summaries_match_the_ops(&mut app);
    press(&mut app, "c");
    assert_summaries_match_the_ops(&mut app);
    // The prefill is the clean run's: no difference at all. Every decode step differs, and
    // its first layer beyond tolerance.
    for l in 0..4 {
        let s = app.layer_summary(Phase::Prefill, l).unwrap();
        assert!(s.compared && s.max_error == 0.0 && !s.diverges, "{s:?}");
        for k in 0..5 {
            let s = app.layer_summary(Phase::Decode(k), l).unwrap();
            assert!(s.max_error > 1e-2, "decode.{k} layer {l}: {s:?}");
            assert_eq!((s.non_finite, s.unwritten), (0, 0));
        }
    }
    assert!(app.layer_summary(Phase::Decode(0), 0).unwrap().diverges);
    // On screen: the prefill's rows say Δ0, decode.0's first layer ≠.
    press(&mut app, "g");
    let screen = screen_text(&mut app, 80, 24);
    assert!(screen.contains("▸  layer 0 Δ0 "), "{screen}");
    assert!(screen.contains("▸  layer 0 ≠"), "{screen}");
}

#[test]
fn layer_summaries_count_nan_and_unwritten_elements() {
    let mut app = common::tiny_app("");
    press(&mut app, "c");
    command(&mut app, "set inject output-buffer-disconnect");
    assert_summaries_match_the_ops(&mut app);
    for (phase, layer) in layers_of_run(&app) {
        let s = app.layer_summary(phase, layer).unwrap();
        assert!(s.unwritten > 0 && s.non_finite > 0 && s.diverges, "{s:?}");
        assert!(s.max_error.is_nan(), "a NaN output differs by NaN: {s:?}");
    }
    // Without a comparison run (the first run), no difference is shown, only the counts.
    let mut app = common::tiny_app("inject=output-buffer-disconnect");
    press(&mut app, "c");
    assert_eq!(app.mirror.comparison, None);
    assert_summaries_match_the_ops(&mut app);
    let s = app.layer_summary(Phase::Prefill, 0).unwrap();
    assert!(!s.compared && s.unwritten > 0, "{s:?}");
    press(&mut app, "g");
    let screen = screen_text(&mut app, 80, 24);
    let row = screen
        .lines()
        .find(|l| l.contains("layer 0"))
        .unwrap()
        .to_string();
    assert!(row.contains(" !") && row.contains(" ?"), "{row}");
    assert!(!row.contains('Δ') && !row.contains('≠'), "{row}");
}

#[test]
fn snapshot_collapsed_tree_80x24() {
    let mut app = common::tiny_app("");
    press(&mut app, "c");
    command(&mut app, "set inject output-buffer-disconnect");
    press(&mut app, "g");
    let top = screen_text(&mut app, 80, 24);
    // A fault of the decode steps alone, against the clean run, at the layer opened by hand.
    let mut app = common::tiny_app("");
    press(&mut app, "c");
    command(&mut app, "set inject softmax-scale-latent@decode");
    command(&mut app, "goto layer 1");
    let decode = screen_text(&mut app, 80, 24);
    snapshot("collapsed_80x24", &format!("{top}\n{decode}"));
}

#[test]
fn snapshot_collapsed_tree_160x48() {
    let mut app = common::tiny_app("");
    press(&mut app, "c");
    command(&mut app, "set inject softmax-scale-latent@decode");
    press(&mut app, "g");
    let top = screen_text(&mut app, 160, 48);
    // The last step's layer 1 opened, at its attention probabilities.
    press(&mut app, "G");
    command(&mut app, "goto layer 1");
    search(&mut app, "attn_probs");
    let bottom = screen_text(&mut app, 160, 48);
    snapshot("collapsed_160x48", &format!("{top}\n{bottom}"));
}

fn snapshot(name: &str, text: &str) {
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path("snapshots");
    settings.bind(|| insta::assert_snapshot!(name, text));
}

/// The live debugger inline, holding back the end of a command when asked, so that a test
/// sees the app as it is while a long command runs; it counts the cancel requests.
struct Held {
    inner: InlineDriver,
    hold: Arc<AtomicBool>,
    held: Vec<Update>,
    cancels: Arc<AtomicUsize>,
}

impl Driver for Held {
    fn send(&mut self, command: Command) {
        self.inner.send(command);
    }

    fn poll(&mut self) -> Vec<Update> {
        let mut out = Vec::new();
        for u in self.inner.poll() {
            match u {
                Update::Busy(None) if self.hold.load(Ordering::Relaxed) => self.held.push(u),
                u => out.push(u),
            }
        }
        if !self.hold.load(Ordering::Relaxed) {
            out.append(&mut self.held);
        }
        out
    }

    fn cancel(&self) {
        self.cancels.fetch_add(1, Ordering::Relaxed);
        self.inner.cancel();
    }
}

/// The gauge's label at 80×24: the status line less the gauge's bar.
fn gauge(app: &mut App) -> String {
    let line = status(app, 80, 24);
    line.trim_start_matches('█').trim().to_string()
}

/// The tiny app over a [`Held`] driver, with a fake clock: (app, hold, cancels, now).
fn held_app() -> (App, Arc<AtomicBool>, Arc<AtomicUsize>, Arc<Mutex<Instant>>) {
    let hold = Arc::new(AtomicBool::new(false));
    let cancels = Arc::new(AtomicUsize::new(0));
    let driver = Held {
        inner: InlineDriver::new(common::live_spec("glm5-tiny", "", 12, 9, 2)).unwrap(),
        hold: hold.clone(),
        held: Vec::new(),
        cancels: cancels.clone(),
    };
    let mut app = App::new(Box::new(driver), Keymap::default(), Theme::plain());
    let now = Arc::new(Mutex::new(Instant::now()));
    let clock = now.clone();
    app.clock = Box::new(move || *clock.lock().unwrap());
    (app, hold, cancels, now)
}

#[test]
fn the_gauge_estimates_the_time_left_and_esc_cancels() {
    let (mut app, hold, cancels, now) = held_app();
    let t0 = *now.lock().unwrap();
    let set = |s: f64| *now.lock().unwrap() = t0 + Duration::from_secs_f64(s);
    // Esc while nothing runs cancels nothing.
    key(&mut app, KeyCode::Esc);
    assert_eq!(cancels.load(Ordering::Relaxed), 0);

    // A continue from the first op stopped at layer 1 of the prefill, and still running: 2/5
    // of the prefill's layers of 6 phases, 1/15 of the run.
    command(&mut app, "break layer 1");
    hold.store(true, Ordering::Relaxed);
    press(&mut app, "c");
    assert_eq!(app.mirror.busy.as_deref(), Some("continue"));
    let p = app.progress().unwrap();
    assert!((p - 1.0 / 15.0).abs() < 1e-12, "{p}");
    assert_eq!(app.started.unwrap().from, 0.0);
    // No estimate in the first second.
    set(0.5);
    assert_eq!(app.time_left_text(), None);
    assert_eq!(gauge(&mut app), "continue: 7% · Esc cancels");
    // After 3 s for 1/15: 14 × 3 s left.
    set(3.0);
    assert_eq!(app.time_left_text().as_deref(), Some("about 42s left"));
    assert_eq!(
        gauge(&mut app),
        "continue: 7% · about 42s left · Esc cancels"
    );
    set(10.0);
    assert_eq!(app.time_left_text().as_deref(), Some("about 2m left"));
    set(1000.0);
    assert_eq!(app.time_left_text().as_deref(), Some("about 3.9h left"));
    assert!(status(&mut app, 160, 48).contains("about 3.9h left"));
    // Esc asks the debugger to stop.
    key(&mut app, KeyCode::Esc);
    assert_eq!(cancels.load(Ordering::Relaxed), 1);
    // The command ends: no gauge, no estimate.
    hold.store(false, Ordering::Relaxed);
    app.tick();
    assert!(app.mirror.busy.is_none() && app.started.is_none());
    assert_eq!(app.time_left_text(), None);
    assert!(status(&mut app, 80, 24).contains("paused at breakpoint layer 1"));
    key(&mut app, KeyCode::Esc);
    assert_eq!(cancels.load(Ordering::Relaxed), 1, "nothing runs");

    // Under 5% of the run, no estimate however long it took: layer 0 of the prefill is 1/30.
    let (mut app, hold, _, now) = held_app();
    let t0 = *now.lock().unwrap();
    command(&mut app, "break layer 0");
    hold.store(true, Ordering::Relaxed);
    press(&mut app, "c");
    *now.lock().unwrap() = t0 + Duration::from_secs(100);
    assert!((app.progress().unwrap() - 1.0 / 30.0).abs() < 1e-12);
    assert_eq!(app.time_left_text(), None);
    assert_eq!(gauge(&mut app), "continue: 3% · Esc cancels");
}

#[test]
fn a_restart_counts_the_time_left_from_the_start_of_the_run() {
    let (mut app, hold, _, _) = held_app();
    press(&mut app, "c");
    hold.store(true, Ordering::Relaxed);
    // From the end of run 0 to the first op of run 1: the new run is what is left.
    press(&mut app, "R");
    assert_eq!(app.mirror.current_number(), 1);
    assert_eq!(app.started.unwrap().from, 0.0);
}

#[test]
fn the_help_scrolls_to_its_last_line_at_80x24() {
    let mut app = common::tiny_app("");
    press(&mut app, "?");
    let first = screen_text(&mut app, 80, 24);
    assert!(first.contains("j/k scroll"), "{first}");
    assert!(first.contains("move up"), "{first}");
    assert!(!first.contains("layer rows:"), "{first}");
    // Every line can be brought into view, the new keys and the layer rows' legend included.
    let mut seen = first.clone();
    for _ in 0..60 {
        press(&mut app, "j");
        seen.push_str(&screen_text(&mut app, 80, 24));
    }
    assert_eq!(app.overlay, Overlay::Help, "j scrolls; it does not close");
    for needle in [
        "search op names",
        "next op matching the last search",
        "first-divergent|layer N",
        "layer rows:",
        "unwritten elements",
    ] {
        assert!(seen.contains(needle), "{needle} never shown");
    }
    // Scrolled no further than the last line: one k shows one line more at the top.
    let bottom = screen_text(&mut app, 80, 24);
    press(&mut app, "k");
    assert_ne!(screen_text(&mut app, 80, 24), bottom);
    // Any other key closes it.
    press(&mut app, "x");
    assert_eq!(app.overlay, Overlay::None);
    assert!(!app.quit);
}
