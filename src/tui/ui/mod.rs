//! Drawing: one function per pane, all reading the [`App`] state. Usable from 80×24 up.
//!
//! ```text
//! flags bar ............................................................
//! execution tree        │ [Tensor] [Buffers] [Compare]
//!   phase > layer > op  │ the selected op
//! log ..................................................................
//! status line / command line / progress gauge ..........................
//! ```

mod buffers;
mod compare;
mod header;
mod learn;
mod notes;
mod overlays;
mod tensor;
mod tree;

use super::app::{App, Overlay, Tab};
use super::keys::Action;
use crate::debug::compare::{compare_outputs, Diff};
use crate::debug::controller::Stop;
use crate::engine::trace::OpEvent;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Gauge, Paragraph, Tabs, Wrap};
use ratatui::Frame;

/// Draws the whole screen. The event loop brings the comparisons up to date after each update
/// and input; a caller that changed the view directly (a test setting the tab) gets them here,
/// before the panes, which only read the state.
pub fn draw(frame: &mut Frame, app: &mut App) {
    app.refresh_comparisons();
    let area = frame.area();
    // The notes pane, when open, takes rows from the log (two stay) and the panes.
    let notes_rows = notes::height(app, area);
    let log_rows = if notes_rows > 0 { 2 } else { 4 };
    let header_rows = header::height(app, area.width);
    let [flags, main, notes_area, log, status] = Layout::vertical([
        Constraint::Length(header_rows),
        Constraint::Min(8),
        Constraint::Length(notes_rows),
        Constraint::Length(log_rows),
        Constraint::Length(1),
    ])
    .areas(area);
    flags_bar(frame, app, flags);
    let [left, right] = Layout::horizontal([
        Constraint::Percentage(app.tree_percent),
        Constraint::Percentage(100 - app.tree_percent),
    ])
    .areas(main);
    tree::draw(frame, app, left);
    right_pane(frame, app, right);
    log_pane(frame, app, log);
    status_line(frame, app, status);
    if notes_rows > 0 {
        notes::draw(frame, app, notes_area);
    }
    // The Learn view leaves the notes pane below it in view.
    let above_notes = Rect {
        height: if notes_rows > 0 {
            notes_area.y - area.y
        } else {
            area.height
        },
        ..area
    };
    match &app.overlay {
        Overlay::Help => overlays::help(frame, app, area),
        Overlay::Learn { scroll } => {
            let wanted = *scroll;
            let kept = learn::draw(frame, app, above_notes, wanted);
            app.overlay = Overlay::Learn { scroll: kept };
        }
        Overlay::Inject { selected, scope } => {
            overlays::inject(frame, app, area, *selected, *scope)
        }
        Overlay::Command { .. } | Overlay::Search { .. } | Overlay::None => {}
    }
}

fn flags_bar(frame: &mut Frame, app: &App, area: Rect) {
    frame.render_widget(Paragraph::new(header::lines(app, area.width)), area);
}

fn right_pane(frame: &mut Frame, app: &mut App, area: Rect) {
    let t = app.theme;
    let [tabs, body] = Layout::vertical([Constraint::Length(1), Constraint::Min(1)]).areas(area);
    app.areas.tabs = tabs;
    let titles: Vec<Line> = Tab::ALL.iter().map(|t| Line::from(t.title())).collect();
    let selected = Tab::ALL.iter().position(|x| *x == app.tab).unwrap_or(0);
    frame.render_widget(
        Tabs::new(titles)
            .select(selected)
            .highlight_style(t.selected())
            .divider("│"),
        tabs,
    );
    let block = Block::default().borders(Borders::ALL).title(Span::styled(
        match app.selected_op() {
            Some((_, e)) => format!(" {} · {} ", e.phase, short_name(&e.name)),
            None => " no op selected ".to_string(),
        },
        t.title(),
    ));
    let inner = block.inner(body);
    app.areas.pane = inner;
    let scroll = app.pane_scroll.offset_for(app.tab, app.selected);
    let most = match app.tab {
        Tab::Tensor => tensor::draw(frame, app, inner, scroll),
        Tab::Buffers => buffers::draw(frame, app, inner, scroll),
        Tab::Compare => compare::draw(frame, app, inner, scroll),
    };
    app.pane_scroll.drawn(most);
    // Content taller than the pane says so, and where it stands, on the bottom border.
    let block = if most > 0 {
        let key = |a| app.keymap.key_of(a);
        let hint = format!(
            " {}/{} scroll ({}/{}) ",
            key(Action::PaneDown),
            key(Action::PaneUp),
            app.pane_scroll.offset + 1,
            most + 1
        );
        block.title_bottom(Line::from(Span::styled(hint, t.dim())).right_aligned())
    } else {
        block
    };
    frame.render_widget(block, body);
}

/// Draws a pane's lines wrapped to `area` from line `scroll` on; returns how many lines are
/// below the pane when it shows the first (how far it can scroll).
fn scrolled(frame: &mut Frame, lines: Vec<Line>, area: Rect, scroll: u16) -> u16 {
    let text = Paragraph::new(lines).wrap(Wrap { trim: false });
    let most = (text.line_count(area.width) as u16).saturating_sub(area.height);
    frame.render_widget(text.scroll((scroll.min(most), 0)), area);
    most
}

fn log_pane(frame: &mut Frame, app: &App, area: Rect) {
    let lines: Vec<Line> = app
        .log
        .iter()
        .rev()
        .take(area.height.saturating_sub(1) as usize)
        .rev()
        .map(|l| Line::from(l.as_str()))
        .collect();
    frame.render_widget(
        Paragraph::new(lines)
            .block(
                Block::default()
                    .borders(Borders::TOP)
                    .title(Span::styled(" log ", app.theme.dim())),
            )
            .wrap(Wrap { trim: false }),
        area,
    );
}

fn status_line(frame: &mut Frame, app: &App, area: Rect) {
    let t = &app.theme;
    match &app.overlay {
        Overlay::Command { input } => {
            frame.render_widget(Paragraph::new(format!(":{input}█")), area);
            return;
        }
        Overlay::Search { input } => {
            frame.render_widget(Paragraph::new(format!("/{input}█")), area);
            return;
        }
        _ => {}
    }
    if let (Some(what), Some(p)) = (&app.mirror.busy, app.progress()) {
        let eta = app
            .time_left_text()
            .map_or(String::new(), |t| format!(" · {t}"));
        let gauge = Gauge::default()
            .ratio(p)
            .label(format!("{what}: {:.0}%{eta} · Esc cancels", p * 100.0))
            .gauge_style(t.accent());
        frame.render_widget(gauge, area);
        return;
    }
    let m = &app.mirror;
    let state = match (&m.busy, m.current(), &m.last_stop) {
        (_, None, _) => "starting".to_string(),
        (Some(what), _, _) => format!("running: {what}"),
        (_, Some(r), _) if r.finished() => "finished".to_string(),
        (_, Some(r), _) if r.error.is_some() => "failed".to_string(),
        (_, _, Some(Stop::Breakpoint(b))) => match m.breakpoints.get(*b) {
            Some(bp) => format!("paused at breakpoint {bp}"),
            None => "paused at a breakpoint".to_string(),
        },
        (_, _, Some(Stop::Cancelled)) => "paused (cancelled)".to_string(),
        _ => "paused".to_string(),
    };
    // A search's or jump's result, until the next key, in place of the position.
    if let Some(notice) = &app.notice {
        let line = Line::from(vec![
            Span::styled(format!(" {state} "), t.selected()),
            Span::styled(format!(" {notice} "), t.on()),
        ]);
        frame.render_widget(Paragraph::new(line), area);
        return;
    }
    let position = match m.position() {
        Some(e) => format!(
            "#{} {} {}{}",
            e.index,
            e.phase,
            e.layer.map(|l| format!("L{l} ")).unwrap_or_default(),
            short_name(&e.name)
        ),
        None => "before the first op".to_string(),
    };
    let run = match m.comparison {
        Some(c) => format!("run {} (vs {c})", m.current_number()),
        None => format!("run {}", m.current_number()),
    };
    let line = Line::from(vec![
        Span::styled(format!(" {state} "), t.selected()),
        Span::raw(format!(
            " {position} · {run} · {} ops ",
            m.current().map_or(0, |r| r.len())
        )),
        Span::styled(
            format!("· {} help ", app.keymap.key_of(super::keys::Action::Help)),
            t.dim(),
        ),
    ]);
    frame.render_widget(Paragraph::new(line), area);
}

/// An op name without its layer prefix (`self_attn.q_b_proj` for `model.layers.3.self_attn.q_b_proj`).
pub fn short_name(name: &str) -> &str {
    if let Some(rest) = name.strip_prefix("model.layers.") {
        if let Some((_, op)) = rest.split_once('.') {
            return op;
        }
        return name;
    }
    name
}

/// How op `index` compares with the same op of the comparison run (`None`: no comparison run,
/// or it has no such op; `Err`: why there are no figures).
pub fn diff_with_comparison(app: &App, index: usize) -> Option<Result<Diff, String>> {
    let run = app.mirror.current()?;
    let other = app.mirror.comparison_run()?;
    let e = run.events.get(index)?;
    let j = other.find_for(e, &e.name)?;
    let heads = app.mirror.layout()?.num_heads;
    Some(output_diff(
        e,
        &run.outputs[index],
        &other.events[j],
        &other.outputs[j],
        heads,
    ))
}

/// Two outputs of one op compared: whole outputs fully; in a replay of samples, the recorded
/// values, which are the same elements when the two outputs are of one size.
pub fn output_diff(
    e: &OpEvent,
    a: &crate::tensor::Tensor,
    other: &OpEvent,
    b: &crate::tensor::Tensor,
    heads: usize,
) -> Result<Diff, String> {
    compare_outputs(e, e.index, a.data(), &other.shape, b.data(), heads).diff
}

/// A status mark for an op: disconnected, unwritten, NaN/Inf, diverging from the comparison
/// run, or ok.
pub fn op_mark(app: &App, index: usize, e: &OpEvent) -> (&'static str, Style) {
    let t = &app.theme;
    let health = crate::tui::app::op_health(e);
    if health.disconnected {
        return ("x", t.bad());
    }
    if health.unwritten > 0 {
        return ("?", t.warn());
    }
    if health.non_finite > 0 {
        return ("!", t.bad());
    }
    if app
        .judged_against_comparison(index)
        .is_some_and(|(diverges, _)| diverges)
    {
        return ("≠", t.diverge());
    }
    ("·", t.ok())
}

/// A number in a short, fixed-width-friendly form.
pub fn num(v: f64) -> String {
    if v.is_nan() {
        "nan".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+inf" } else { "-inf" }.into()
    } else if v != 0.0 && (v.abs() >= 1e4 || v.abs() < 1e-3) {
        format!("{v:.2e}")
    } else {
        format!("{v:.4}")
    }
}
