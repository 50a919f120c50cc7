//! The execution tree: phase > layer > op, with the execution position (▶), breakpoints (●) and
//! a status mark per op (· ok, ≠ diverges from the comparison run, ! NaN/Inf, ? unwritten,
//! x disconnected).

use super::{op_mark, short_name};
use crate::debug::breakpoint::Breakpoint;
use crate::engine::trace::Phase;
use crate::tui::app::{App, Node};
use ratatui::layout::Rect;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph};
use ratatui::Frame;

pub fn draw(frame: &mut Frame, app: &mut App, area: Rect) {
    app.areas.tree = area;
    let t = app.theme;
    let rows = app.rows();
    let height = area.height.saturating_sub(2) as usize;
    let selected = app
        .selected
        .and_then(|s| rows.iter().position(|r| r.node == s));
    // Keep the selection in view.
    if let Some(sel) = selected {
        if sel < app.scroll {
            app.scroll = sel;
        } else if height > 0 && sel >= app.scroll + height {
            app.scroll = sel + 1 - height;
        }
    }
    app.scroll = app.scroll.min(rows.len().saturating_sub(1));
    let run = app.mirror.current();
    let position = app.mirror.position().map(|e| e.index);
    let mut lines = Vec::new();
    for (i, row) in rows.iter().enumerate().skip(app.scroll).take(height) {
        let indent = "  ".repeat(row.depth as usize);
        let open = |n: Node| {
            if app.expanded.contains(&n) {
                "▾"
            } else {
                "▸"
            }
        };
        let mut line = match row.node {
            Node::Phase(p) => {
                let tokens = run
                    .and_then(|r| r.events.iter().find(|e| e.phase == p))
                    .map(|e| e.positions.1 - e.positions.0)
                    .unwrap_or(0);
                let label = match p {
                    Phase::Prefill => format!("prefill ({tokens} tokens)"),
                    Phase::Decode(_) => format!("{p}"),
                };
                Line::from(vec![
                    Span::raw(format!("{indent}{} ", open(row.node))),
                    Span::styled(label, t.title()),
                ])
            }
            Node::Layer(_, l) => {
                let bp = if app.mirror.breakpoints.contains(&Breakpoint::Layer(l)) {
                    "●"
                } else {
                    " "
                };
                Line::from(vec![
                    Span::raw(format!("{indent}{} ", open(row.node))),
                    Span::styled(bp, t.bad()),
                    Span::raw(format!("layer {l}")),
                ])
            }
            Node::Op(index) => match run.and_then(|r| r.events.get(index)) {
                Some(e) => {
                    let here = if position == Some(index) { "▶" } else { " " };
                    let bp = app.mirror.breakpoints.iter().any(|b| b.matches_op(e));
                    let (mark, style) = op_mark(app, index, e);
                    let mut spans = vec![
                        Span::raw(indent.to_string()),
                        Span::styled(here, t.accent()),
                        Span::styled(if bp { "●" } else { " " }, t.bad()),
                        Span::styled(mark, style),
                        Span::raw(match e.rank {
                            Some(r) if app.rank_view.is_none() => {
                                format!(" r{r} {}", short_name(&e.name))
                            }
                            _ => format!(" {}", short_name(&e.name)),
                        }),
                    ];
                    // The reference's column: how far the other engine is from this op.
                    if let Some((diverges, error)) = app.judged_against_reference(index) {
                        let style = if diverges { t.diverge() } else { t.dim() };
                        spans.push(Span::styled(format!("  ref {}", super::num(error)), style));
                    }
                    Line::from(spans)
                }
                None => Line::from(""),
            },
        };
        if Some(i) == selected {
            line = line.style(t.selected());
        }
        lines.push(line);
    }
    let shown = app
        .rank_view
        .map_or(String::new(), |r| format!(" · rank {r}"));
    let title = format!(" execution · {}{shown} ", run.map_or(0, |r| r.len()));
    frame.render_widget(
        Paragraph::new(lines).block(
            Block::default()
                .borders(Borders::ALL)
                .title(Span::styled(title, t.title())),
        ),
        area,
    );
}
