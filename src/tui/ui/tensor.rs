//! The tensor view of the selected op: shape and dtype, every statistic of the trace, a
//! histogram, values from the start and the end, per-head figures for attention ops, and a heat
//! map of attention probabilities in half-block cells.

use super::{diff_with_comparison, num};
use crate::debug::compare::{heads_of, Heads};
use crate::debug::sample::is_sampled;
use crate::engine::trace::OpKind;
use crate::tensor::Tensor;
use crate::tui::app::App;
use ratatui::layout::Rect;
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

/// Returns how far the pane can scroll (see [`super::scrolled`]).
pub fn draw(frame: &mut Frame, app: &App, area: Rect, scroll: u16) -> u16 {
    let t = &app.theme;
    let Some((index, e)) = app.selected_op() else {
        frame.render_widget(
            Paragraph::new("Select an op in the execution tree (j/k, Enter)."),
            area,
        );
        return 0;
    };
    let run = app.mirror.current().expect("an op is selected");
    let out = &run.outputs[index];
    let s = &e.stats;
    let label = |k: &str| Span::styled(format!("{k} "), t.dim());
    let mut lines = vec![
        Line::from(vec![
            label("kind"),
            Span::raw(e.kind.name()),
            label(" shape"),
            Span::raw(format!("{:?}", e.shape)),
            label(" dtype"),
            Span::raw(e.dtype.name()),
            if e.replayed {
                Span::styled("  (reused)", t.dim())
            } else {
                Span::raw("")
            },
        ]),
        Line::from(vec![
            label("min"),
            Span::raw(num(s.min)),
            label("  max"),
            Span::raw(num(s.max)),
            label("  mean"),
            Span::raw(num(s.mean)),
            label("  std"),
            Span::raw(num(s.std)),
        ]),
        Line::from(vec![
            label("abs-max"),
            Span::raw(num(s.abs_max)),
            label("  L2"),
            Span::raw(num(s.l2)),
            label("  zeros"),
            Span::raw(s.zeros.to_string()),
            label("  of"),
            Span::raw(s.count.to_string()),
        ]),
        Line::from(vec![
            label("nan"),
            Span::styled(
                s.nan.to_string(),
                if s.nan > 0 { t.bad() } else { t.base() },
            ),
            label("  +inf"),
            Span::raw(s.pos_inf.to_string()),
            label("  -inf"),
            Span::raw(s.neg_inf.to_string()),
            label("  unwritten"),
            Span::styled(
                s.unwritten.to_string(),
                if s.unwritten > 0 { t.warn() } else { t.base() },
            ),
        ]),
    ];
    // Under tensor parallelism: the same op on every rank, a line each.
    if e.rank.is_some() {
        let ranks = (0..run.flags.tp).filter_map(|r| {
            let j = run.find_at(e.phase, Some(r), &e.name)?;
            Some((r, &run.events[j]))
        });
        for (r, other) in ranks {
            let s = &other.stats;
            let style = if other.index == e.index {
                t.accent()
            } else {
                t.base()
            };
            lines.push(Line::from(vec![
                Span::styled(format!("rank {r} "), style),
                label("min"),
                Span::raw(num(s.min)),
                label("  max"),
                Span::raw(num(s.max)),
                label("  L2"),
                Span::raw(num(s.l2)),
                label("  nan"),
                Span::raw(s.nan.to_string()),
                label(" shape"),
                Span::raw(format!("{:?}", other.shape)),
            ]));
        }
    }
    let sampled = is_sampled(e, out);
    let histogram = if sampled {
        None
    } else {
        histogram(
            out.data(),
            s.min,
            s.max,
            (area.width as usize).saturating_sub(36).clamp(8, 48),
        )
    };
    if let Some(h) = histogram {
        lines.push(Line::from(vec![
            label("histogram"),
            Span::styled(h, t.accent()),
            Span::styled(format!(" [{}, {}]", num(s.min), num(s.max)), t.dim()),
        ]));
    }
    let show = |v: &[f32]| {
        v.iter()
            .map(|x| num(*x as f64))
            .collect::<Vec<_>>()
            .join(" ")
    };
    // A sample starts with the first values and ends with the last ones.
    let n = out.numel();
    let k = 4.min(n);
    lines.push(Line::from(vec![
        label("first"),
        Span::raw(show(&out.data()[..k])),
    ]));
    lines.push(Line::from(vec![
        label("last "),
        Span::raw(show(&out.data()[n - k..])),
    ]));
    if sampled {
        lines.push(Line::from(Span::styled(
            format!(
                "replay: {n} of {} values recorded (no histogram, per-head figures or heat map)",
                s.count
            ),
            t.dim(),
        )));
        return super::scrolled(frame, lines, area, scroll);
    }
    let heads = app.heads_of_op(e);
    if let Some(layout) = heads_of(e, heads) {
        lines.push(Line::from(Span::styled("per head: abs-max / L2", t.dim())));
        let per = per_head(out, layout, heads);
        let compared = diff_with_comparison(app, index)
            .and_then(|d| d.ok())
            .map(|d| d.per_head);
        let mut row = Vec::new();
        for (h, (absmax, l2)) in per.iter().enumerate().take(16) {
            let mut text = format!("h{h} {}/{}", num(*absmax as f64), num(*l2));
            if let Some(Some(d)) = compared.as_ref().map(|c| c.get(h)) {
                text.push_str(&format!(" Δ{}", num(*d)));
            }
            row.push(Span::styled(
                format!("{text:<24}"),
                if h == app.head % heads {
                    t.on()
                } else {
                    t.base()
                },
            ));
            if row.len() == 2 {
                lines.push(Line::from(std::mem::take(&mut row)));
            }
        }
        if !row.is_empty() {
            lines.push(Line::from(row));
        }
    }
    // [heads, queries, keys], as the op reported it and as held.
    if e.kind == OpKind::AttentionProbs
        && e.shape.len() == 3
        && e.shape[0] > 0
        && out.shape() == e.shape.as_slice()
    {
        let used = lines.len() as u16 + 1;
        let rows = area.height.saturating_sub(used) as usize;
        lines.push(Line::from(Span::styled(
            format!(
                "head {} of {} (h: next head) · queries ↓ keys →",
                app.head % e.shape[0],
                e.shape[0]
            ),
            t.dim(),
        )));
        lines.extend(heat_map(
            app,
            out,
            app.head % e.shape[0],
            rows,
            area.width as usize,
        ));
    }
    super::scrolled(frame, lines, area, scroll)
}

/// A one-line histogram of the finite values over [min, max].
fn histogram(values: &[f32], min: f64, max: f64, bins: usize) -> Option<String> {
    if !(min.is_finite() && max.is_finite()) || values.is_empty() {
        return None;
    }
    let mut counts = vec![0usize; bins];
    let span = (max - min).max(f64::MIN_POSITIVE);
    for &v in values {
        if v.is_finite() {
            let b = (((v as f64 - min) / span) * bins as f64) as usize;
            counts[b.min(bins - 1)] += 1;
        }
    }
    let top = *counts.iter().max()? as f64;
    Some(
        counts
            .iter()
            .map(|&c| {
                if c == 0 {
                    ' '
                } else {
                    BARS[((c as f64 / top) * 7.0).round() as usize]
                }
            })
            .collect(),
    )
}

/// abs-max and L2 of each head.
fn per_head(t: &Tensor, layout: Heads, heads: usize) -> Vec<(f32, f64)> {
    let shape = t.shape();
    let mut acc = vec![(0f32, 0f64); heads];
    for (i, &v) in t.data().iter().enumerate() {
        let h = match layout {
            Heads::Axis(axis) => {
                let inner: usize = shape[axis + 1..].iter().product();
                i / inner % shape[axis]
            }
            Heads::Packed(n) => {
                let cols = *shape.last().expect("a packed tensor has columns");
                i % cols / (cols / n)
            }
        };
        if let Some(slot) = acc.get_mut(h) {
            if v.is_finite() {
                slot.0 = slot.0.max(v.abs());
                slot.1 += (v as f64) * (v as f64);
            }
        }
    }
    acc.into_iter().map(|(m, s)| (m, s.sqrt())).collect()
}

/// Attention probabilities of one head as half-block cells: each character shows two query rows
/// (upper half, lower half); larger maps are max-pooled to fit. Without colour, shades.
fn heat_map(
    app: &App,
    probs: &Tensor,
    head: usize,
    rows: usize,
    width: usize,
) -> Vec<Line<'static>> {
    let (n, ctx) = (probs.shape()[1], probs.shape()[2]);
    let cols = ctx.min(width.max(1));
    let pixel_rows = n.min(rows * 2).max(1);
    let data = &probs.data()[head * n * ctx..(head + 1) * n * ctx];
    let cell = |r: usize, c: usize| -> f32 {
        let (r0, r1) = (
            r * n / pixel_rows,
            ((r + 1) * n / pixel_rows).max(r * n / pixel_rows + 1),
        );
        let (c0, c1) = (
            c * ctx / cols,
            ((c + 1) * ctx / cols).max(c * ctx / cols + 1),
        );
        let mut m = 0f32;
        for q in r0..r1.min(n) {
            for k in c0..c1.min(ctx) {
                m = m.max(data[q * ctx + k]);
            }
        }
        m
    };
    let t = &app.theme;
    let mut lines = Vec::new();
    for r in (0..pixel_rows).step_by(2) {
        let mut spans = Vec::new();
        for c in 0..cols {
            let top = cell(r, c);
            let bottom = if r + 1 < pixel_rows {
                cell(r + 1, c)
            } else {
                0.0
            };
            match (t.heat(top), t.heat(bottom)) {
                (Some(fg), Some(bg)) => spans.push(Span::styled("▀", Style::new().fg(fg).bg(bg))),
                _ => {
                    let shade = [' ', '░', '▒', '▓', '█']
                        [((top.max(bottom)) * 4.0).round().clamp(0.0, 4.0) as usize];
                    spans.push(Span::raw(shade.to_string()));
                }
            }
        }
        lines.push(Line::from(spans));
    }
    lines
}
