//! Views over the main screen: help (made from the key map) and the fault injection menu.

use crate::engine::faults::{Fault, Scope};
use crate::tui::app::App;
use crate::tui::keys::Action;
use ratatui::layout::{Constraint, Flex, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Clear, Paragraph};
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

/// The help: every key from the key map, then the commands and what the tree's marks mean.
/// Lines are wrapped to the box here, so that j/k scroll it exactly where it does not fit
/// (80×24 among others).
pub fn help(frame: &mut Frame, app: &mut App, area: Rect) {
    let t = app.theme;
    let r = centred(area, 92, area.height);
    let width = r.width.saturating_sub(2).max(20) as usize;
    let mut lines: Vec<Line> = Vec::new();
    for (keys, what) in app.keymap.help() {
        for (n, part) in wrap(what, width.saturating_sub(16)).into_iter().enumerate() {
            let keys = if n == 0 { keys.as_str() } else { "" };
            lines.push(Line::from(vec![
                Span::styled(format!("{keys:>14}  "), t.on()),
                Span::raw(part),
            ]));
        }
    }
    for text in [
        "commands: break SPEC · delete [SPEC|all] · breakpoints · goto N|first-divergent|layer N",
        "  run · step [N] · next · restart · bisect · compare · save FILE · load FILE · note TEXT · quit",
        "  set FLAG VALUE · set inject NAME[@prefill|@decode|@both] (replaces; +NAME adds)",
        "  set tokens 3,141,59 · set prefill K · set decode N (the run is recomputed)",
        "breakpoints: layer N · op [PHASE/]PATTERN · nan · zero · absmax>X · diff>X",
        "marks: ▶ position ● breakpoint · ok ≠ diverges ! NaN/Inf ? unwritten x disconnected",
        "layer rows: ≠/Δ largest difference from the comparison run (beyond / within tolerance) · !N NaN/Inf elements · ?N unwritten elements",
    ] {
        for (n, part) in wrap(text, width.saturating_sub(2)).into_iter().enumerate() {
            let indent = if n == 0 { "" } else { "  " };
            lines.push(Line::from(Span::styled(format!("{indent}{part}"), t.dim())));
        }
    }
    let h = (lines.len() as u16 + 2).min(area.height);
    let r = centred(area, 92, h);
    let shown = r.height.saturating_sub(2) as usize;
    let most = lines.len().saturating_sub(shown) as u16;
    app.help_scroll = app.help_scroll.min(most);
    let title = if most > 0 {
        let (down, up) = (
            app.keymap.key_of(Action::Down),
            app.keymap.key_of(Action::Up),
        );
        format!(" keys ({down}/{up} scroll, any other key closes) ")
    } else {
        " keys (any key closes) ".to_string()
    };
    frame.render_widget(Clear, r);
    frame.render_widget(
        Paragraph::new(lines).scroll((app.help_scroll, 0)).block(
            Block::default()
                .borders(Borders::ALL)
                .title(Span::styled(title, t.title())),
        ),
        r,
    );
}

/// `text` cut into lines of at most `width` characters, at spaces where it can be.
pub(super) fn wrap(text: &str, width: usize) -> Vec<String> {
    // Leading spaces indent every line.
    let body = text.trim_start();
    let lead = &text[..text.len() - body.len()];
    let width = width.saturating_sub(lead.len()).max(8);
    let mut out = Vec::new();
    let mut line = String::new();
    for word in body.split(' ') {
        let (have, add) = (line.chars().count(), word.chars().count());
        if have > 0 && have + 1 + add > width {
            out.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
        // A word longer than a line is cut.
        while line.chars().count() > width {
            let cut: String = line.chars().take(width).collect();
            line = line.chars().skip(width).collect();
            out.push(cut);
        }
    }
    if !line.is_empty() || out.is_empty() {
        out.push(line);
    }
    out.into_iter().map(|l| format!("{lead}{l}")).collect()
}

/// The fault menu. Where the screen is too narrow for the descriptions (80 columns), each row's
/// is cut short and the selected fault's is shown whole below the list; where it is too short
/// for every row, the list scrolls with the selection.
pub fn inject(frame: &mut Frame, app: &App, area: Rect, selected: usize, scope: Scope) {
    let t = &app.theme;
    let faults = app.mirror.flags.faults;
    const LEAD: usize = 4 + 26 + 10;
    let longest = Fault::ALL
        .iter()
        .map(|f| f.description().chars().count())
        .max()
        .unwrap_or(0);
    let r = centred(area, (LEAD + longest + 2) as u16, area.height);
    let inner = r.width.saturating_sub(2) as usize;
    let room = inner.saturating_sub(LEAD);
    let cut = room < longest;
    let rows: Vec<Line> = Fault::ALL
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
            let about = f.description();
            let about = if about.chars().count() > room {
                let kept: String = about.chars().take(room.saturating_sub(1)).collect();
                format!("{kept}…")
            } else {
                about.to_string()
            };
            let line = Line::from(vec![
                Span::styled(
                    if active.is_some() { "[x] " } else { "[ ] " },
                    if active.is_some() { t.on() } else { t.base() },
                ),
                Span::raw(format!("{:<26}", f.name())),
                Span::styled(format!("{scope_text:<10}"), style),
                Span::styled(about, t.dim()),
            ]);
            if i == selected {
                line.style(t.selected())
            } else {
                line
            }
        })
        .collect();
    // The selected fault's description, whole, under a rule.
    let mut footer: Vec<Line> = Vec::new();
    if cut {
        let fault = Fault::ALL[selected.min(Fault::ALL.len() - 1)];
        footer.push(Line::from(Span::styled("─".repeat(inner), t.dim())));
        let text = format!("{}: {}", fault.name(), fault.description());
        footer.extend(wrap(&text, inner).into_iter().map(Line::from));
    }
    let shown = (area.height.saturating_sub(2) as usize)
        .saturating_sub(footer.len())
        .clamp(1, rows.len());
    let first = selected.saturating_sub(shown - 1);
    let mut lines: Vec<Line> = rows.into_iter().skip(first).take(shown).collect();
    lines.extend(footer);
    let r = centred(area, r.width, lines.len() as u16 + 2);
    frame.render_widget(Clear, r);
    frame.render_widget(
        Paragraph::new(lines).block(
            Block::default()
                .borders(Borders::ALL)
                .title(Span::styled(" inject a fault ", t.title()))
                .title_bottom(
                    Line::from(Span::styled(
                        " Enter toggles it in the scope shown · ←/→ prefill/decode/both · Esc closes ",
                        t.dim(),
                    ))
                    .right_aligned(),
                ),
        ),
        r,
    );
}
