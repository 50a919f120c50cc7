//! Views over the main screen: help (made from the key map) and the fault injection menu.

use crate::engine::faults::{Fault, Scope};
use crate::tui::app::App;
use ratatui::layout::{Constraint, Flex, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Clear, Paragraph, Wrap};
use ratatui::Frame;

/// A centred box of at most `w` × `h`.
fn centred(area: Rect, w: u16, h: u16) -> Rect {
    let [v] = Layout::vertical([Constraint::Length(h.min(area.height))])
        .flex(Flex::Center)
        .areas(area);
    let [r] = Layout::horizontal([Constraint::Length(w.min(area.width))])
        .flex(Flex::Center)
        .areas(v);
    r
}

pub fn help(frame: &mut Frame, app: &App, area: Rect) {
    let t = &app.theme;
    let mut lines: Vec<Line> = app
        .keymap
        .help()
        .into_iter()
        .map(|(keys, what)| {
            Line::from(vec![
                Span::styled(format!("{keys:>14}  "), t.on()),
                Span::raw(what),
            ])
        })
        .collect();
    for text in [
        "commands: break SPEC · delete [SPEC|all] · breakpoints · goto N|first-divergent · run",
        "  step [N] · next · restart · bisect · compare · save FILE · load FILE · note TEXT · quit",
        "  set FLAG VALUE · set inject NAME[@prefill|@decode|@both] (replaces; +NAME adds)",
        "  set tokens 3,141,59 · set prefill K · set decode N (the run is recomputed)",
        "breakpoints: layer N · op [PHASE/]PATTERN · nan · zero · absmax>X · diff>X",
        "marks: ▶ position ● breakpoint · ok ≠ diverges ! NaN/Inf ? unwritten x disconnected",
    ] {
        lines.push(Line::from(Span::styled(text, t.dim())));
    }
    let h = lines.len() as u16 + 2;
    let r = centred(area, 92, h);
    frame.render_widget(Clear, r);
    frame.render_widget(
        Paragraph::new(lines).wrap(Wrap { trim: false }).block(
            Block::default()
                .borders(Borders::ALL)
                .title(Span::styled(" keys (any key closes) ", t.title())),
        ),
        r,
    );
}

pub fn inject(frame: &mut Frame, app: &App, area: Rect, selected: usize, scope: Scope) {
    let t = &app.theme;
    let faults = app.mirror.flags.faults;
    let lines: Vec<Line> = Fault::ALL
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let active = faults.scope(*f);
            // The selected row shows the scope Enter injects it in; the others, where they act
            // (or, dimmed, a default narrower than both phases).
            let (scope_text, style) = match (i == selected, active) {
                (true, _) => (format!("‹{}›", scope.name()), t.accent()),
                (false, Some(s)) => (format!(" {} ", s.name()), t.on()),
                (false, None) if f.default_scope() != Scope::All => {
                    (format!(" {} ", f.default_scope().name()), t.dim())
                }
                (false, None) => (String::new(), t.base()),
            };
            let line = Line::from(vec![
                Span::styled(
                    if active.is_some() { "[x] " } else { "[ ] " },
                    if active.is_some() { t.on() } else { t.base() },
                ),
                Span::raw(format!("{:<26}", f.name())),
                Span::styled(format!("{scope_text:<10}"), style),
                Span::styled(f.description(), t.dim()),
            ]);
            if i == selected {
                line.style(t.selected())
            } else {
                line
            }
        })
        .collect();
    let r = centred(area, 124, lines.len() as u16 + 2);
    frame.render_widget(Clear, r);
    frame.render_widget(
        Paragraph::new(lines).block(Block::default().borders(Borders::ALL).title(Span::styled(
            " inject a fault (Enter toggles it in the scope shown, ←/→ prefill/decode/both, Esc closes) ",
            t.title(),
        ))),
        r,
    );
}
