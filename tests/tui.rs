//! The TUI, driven synchronously: the debugger runs inline, so every key is fully handled when
//! `on_key` returns (no sleeps). State-machine tests check what keys do; snapshot tests (insta,
//! ratatui's TestBackend) check what each pane shows after a scripted key sequence.

mod common;

use mladb::debug::breakpoint::Breakpoint;
use mladb::engine::trace::Phase;
use mladb::tui::app::{App, Node, Overlay, Tab};
use mladb::tui::ui;
use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{
    KeyCode, KeyEvent, KeyModifiers, MouseButton, MouseEvent, MouseEventKind,
};
use ratatui::Terminal;

fn app() -> App {
    common::tiny_app("")
}

fn press(app: &mut App, keys: &str) {
    for c in keys.chars() {
        app.on_key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE));
    }
}

fn key(app: &mut App, code: KeyCode) {
    app.on_key(KeyEvent::new(code, KeyModifiers::NONE));
}

fn command(app: &mut App, line: &str) {
    press(app, ":");
    press(app, line);
    key(app, KeyCode::Enter);
}

fn screen(app: &mut App, w: u16, h: u16) -> String {
    let mut terminal = Terminal::new(TestBackend::new(w, h)).unwrap();
    terminal.draw(|f| ui::draw(f, app)).unwrap();
    terminal.backend().to_string()
}

fn position(app: &App) -> (Phase, String) {
    let e = app.mirror.position().unwrap();
    (e.phase, e.name.clone())
}

/// Buffer ids come from a process-wide counter and addresses from the allocator: mask them.
fn snapshot(name: &str, text: &str) {
    let mut settings = insta::Settings::clone_current();
    // Both are printed at fixed widths, so masking them keeps the layout.
    settings.add_filter(r"@0x[0-9a-f]{12}", "@[address    ]");
    settings.add_filter(r"buf \d+ *", "buf [id]    ");
    settings.set_snapshot_path("snapshots");
    settings.bind(|| insta::assert_snapshot!(name, text));
}

#[test]
fn opens_paused_at_the_first_op() {
    let app = app();
    assert_eq!(
        position(&app),
        (Phase::Prefill, "model.embed_tokens".to_string())
    );
    assert_eq!(app.selected, Some(Node::Op(0)));
    assert!(app.mirror.busy.is_none());
}

#[test]
fn step_next_layer_continue_and_breakpoints() {
    let mut app = app();
    press(&mut app, "s");
    assert_eq!(position(&app).1, "model.layers.0.input_layernorm");
    press(&mut app, "n");
    assert_eq!(position(&app).1, "model.layers.1.input_layernorm");
    // A breakpoint on the selected op (the position), then continue to its next hit.
    press(&mut app, "b");
    assert_eq!(
        app.mirror.breakpoints,
        vec![Breakpoint::Op("model.layers.1.input_layernorm".into())]
    );
    press(&mut app, "c");
    assert_eq!(
        position(&app),
        (
            Phase::Decode(0),
            "model.layers.1.input_layernorm".to_string()
        )
    );
    press(&mut app, "b");
    assert!(app.mirror.breakpoints.is_empty());
    command(&mut app, "break layer 3");
    assert_eq!(app.mirror.breakpoints, vec![Breakpoint::Layer(3)]);
    press(&mut app, "c");
    assert_eq!(
        position(&app),
        (
            Phase::Decode(0),
            "model.layers.3.input_layernorm".to_string()
        )
    );
    command(&mut app, "delete layer 3");
    press(&mut app, "c");
    assert!(app.mirror.current().unwrap().finished());
    assert!(app.log.iter().any(|l| l.contains("finished")));
}

#[test]
fn toggling_mla_disable_reexecutes_and_compares() {
    let mut app = app();
    press(&mut app, "c");
    let before = app.mirror.current_number();
    press(&mut app, "m");
    assert!(app.mirror.flags.mla_disable);
    assert_eq!(app.mirror.current_number(), before + 1);
    assert_eq!(app.mirror.comparison, Some(before));
    assert_eq!(app.tab, Tab::Compare);
    assert!(
        app.mirror.current().unwrap().finished(),
        "re-executed to where the run stood"
    );
    assert!(
        app.log
            .iter()
            .any(|l| l.contains("re-executed from op #149")),
        "{:?}",
        app.log
    );
    press(&mut app, "m");
    assert!(!app.mirror.flags.mla_disable);
    press(&mut app, "f");
    assert!(app.mirror.flags.force_dequant);
    assert!(app.log.iter().any(|l| l.contains("nothing to act on")));
}

#[test]
fn navigation_expand_mouse_and_follow() {
    let mut app = app();
    press(&mut app, "n");
    let at = app.selected;
    press(&mut app, "k");
    assert_ne!(app.selected, at);
    assert!(!app.follow);
    // Collapse the prefill phase (the first row): only its row is left.
    let rows = app.rows().len();
    press(&mut app, "g");
    key(&mut app, KeyCode::Enter);
    assert!(rows > 1);
    assert_eq!(app.rows().len(), 1);
    key(&mut app, KeyCode::Enter);
    assert_eq!(app.rows().len(), rows);
    press(&mut app, ".");
    assert!(app.follow);
    assert_eq!(
        app.selected,
        Some(Node::Op(app.mirror.position().unwrap().index))
    );
    // A click on the first tree row selects the phase.
    screen(&mut app, 100, 30);
    let tree = app.areas.tree;
    app.on_mouse(MouseEvent {
        kind: MouseEventKind::Down(MouseButton::Left),
        column: tree.x + 2,
        row: tree.y + 1,
        modifiers: KeyModifiers::NONE,
    });
    assert_eq!(app.selected, Some(Node::Phase(Phase::Prefill)));
    key(&mut app, KeyCode::Tab);
    assert_eq!(app.tab, Tab::Buffers);
    press(&mut app, "]]");
    assert_eq!(app.tree_percent, 50);
    let wide = app.areas.tree.width;
    screen(&mut app, 100, 30);
    assert!(
        app.areas.tree.width > wide,
        "the tree pane is resizable: {} then {}",
        wide,
        app.areas.tree.width
    );
    press(&mut app, "[[[[[[[[[");
    assert_eq!(app.tree_percent, 20);
    press(&mut app, "q");
    assert!(app.quit);
}

#[test]
fn injection_menu_command_line_and_sessions() {
    let mut app = app();
    press(&mut app, "i");
    assert!(matches!(app.overlay, Overlay::Inject { .. }));
    key(&mut app, KeyCode::Enter); // the first fault: output-buffer-disconnect
    assert_eq!(
        app.mirror.flags.faults.to_string(),
        "output-buffer-disconnect"
    );
    key(&mut app, KeyCode::Esc);
    assert_eq!(app.overlay, Overlay::None);
    command(&mut app, "set dtype bf16");
    assert_eq!(format!("{:?}", app.mirror.flags.dtype), "Bf16");
    command(&mut app, "frobnicate");
    assert!(app.log.last().unwrap().contains("unknown command"));
    command(&mut app, "break sometimes");
    assert!(app.log.last().unwrap().contains("error"));

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hunt.ron");
    press(&mut app, "nn");
    command(&mut app, "break nan");
    command(&mut app, "note attention output looks empty");
    command(&mut app, &format!("save {}", path.display()));
    assert!(path.exists());
    let at = position(&app);
    let mut other = common::tiny_app("");
    command(&mut other, &format!("load {}", path.display()));
    assert_eq!(position(&other), at);
    assert_eq!(other.mirror.flags, app.mirror.flags);
    assert_eq!(other.mirror.breakpoints, vec![Breakpoint::NanInf]);
    assert!(other
        .log
        .iter()
        .any(|l| l.contains("attention output looks empty")));
    // Saved again after loading, the notes are still there.
    let again = dir.path().join("again.ron");
    command(&mut other, &format!("save {}", again.display()));
    let text = std::fs::read_to_string(&again).unwrap();
    assert!(
        text.contains("attention output looks empty"),
        "notes lost on a second save"
    );
    command(
        &mut other,
        &format!("load {}", dir.path().join("missing.ron").display()),
    );
    assert!(other.log.last().unwrap().contains("error"));
}

#[test]
fn snapshot_main_screen_after_stepping_into_a_layer() {
    let mut app = app();
    press(&mut app, "nsss");
    snapshot("main_tensor", &screen(&mut app, 100, 30));
}

#[test]
fn snapshot_small_terminal() {
    let mut app = app();
    press(&mut app, "n");
    snapshot("main_80x24", &screen(&mut app, 80, 24));
}

#[test]
fn snapshot_attention_heat_map() {
    let mut app = app();
    command(&mut app, "break op *attn_probs");
    press(&mut app, "c");
    snapshot("attention_probs", &screen(&mut app, 100, 34));
}

#[test]
fn snapshot_buffers_of_a_disconnected_attention() {
    let mut app = common::tiny_app("inject=output-buffer-disconnect");
    command(&mut app, "break op *attn_output");
    press(&mut app, "c");
    key(&mut app, KeyCode::Tab);
    // Wide enough that no line wraps: buffer ids and addresses vary in length between runs.
    snapshot("buffers_disconnect", &screen(&mut app, 160, 30));
}

#[test]
fn snapshot_comparison_after_mla_toggle() {
    let mut app = app();
    press(&mut app, "c");
    press(&mut app, "m");
    press(&mut app, "d");
    // Layer 3 of the last decode step (the phase of the selection, the logits), collapsed
    // until opened, then its attention output.
    command(&mut app, "goto layer 3");
    press(&mut app, "/attn_output");
    key(&mut app, KeyCode::Enter);
    assert_eq!(
        app.selected_op().unwrap().1.name,
        "model.layers.3.self_attn.attn_output"
    );
    snapshot("compare", &screen(&mut app, 110, 30));
}

#[test]
fn snapshot_learn_view() {
    let mut app = app();
    press(&mut app, "c");
    press(&mut app, "l");
    let first = screen(&mut app, 120, 40);
    press(&mut app, "jjjjjjjjjjjjjjjj");
    snapshot(
        "learn",
        &format!("{first}\n--- scrolled ---\n{}", screen(&mut app, 120, 40)),
    );
}

#[test]
fn snapshot_help_and_inject_menu() {
    let mut app = app();
    press(&mut app, "?");
    let help = screen(&mut app, 100, 34);
    key(&mut app, KeyCode::Esc);
    press(&mut app, "i");
    snapshot(
        "help_inject",
        &format!("{help}\n{}", screen(&mut app, 120, 30)),
    );
}
