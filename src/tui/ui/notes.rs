//! The notes pane: the note a tour stopped at (or a step passed), whole, between the panes and
//! the log. It grows with the note up to two fifths of the screen; a longer note scrolls.

use super::overlays::wrap;
use super::short_name;
use crate::tui::app::{App, NO_NOTES};
use crate::tui::keys::Action;
use ratatui::layout::Rect;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph};
use ratatui::Frame;

/// The note's text as the pane shows it, wrapped to `width` columns.
fn body(app: &App, width: u16) -> Vec<String> {
    let width = width.saturating_sub(2).max(8) as usize;
    let text = match app.tour.current() {
        Some((_, a)) => a.text.clone(),
        None if app.tour.notes.is_empty() => NO_NOTES.to_string(),
        None => format!(
            "No note reached yet: {} goes to the first of {}.",
            app.keymap.key_of(Action::NextNote),
            app.tour.notes.len()
        ),
    };
    wrap(&text, width)
}

/// The rows the pane takes on a screen of `area` (0 when it is closed).
pub fn height(app: &App, area: Rect) -> u16 {
    if !app.tour.open {
        return 0;
    }
    // The flags bar, a two-row log and the status line stay, and the panes keep 8 rows.
    let most = (area.height.saturating_sub(2) * 2 / 5)
        .max(4)
        .min(area.height.saturating_sub(12));
    (body(app, area.width).len() as u16 + 2).min(most)
}

pub fn draw(frame: &mut Frame, app: &mut App, area: Rect) {
    if area.height < 3 {
        return;
    }
    let t = app.theme;
    let lines = body(app, area.width);
    let shown = area.height.saturating_sub(2) as usize;
    let most = lines.len().saturating_sub(shown) as u16;
    app.tour.scroll = app.tour.scroll.min(most);
    let title = match app.tour.current() {
        Some((i, a)) => {
            let about = a.about.as_ref().map_or(String::new(), |c| {
                format!(" · {} {}", c.phase, short_name(&c.op))
            });
            let pane = a.pane.map_or(String::new(), |p| format!(" · {}", p.name()));
            format!(" note {} of {}{about}{pane} ", i + 1, app.tour.notes.len())
        }
        None => " notes ".to_string(),
    };
    let key = |a| app.keymap.key_of(a);
    let mut hint = format!(
        " {} next · {} previous · {} hides ",
        key(Action::NextNote),
        key(Action::PreviousNote),
        key(Action::Notes)
    );
    if most > 0 {
        hint = format!(
            " {}/{} scroll ({}/{}) ·{hint}",
            key(Action::NotesDown),
            key(Action::NotesUp),
            app.tour.scroll + 1,
            most + 1
        );
    }
    let text: Vec<Line> = lines.into_iter().map(Line::from).collect();
    frame.render_widget(
        Paragraph::new(text).scroll((app.tour.scroll, 0)).block(
            Block::default()
                .borders(Borders::ALL)
                .title(Span::styled(title, t.title()))
                .title_bottom(Line::from(Span::styled(hint, t.dim())).right_aligned()),
        ),
        area,
    );
}
