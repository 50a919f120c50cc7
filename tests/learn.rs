//! The Learn view: the layer it explains and why, its walk over the layer's ops (which moves the
//! selection), and snapshots at 80×24 (every part reachable by scrolling) and 160×48.

mod common;

use mladb::tui::app::{App, Node, Overlay, WalkTarget, WALK};
use mladb::tui::ui;
use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use ratatui::Terminal;

fn press(app: &mut App, keys: &str) {
    for c in keys.chars() {
        app.on_key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE));
    }
}

fn screen(app: &mut App, w: u16, h: u16) -> String {
    let mut terminal = Terminal::new(TestBackend::new(w, h)).unwrap();
    terminal.draw(|f| ui::draw(f, app)).unwrap();
    terminal.backend().to_string()
}

fn snapshot(name: &str, text: &str) {
    let mut settings = insta::Settings::clone_current();
    settings.add_filter(r"@0x[0-9a-f]{12}", "@[address    ]");
    settings.add_filter(r"buf \d+ *", "buf [id]    ");
    settings.set_snapshot_path("snapshots");
    settings.bind(|| insta::assert_snapshot!(name, text));
}

/// GLM-5's head dims with one tensor-parallel rank's 8 heads, run to the end.
fn finished_app() -> App {
    let mut app = common::live_app("glm5-rank8", "", 12, 9, 2);
    press(&mut app, "c");
    assert!(app.mirror.current().unwrap().finished());
    app
}

fn selected_name(app: &App) -> String {
    app.selected_op().map(|(_, e)| e.name.clone()).unwrap()
}

#[test]
fn outside_a_layer_the_view_says_which_layer_it_shows() {
    let mut app = finished_app();
    assert_eq!(selected_name(&app), "logits");
    let (layer, why) = app.learn_layer().unwrap();
    assert_eq!(layer, 0);
    let why = why.expect("a reason when the selection is outside the layers");
    assert!(why.contains("(logits) is not inside a layer"), "{why}");
    // Inside a layer: that layer, no reason.
    app.select(Node::Layer(mladb::engine::trace::Phase::Prefill, 2));
    assert_eq!(app.learn_layer(), Some((2, None)));
}

#[test]
fn the_walk_moves_the_selection_to_each_steps_op() {
    let mut app = finished_app();
    press(&mut app, "l");
    assert_eq!(app.overlay, Overlay::Learn { scroll: 0 });
    for (i, step) in WALK.iter().enumerate() {
        press(&mut app, "n");
        assert_eq!(app.learn_step, Some(i));
        let (_, e) = app
            .selected_op()
            .expect("every step of a finished run selects an op");
        assert_eq!(e.name, format!("model.layers.0.self_attn.{}", step.op));
        if let Some(path) = step.path {
            // The op is from a phase that ran the step's path (prefill naive, decode absorbed).
            assert_eq!(app.mirror.current().unwrap().flags.path_of(e.phase), path);
        }
        assert!(!app.follow, "the walk holds the selection where it put it");
    }
    // The last step stays the last; p walks back; the view stays open throughout.
    press(&mut app, "n");
    assert_eq!(app.learn_step, Some(WALK.len() - 1));
    press(&mut app, "pp");
    assert_eq!(app.learn_step, Some(WALK.len() - 3));
    assert_eq!(selected_name(&app), "model.layers.0.self_attn.attn_latent");
    assert!(matches!(app.overlay, Overlay::Learn { .. }));
}

#[test]
fn a_step_whose_path_did_not_run_says_so_and_leaves_the_selection() {
    // MLA disabled: every phase runs naive, so there is no q_absorbed anywhere.
    let mut app = common::live_app("glm5-rank8", "mla-disable=on", 12, 9, 2);
    press(&mut app, "c");
    press(&mut app, "l");
    let q_absorbed = WALK.iter().position(|s| s.op == "q_absorbed").unwrap();
    for _ in 0..q_absorbed {
        press(&mut app, "n");
    }
    let before = selected_name(&app);
    press(&mut app, "n");
    assert_eq!(selected_name(&app), before);
    match app.walk_target(q_absorbed) {
        WalkTarget::Missing(why) => assert!(why.contains("ran no absorbed attention"), "{why}"),
        other => panic!("{other:?}"),
    }
    let text = screen(&mut app, 80, 24);
    assert!(text.contains("ran no absorbed"), "{text}");
}

#[test]
fn snapshot_learn_80x24_scrolled_through() {
    let mut app = finished_app();
    press(&mut app, "l");
    // Every row of the view, a screen at a time: nothing is cut off at 80×24.
    let mut pages = Vec::new();
    for _ in 0..8 {
        pages.push(screen(&mut app, 80, 24));
        press(&mut app, &"j".repeat(18));
    }
    // Every step of the walk: the panel at the foot of the view (its last 8 rows).
    for _ in 0..WALK.len() {
        press(&mut app, "n");
        let text = screen(&mut app, 80, 24);
        let rows: Vec<&str> = text.lines().collect();
        pages.push(rows[rows.len() - 8..].join("\n"));
    }
    snapshot(
        "learn_80x24",
        &pages.join("\n--- 18 rows further / next step ---\n"),
    );
}

#[test]
fn snapshot_learn_160x48_walking() {
    let mut app = finished_app();
    press(&mut app, "l");
    let first = screen(&mut app, 160, 48);
    let q_absorbed = WALK.iter().position(|s| s.op == "q_absorbed").unwrap();
    press(&mut app, &"n".repeat(q_absorbed + 1));
    assert_eq!(selected_name(&app), "model.layers.0.self_attn.q_absorbed");
    snapshot(
        "learn_160x48",
        &format!(
            "{first}\n--- walked to q_absorbed ---\n{}",
            screen(&mut app, 160, 48)
        ),
    );
}

#[test]
fn in_a_replay_without_tensors_the_live_values_say_what_is_missing() {
    use mladb::tui::{keys::Keymap, replay::ReplayDriver, theme::Theme};
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("sessions/weight-absorption.ron");
    let driver = ReplayDriver::open(&path).unwrap();
    let mut app = App::new(Box::new(driver), Keymap::default(), Theme::plain());
    // The replay opens at its first note, before any decode step: on to the end of the run.
    press(&mut app, "c");
    app.overlay = Overlay::Learn { scroll: 0 };
    // The live values come after the cost table; scroll until they are on screen.
    let mut seen = String::new();
    for _ in 0..12 {
        let text = screen(&mut app, 120, 40);
        seen.push_str(&text);
        press(&mut app, &"j".repeat(15));
    }
    let seen: String = seen.replace(['│', '"', '\n'], "");
    let seen = seen.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(seen.contains("Live values"), "{seen}");
    assert!(
        seen.contains("Only samples were recorded for") && seen.contains(":save --tensors FILE"),
        "{seen}"
    );
}

#[test]
fn a_finished_replay_is_not_told_to_finish_the_run() {
    use mladb::tui::{keys::Keymap, replay::ReplayDriver, theme::Theme};
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("sessions/weight-absorption.ron");
    let driver = ReplayDriver::open(&path).unwrap();
    let mut app = App::new(Box::new(driver), Keymap::default(), Theme::plain());
    press(&mut app, "c");
    press(&mut app, "l");
    let mut seen = String::new();
    for _ in 0..12 {
        seen.push_str(&screen(&mut app, 120, 40));
        press(&mut app, &"j".repeat(15));
    }
    let seen = seen.replace(['│', '"', '\n'], "");
    let seen = seen.split_whitespace().collect::<Vec<_>>().join(" ");
    // A finished replay is not told to finish; the comparison runs recorded with the run
    // give the side-by-side.
    assert!(!seen.contains("finish the run"), "{seen}");
    assert!(!seen.contains("no comparison runs"), "{seen}");
    assert!(seen.contains("The two paths' outputs"), "{seen}");
}

#[test]
fn scrolling_stops_at_the_end_of_the_view() {
    let mut app = finished_app();
    press(&mut app, "l");
    // Far past the end: the last lines stay on screen, and one key back scrolls at once.
    press(&mut app, &"j".repeat(400));
    let bottom = screen(&mut app, 80, 24);
    let Overlay::Learn { scroll } = app.overlay else {
        panic!("the Learn view closed");
    };
    assert!((1..400).contains(&scroll), "scroll kept at {scroll}");
    assert!(bottom.contains("force-dequant is"), "{bottom}");
    press(&mut app, "k");
    screen(&mut app, 80, 24);
    assert_eq!(app.overlay, Overlay::Learn { scroll: scroll - 1 });
}

#[test]
fn the_indexer_section_tells_this_runs_selection() {
    // glm5-tiny keeps 8 keys a query: a 12-token prompt's last queries attend sparsely.
    let mut app = common::live_app("glm5-tiny", "", 12, 12, 2);
    press(&mut app, "c");
    press(&mut app, "l");
    let mut text = String::new();
    for _ in 0..12 {
        text.push_str(&screen(&mut app, 160, 48));
        press(&mut app, &"j".repeat(30));
    }
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(flat.contains("The DSA indexer"), "{flat}");
    assert!(flat.contains("top K = 8"), "{flat}");
    assert!(
        flat.contains("attends to 8 keys") && flat.contains("sparse:"),
        "{flat}"
    );
}
