//! The header bar: the flags in the README's words (`MLA-disable off │ prefill naive · decode
//! absorbed │ dequant off │ cpu · f32 │ inject none`). Where the screen is too narrow for all of
//! it (80 columns with a fault injected), the flags still at their defaults make room first, the
//! least telling first; what is left takes a second row rather than being cut off.

use crate::debug::flags::{kernels_text, DeviceFlag};
use crate::debug::idle::Subject;
use crate::engine::faults::{spec_of, Fault};
use crate::engine::MlaPath;
use crate::ops::{KvCacheDtype, StorageDtype};
use crate::tui::app::App;
use ratatui::style::Style;
use ratatui::text::{Line, Span};

/// One item of the bar: its label, value and whether it is at its default (and so may make
/// room on a narrow screen).
struct Item {
    label: &'static str,
    value: String,
    style: Style,
    default: bool,
    /// The order in which defaults make room: lower goes first.
    rank: u8,
}

const SEPARATOR: &str = " │ ";
const TITLE: &str = " mladb ";

fn items(app: &App) -> Vec<Item> {
    let t = &app.theme;
    let f = &app.mirror.flags;
    let onoff = |on: bool| if on { "on" } else { "off" };
    let idle = |s: Subject| app.mirror.idle.iter().any(|i| i.subject == s);
    // A flag that had nothing to act on says so.
    let marked = |text: String, is_idle: bool| {
        if is_idle {
            format!("{text} (idle)")
        } else {
            text
        }
    };
    let style = |on: bool| if on { t.on() } else { t.base() };
    let mut out = Vec::new();
    let mla_idle = idle(Subject::MlaDisable);
    out.push(if f.mla_disable && app.mla_disable_env {
        Item {
            label: "",
            value: marked("VLLM_MLA_DISABLE=1".into(), mla_idle),
            style: t.on(),
            default: false,
            rank: 5,
        }
    } else {
        Item {
            label: "MLA-disable",
            value: marked(onoff(f.mla_disable).into(), mla_idle),
            style: style(f.mla_disable),
            default: !f.mla_disable && !mla_idle,
            rank: 5,
        }
    });
    let paths_idle = idle(Subject::PrefillPath) || idle(Subject::DecodePath);
    out.push(Item {
        label: "",
        value: marked(f.paths().to_string(), paths_idle),
        style: t.base(),
        // With MLA disabled the paths follow from it.
        default: !paths_idle
            && (f.mla_disable
                || (f.prefill_path == MlaPath::Naive && f.decode_path == MlaPath::Absorbed)),
        rank: 6,
    });
    let dequant_idle = idle(Subject::ForceDequant);
    out.push(Item {
        label: "dequant",
        value: marked(onoff(f.force_dequant).into(), dequant_idle),
        style: style(f.force_dequant),
        default: !f.force_dequant && !dequant_idle,
        rank: 1,
    });
    // The latent cache's storage, when it is not bf16.
    let kv = match f.kv_cache {
        KvCacheDtype::Bf16 => String::new(),
        other => format!(" · kv {other}"),
    };
    let plain_dtype = f.dtype == StorageDtype::default() && kv.is_empty();
    out.push(Item {
        label: "",
        value: format!("{} · {}{kv}", f.device, f.dtype),
        style: style(!plain_dtype),
        default: plain_dtype && f.device == DeviceFlag::Cpu,
        rank: 3,
    });
    // The attention kernels mean something on the GPU only.
    if f.device == DeviceFlag::Cuda {
        let plain = f.kernels == Default::default();
        out.push(Item {
            label: "attn",
            value: kernels_text(&f.kernels),
            style: style(!plain),
            default: plain,
            rank: 2,
        });
    }
    let faults: Vec<String> = Fault::ALL
        .into_iter()
        .filter_map(|fault| {
            let spec = spec_of(fault, f.faults.scope(fault)?);
            Some(marked(spec, idle(Subject::Fault(fault))))
        })
        .collect();
    out.push(Item {
        label: "inject",
        value: if faults.is_empty() {
            "none".to_string()
        } else {
            faults.join(",")
        },
        style: style(!faults.is_empty()),
        default: faults.is_empty(),
        rank: 4,
    });
    out
}

fn width(item: &Item) -> usize {
    let label = if item.label.is_empty() { 0 } else { 1 } + item.label.chars().count();
    label + item.value.chars().count()
}

fn spans(app: &App, item: &Item) -> Vec<Span<'static>> {
    let mut out = Vec::new();
    if !item.label.is_empty() {
        out.push(Span::styled(format!("{} ", item.label), app.theme.dim()));
    }
    out.push(Span::styled(item.value.clone(), item.style));
    out
}

/// The bar as it fits `columns`: one row, or two where even the flags changed from their
/// defaults do not fit in one.
pub fn lines(app: &App, columns: u16) -> Vec<Line<'static>> {
    let columns = columns as usize;
    let mut items = items(app);
    let total = |items: &[Item], title: bool| {
        let sep = SEPARATOR.chars().count();
        let title = if title { TITLE.len() + 2 } else { 1 };
        title + items.iter().map(width).sum::<usize>() + sep * items.len().saturating_sub(1)
    };
    let mut title = true;
    if total(&items, true) > columns {
        title = false;
        // Defaults make room, the least telling first, until the rest fits.
        let mut ranks: Vec<u8> = items.iter().filter(|i| i.default).map(|i| i.rank).collect();
        ranks.sort_unstable();
        for rank in ranks {
            if total(&items, false) <= columns {
                break;
            }
            items.retain(|i| !(i.default && i.rank == rank));
        }
    }
    let t = &app.theme;
    let mut rows: Vec<Vec<Span<'static>>> = vec![if title {
        vec![Span::styled(TITLE, t.title()), Span::styled("│ ", t.dim())]
    } else {
        vec![Span::raw(" ")]
    }];
    let mut used = if title { TITLE.len() + 2 } else { 1 };
    for (n, item) in items.iter().enumerate() {
        let w = width(item);
        let row = rows.last_mut().expect("one row at least");
        if n > 0 {
            if used + SEPARATOR.chars().count() + w > columns {
                // A second row, under the first item's start.
                rows.push(vec![Span::raw(" ")]);
                used = 1;
            } else {
                row.push(Span::styled(SEPARATOR, t.dim()));
                used += SEPARATOR.chars().count();
            }
        }
        rows.last_mut()
            .expect("one row at least")
            .extend(spans(app, item));
        used += w;
    }
    rows.into_iter().map(Line::from).collect()
}

/// Rows the bar takes on a screen `columns` wide (one or two).
pub fn height(app: &App, columns: u16) -> u16 {
    lines(app, columns).len().clamp(1, 2) as u16
}
