//! The execution tree: phase > layer > op, with the execution position (▶), breakpoints (●) and
//! a status mark per op (· ok, ≠ diverges from the comparison run, ! NaN/Inf, ? unwritten,
//! x disconnected). Layers start collapsed; each layer row sums its ops up in one line: the
//! largest difference from the comparison run (≠ beyond tolerance, Δ within) and its NaN/Inf
//! (!N) and unwritten (?N) elements.

use super::{op_mark, short_name};
use crate::debug::breakpoint::Breakpoint;
use crate::engine::trace::Phase;
use crate::tui::app::{App, LayerSummary, Node};
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
    // Rows collapse as the selection moves on: never leave blank rows below the last.
    app.scroll = app.scroll.min(rows.len().saturating_sub(height.max(1)));
    let run = app.mirror.current();
    let position = app.mirror.position().map(|e| e.index);
    // Layer numbers padded to one width, so that the summaries line up.
    let digits = app
        .mirror
        .info
        .as_ref()
        .map_or(1, |i| i.layers.end.saturating_sub(1).to_string().len());
    // At 80 columns the tree is about 30 wide: one digit of each difference then.
    let narrow = area.width < 36;
    let mut lines = Vec::new();
    for (i, row) in rows.iter().enumerate().skip(app.scroll).take(height) {
        let indent = "  ".repeat(row.depth as usize);
        let open = |n: Node| {
            if app.is_open(n) {
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
            Node::Layer(p, l) => {
                let bp = if app.mirror.breakpoints.contains(&Breakpoint::Layer(l)) {
                    "●"
                } else {
                    " "
                };
                let mut spans = vec![
                    Span::raw(format!("{indent}{} ", open(row.node))),
                    Span::styled(bp, t.bad()),
                    Span::raw(format!("layer {l:<digits$}")),
                ];
                if let Some(s) = app.layer_summary(p, l) {
                    spans.extend(summary(app, s, narrow));
                }
                Line::from(spans)
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

/// A layer row's summary: its largest difference from the comparison run and its NaN/Inf and
/// unwritten elements, each shown only when there is something to say.
fn summary(app: &App, s: &LayerSummary, narrow: bool) -> Vec<Span<'static>> {
    let t = &app.theme;
    let mut spans = Vec::new();
    if s.compared {
        let (mark, style) = if s.diverges {
            ("≠", t.diverge())
        } else {
            ("Δ", t.dim())
        };
        spans.push(Span::styled(
            format!(" {mark}{}", difference(s.max_error, narrow)),
            style,
        ));
    }
    if s.non_finite > 0 {
        spans.push(Span::styled(format!(" !{}", count(s.non_finite)), t.bad()));
    }
    if s.unwritten > 0 {
        spans.push(Span::styled(format!(" ?{}", count(s.unwritten)), t.warn()));
    }
    spans
}

/// A relative difference in a few characters: `3.2e-1`, or `3e-1` when narrow.
pub fn difference(v: f64, narrow: bool) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.is_nan() {
        "nan".into()
    } else if v.is_infinite() {
        "inf".into()
    } else if narrow {
        format!("{v:.0e}")
    } else {
        format!("{v:.1e}")
    }
}

/// An element count in at most four characters: `950`, `1.2k`, `48k`, `3.1M`.
pub fn count(n: usize) -> String {
    if n < 1000 {
        return n.to_string();
    }
    let mut v = n as f64 / 1e3;
    let mut units = ["k", "M", "G", "T"].into_iter().peekable();
    let mut unit = "k";
    while let Some(u) = units.next() {
        unit = u;
        if v < 999.5 || units.peek().is_none() {
            break;
        }
        v /= 1e3;
    }
    if v < 9.95 {
        format!("{v:.1}{unit}")
    } else {
        format!("{v:.0}{unit}")
    }
}
