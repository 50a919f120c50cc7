//! Views over the main screen: help (made from the key map) and the fault injection menu.

use crate::engine::faults::Fault;
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
    lines.push(Line::from(""));
    lines.push(Line::from(Span::styled(
        "commands: break SPEC · delete SPEC · run · step [N] · next · restart · bisect · compare",
        t.dim(),
    )));
    lines.push(Line::from(Span::styled(
        "  set FLAG VALUE · save FILE · load FILE · note TEXT · quit",
        t.dim(),
    )));
    lines.push(Line::from(Span::styled(
        "breakpoints: layer N · op PATTERN · nan · zero · absmax>X · diff>X",
        t.dim(),
    )));
    lines.push(Line::from(Span::styled(
        "marks: ▶ position ● breakpoint · ok ≠ diverges ! NaN/Inf ? unwritten x disconnected",
        t.dim(),
    )));
    let h = lines.len() as u16 + 2;
    let r = centred(area, 90, h);
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

pub fn inject(frame: &mut Frame, app: &App, area: Rect, selected: usize) {
    let t = &app.theme;
    let faults = app.mirror.flags.faults;
    let lines: Vec<Line> = Fault::ALL
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let on = faults.contains(*f);
            let line = Line::from(vec![
                Span::styled(
                    if on { "[x] " } else { "[ ] " },
                    if on { t.on() } else { t.base() },
                ),
                Span::raw(format!("{:<26}", f.name())),
                Span::styled(f.description(), t.dim()),
            ]);
            if i == selected {
                line.style(t.selected())
            } else {
                line
            }
        })
        .collect();
    let r = centred(area, 110, lines.len() as u16 + 2);
    frame.render_widget(Clear, r);
    frame.render_widget(
        Paragraph::new(lines).block(Block::default().borders(Borders::ALL).title(Span::styled(
            " inject a fault (Enter toggles, Esc closes) ",
            t.title(),
        ))),
        r,
    );
}
