//! The buffers of the selected op: the one it wrote (id, device pointer, bytes), the one its
//! kernel really wrote when it was handed one, what it read and who wrote that, who reads its
//! output, unwritten elements, and the attention chain of its layer.

use super::short_name;
use crate::debug::forensics::{attention_chain_of_rank, consumers};
use crate::debug::RunRecord;
use crate::engine::trace::{BufferRef, BufferRole, OpEvent};
use crate::tui::app::App;
use ratatui::layout::Rect;
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

fn buf(b: &BufferRef) -> String {
    // Fixed widths: ids and addresses line up, and the layout does not shift with them.
    // A buffer on a device other than the first says which (ranks of a tensor-parallel run).
    let device = match (b.device, b.device_index) {
        (crate::engine::trace::Device::Cuda, d) if d > 0 => format!(" cuda:{d}"),
        _ => String::new(),
    };
    format!(
        "buf {:<7} @{:#014x} {}{device}",
        b.id.0,
        b.address,
        bytes(b.bytes)
    )
}

fn bytes(n: usize) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

/// Returns how far the pane can scroll (see [`super::scrolled`]).
pub fn draw(frame: &mut Frame, app: &App, area: Rect, scroll: u16) -> u16 {
    let t = &app.theme;
    let Some((index, e)) = app.selected_op() else {
        frame.render_widget(Paragraph::new("Select an op to see its buffers."), area);
        return 0;
    };
    let run = app.mirror.current().expect("an op is selected");
    let label = |k: &str| Span::styled(format!("{k:<9}"), t.dim());
    let role = |r: BufferRole| format!("{r:?}").to_lowercase();
    let mut lines = vec![Line::from(vec![
        label("output"),
        Span::raw(buf(&e.output)),
        Span::styled(format!("  {}", role(e.output.role)), t.dim()),
    ])];
    if let Some(k) = e.kernel_wrote {
        if k.id == e.output.id {
            lines.push(Line::from(vec![
                label("kernel"),
                Span::styled("wrote this same buffer ✓", t.ok()),
            ]));
        } else {
            lines.push(Line::from(vec![
                label("kernel"),
                Span::styled(format!("wrote {} ✗ DISCONNECTED", buf(&k)), t.bad()),
            ]));
        }
    }
    if let Some(info) = &e.kernel {
        for l in &info.launches {
            lines.push(Line::from(vec![label("launch"), Span::raw(l.to_string())]));
        }
        if let Some(why) = &info.reference {
            lines.push(Line::from(vec![
                label("launch"),
                Span::styled(format!("reference kernel: {why}"), t.dim()),
            ]));
        }
    }
    // The chain comes before the lists of buffers, so that a disconnect shows on a small screen.
    lines.extend(chain_lines(app, run, e));
    let s = &e.stats;
    lines.push(Line::from(vec![
        label("written"),
        Span::raw(format!("{} of {} elements", s.count - s.unwritten, s.count)),
        if s.unwritten > 0 {
            Span::styled(format!("  {} unwritten (poison)", s.unwritten), t.warn())
        } else {
            Span::raw("")
        },
    ]));
    let readers: Vec<String> = consumers(run, index)
        .into_iter()
        .map(|j| format!("#{j} {}", short_name(&run.events[j].name)))
        .collect();
    lines.push(Line::from(vec![
        label("read by"),
        Span::raw(if readers.is_empty() {
            "no later op (yet)".to_string()
        } else {
            readers.join(", ")
        }),
    ]));
    lines.push(Line::from(Span::styled("reads", t.dim())));
    for r in &e.inputs {
        let producer = run.events[..index]
            .iter()
            .rposition(|p| p.output.id == r.id);
        let from = match (producer, r.role) {
            (Some(p), _) => Span::styled(
                format!(" ← #{p} {}", short_name(&run.events[p].name)),
                t.dim(),
            ),
            (None, BufferRole::Activation) => Span::styled(" ← no earlier op wrote it ✗", t.bad()),
            (None, _) => Span::raw(""),
        };
        lines.push(Line::from(vec![
            Span::raw(format!("  {:<11}", role(r.role))),
            Span::raw(buf(r)),
            from,
        ]));
    }
    super::scrolled(frame, lines, area, scroll)
}

/// The attention chain of the op's layer: the kernel's buffer, the one the wrapper returned,
/// the one the next op read, and whether they are one.
fn chain_lines(app: &App, run: &RunRecord, e: &OpEvent) -> Vec<Line<'static>> {
    let t = &app.theme;
    let mut lines = Vec::new();
    let Some(layer) = e.layer else {
        return lines;
    };
    let Some(chain) = attention_chain_of_rank(run, e.phase, layer, e.rank) else {
        return lines;
    };
    let rank = e.rank.map_or(String::new(), |r| format!(", rank {r}"));
    lines.push(Line::from(Span::styled(
        format!("attention chain, layer {layer}, {}{rank}", e.phase),
        t.dim(),
    )));
    lines.push(Line::from(format!(
        "  kernel ({}) wrote buf {}",
        short_name(&chain.kernel_op),
        chain.kernel_wrote.id.0
    )));
    lines.push(Line::from(format!(
        "  → the wrapper returned buf {}",
        chain.returned.id.0
    )));
    lines.push(Line::from(
        match (&chain.consumer_op, &chain.consumer_read) {
            (Some(op), Some(b)) => format!("  → {} read buf {}", short_name(op), b.id.0),
            _ => "  → no op read it (yet)".to_string(),
        },
    ));
    lines.push(Line::from(if chain.connected {
        Span::styled("  connected ✓", t.ok())
    } else {
        Span::styled(
            format!(
                "  DISCONNECTED ✗ ({} elements of the returned buffer unwritten)",
                chain.unwritten
            ),
            t.bad(),
        )
    }));
    lines
}
