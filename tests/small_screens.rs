//! The debugger at 80×24 (and 160×48 beside it): the header bar in the README's words, never
//! cut off; the fault menu's descriptions readable; the right pane scrolling where its content
//! is taller than it; the help whole when scrolled. Driven inline like tests/tui.rs.

mod common;

use common::{command, screen_text};
use mladb::engine::trace::Phase;
use mladb::tui::app::{App, Node, Overlay, Tab};
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};

fn press(app: &mut App, keys: &str) {
    for c in keys.chars() {
        app.on_key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE));
    }
}

fn key(app: &mut App, code: KeyCode) {
    app.on_key(KeyEvent::new(code, KeyModifiers::NONE));
}

fn snapshot(name: &str, text: &str) {
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path("snapshots");
    settings.bind(|| insta::assert_snapshot!(name, text));
}

/// The header's rows: those above the execution tree's top border.
fn header(app: &mut App, w: u16) -> Vec<String> {
    screen_text(app, w, 24)
        .lines()
        .take_while(|l| !l.starts_with('┌'))
        .map(|l| l.trim_end().to_string())
        .collect()
}

/// Selects op `name` of `phase` in the current run.
fn select(app: &mut App, phase: Phase, name: &str) {
    let i = app
        .mirror
        .current()
        .unwrap()
        .events
        .iter()
        .position(|e| e.phase == phase && e.name == name)
        .unwrap_or_else(|| panic!("{phase} {name}"));
    app.follow = false;
    app.select(Node::Op(i));
}

#[test]
fn the_header_uses_the_readme_words_and_fits_80_columns() {
    // Every flag at its default: the whole bar at 160, the defaults that tell least left out at
    // 80, in one row either way.
    let mut app = common::tiny_app("");
    let wide = header(&mut app, 160);
    assert_eq!(
        wide,
        [" mladb │ MLA-disable off │ prefill naive · decode absorbed │ dequant off │ cpu · f32 │ inject none"]
    );
    let narrow = header(&mut app, 80);
    assert_eq!(narrow.len(), 1, "{narrow:?}");
    assert!(narrow[0].chars().count() <= 80);
    for want in [
        "MLA-disable off",
        "prefill naive · decode absorbed",
        "inject none",
    ] {
        assert!(narrow[0].contains(want), "{want:?} in {narrow:?}");
    }
    // A fault changed from its default is never left out or cut; defaults make room for it.
    command(&mut app, "set inject output-buffer-disconnect@decode");
    let narrow = header(&mut app, 80);
    assert_eq!(narrow.len(), 1, "{narrow:?}");
    assert!(
        narrow[0].contains("inject output-buffer-disconnect@decode")
            && narrow[0].contains("prefill naive · decode absorbed"),
        "{narrow:?}"
    );
    // MLA disable on: the paths it implies, and the flag itself, kept.
    command(&mut app, "set inject none");
    command(&mut app, "set mla-disable on");
    let narrow = header(&mut app, 80);
    assert!(
        narrow[0].contains("MLA-disable on") && narrow[0].contains("prefill naive · decode naive"),
        "{narrow:?}"
    );
    // More changed flags than one row holds: a second row, nothing cut off.
    command(&mut app, "set mla-disable off");
    command(&mut app, "set dtype bf16");
    command(&mut app, "set inject output-buffer-disconnect@decode");
    command(&mut app, "set inject +softmax-scale-latent");
    command(&mut app, "set decode-path naive");
    let narrow = header(&mut app, 80);
    assert_eq!(narrow.len(), 2, "{narrow:?}");
    let both = narrow.join(" ");
    for want in [
        "prefill naive · decode naive",
        "cpu · bf16",
        "output-buffer-disconnect@decode",
        "softmax-scale-latent",
    ] {
        assert!(both.contains(want), "{want:?} in {narrow:?}");
    }
    assert!(narrow.iter().all(|l| l.chars().count() <= 80), "{narrow:?}");
    for debug in ["Naive", "Absorbed", "Cpu", "F32", "Bf16"] {
        assert!(!both.contains(debug), "{debug} in {narrow:?}");
    }
}

#[test]
fn snapshot_header_80x24_and_160x48() {
    let mut app = common::tiny_app("");
    let mut shots = vec![
        screen_text(&mut app, 80, 24),
        screen_text(&mut app, 160, 48),
    ];
    command(&mut app, "set inject output-buffer-disconnect@decode");
    shots.push(screen_text(&mut app, 80, 24));
    shots.push(screen_text(&mut app, 160, 48));
    snapshot("header", &shots.join("\n"));
}

#[test]
fn the_fault_menu_shows_the_selected_description_whole_at_80x24() {
    let mut app = common::tiny_app("");
    press(&mut app, "i");
    assert!(matches!(app.overlay, Overlay::Inject { .. }));
    let first = screen_text(&mut app, 80, 24);
    assert!(
        first.contains("│output-buffer-disconnect: attention kernel writes a phantom buffer; the")
            && first.contains("│wrapper returns its own, unwritten"),
        "{first}"
    );
    assert!(first.contains("Esc closes"), "{first}");
    // Every fault's row stays in view, and the description follows the selection.
    for name in [
        "tp-absorb-unsliced",
        "kv-cache-off-by-one",
        "page-index-overflow",
    ] {
        assert!(first.contains(name), "{name}:\n{first}");
    }
    press(&mut app, "j");
    let second = screen_text(&mut app, 80, 24);
    assert!(
        second.contains("│softmax-scale-latent: absorbed softmax scaled by the latent width")
            && second.contains("qk_rope "),
        "{second}"
    );
    // At 160 columns the rows hold their descriptions whole, with no line below.
    let wide = screen_text(&mut app, 160, 48);
    assert!(
        wide.contains(
            "attention kernel writes a phantom buffer; the wrapper returns its own, unwritten"
        ),
        "{wide}"
    );
    assert!(!wide.contains("softmax-scale-latent: "), "{wide}");
    snapshot(
        "inject_menu",
        &format!("{first}\n--- one down ---\n{second}\n--- 160×48 ---\n{wide}"),
    );
}

#[test]
fn the_right_pane_scrolls_where_its_content_is_taller() {
    let mut app = common::tiny_app("");
    press(&mut app, "c");
    press(&mut app, "d");
    select(
        &mut app,
        Phase::Decode(1),
        "model.layers.1.self_attn.attn_output",
    );
    app.tab = Tab::Compare;
    let top = screen_text(&mut app, 80, 24);
    let most = app.pane_scroll.most;
    assert!(most > 0, "the Compare pane fits?\n{top}");
    assert!(
        top.contains(&format!(">/< scroll (1/{})", most + 1)),
        "{top}"
    );
    press(&mut app, ">");
    let one = screen_text(&mut app, 80, 24);
    assert!(one.contains(&format!("(2/{})", most + 1)), "{one}");
    assert_ne!(one, top);
    // No further than the last line; < comes back one.
    press(&mut app, &">".repeat(200));
    let bottom = screen_text(&mut app, 80, 24);
    assert_eq!(app.pane_scroll.offset, most);
    assert!(
        bottom.contains(&format!("({}/{})", most + 1, most + 1)),
        "{bottom}"
    );
    press(&mut app, "<");
    assert_eq!(app.pane_scroll.offset, most - 1);
    // At 160×48 the same pane needs less scrolling, or none.
    let wide = screen_text(&mut app, 160, 48);
    assert!(app.pane_scroll.most < most, "{wide}");
    snapshot(
        "pane_scrolled",
        &format!("{top}\n--- one down ---\n{one}\n--- at the bottom ---\n{bottom}\n--- 160×48 ---\n{wide}"),
    );
    // Another op starts at its top.
    screen_text(&mut app, 80, 24);
    press(&mut app, "k");
    screen_text(&mut app, 80, 24);
    assert_eq!(app.pane_scroll.offset, 0);
    // So does another tab; a pane that fits does not scroll.
    press(&mut app, ">");
    key(&mut app, KeyCode::Tab);
    let text = screen_text(&mut app, 160, 48);
    assert_eq!(app.pane_scroll.offset, 0);
    if app.pane_scroll.most == 0 {
        press(&mut app, ">");
        screen_text(&mut app, 160, 48);
        assert_eq!(app.pane_scroll.offset, 0, "{text}");
    }
}

#[test]
fn the_help_at_80x24_shows_every_line_whole_when_scrolled() {
    let mut app = common::tiny_app("");
    press(&mut app, "?");
    let mut pages = vec![screen_text(&mut app, 80, 24)];
    let mut last = String::new();
    for _ in 0..60 {
        press(&mut app, "j");
        let page = screen_text(&mut app, 80, 24);
        if page == last {
            break;
        }
        last = page.clone();
        pages.push(page);
    }
    let seen = pages.join("\n");
    // Every key and the start and end of every description (they wrap at this width).
    for (keys, what) in app.keymap.help() {
        assert!(seen.contains(&keys), "{keys} never shown");
        let words: Vec<&str> = what.split(' ').collect();
        let (head, tail) = (words[0], words[words.len() - 1]);
        assert!(seen.contains(head) && seen.contains(tail), "{what}");
    }
    assert!(seen.contains("scroll the right pane (tensor / buffers / compare) down"));
    snapshot(
        "help_80x24",
        &format!("{}\n--- the end ---\n{}", pages[0], pages[pages.len() - 1]),
    );
}
