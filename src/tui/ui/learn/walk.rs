//! The walk panel at the foot of the Learn view: the step's op, what it explains with this
//! layout's numbers, and where in the trace the selection went.

use crate::model::Layout;
use crate::tui::app::{App, WalkTarget, WALK};
use ratatui::layout::Rect;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph, Wrap};
use ratatui::Frame;

/// Rows the panel takes: a hint before the walk starts, the step once it has.
pub fn height(app: &App, area: Rect) -> u16 {
    match app.learn_step {
        None => 2,
        // A third of a small screen, at most 8 rows.
        Some(_) => (area.height / 3).clamp(5, 8),
    }
}

pub fn draw(frame: &mut Frame, app: &App, area: Rect) {
    let t = &app.theme;
    let block = Block::default().borders(Borders::TOP);
    let Some(i) = app.learn_step else {
        let hint = Line::from(vec![
            Span::styled("Walk: ", t.title()),
            Span::raw(format!(
                "n / p go through {} ops of this layer, selecting each in the trace",
                WALK.len()
            )),
        ]);
        frame.render_widget(
            Paragraph::new(hint).wrap(Wrap { trim: false }).block(block),
            area,
        );
        return;
    };
    let step = WALK[i];
    let path = match step.path {
        Some(p) => format!(" ({p} path)"),
        None => " (both paths)".to_string(),
    };
    let mut lines = vec![Line::from(vec![
        Span::styled(
            format!("Walk {}/{} · {}", i + 1, WALK.len(), step.op),
            t.title(),
        ),
        Span::styled(path, t.dim()),
        Span::styled("   n next · p back", t.dim()),
    ])];
    let (place, style) = match app.walk_target(i) {
        WalkTarget::Found { index, phase, .. } => {
            let name = app
                .mirror
                .current()
                .and_then(|r| r.events.get(index))
                .map_or(String::new(), |e| e.name.clone());
            // A step of one path, taken from a phase that ran the other.
            let why = match (app.learn_from, app.mirror.current()) {
                (Some(from), Some(run)) if from != phase && step.path.is_some() => format!(
                    " (not in {from}: it ran the {} path)",
                    run.flags.path_of(from)
                ),
                _ => String::new(),
            };
            (format!("→ {phase} #{index} {name}{why}"), t.ok())
        }
        WalkTarget::Missing(why) => (format!("→ {why}"), t.diverge()),
    };
    lines.push(Line::from(Span::styled(place, style)));
    if let Some(layout) = app.mirror.layout() {
        lines.push(Line::from(explain(step.op, step.path, layout)));
    }
    frame.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: false })
            .block(block),
        area,
    );
}

/// What a step's op does, in this layout's numbers.
fn explain(op: &str, path: Option<crate::engine::MlaPath>, layout: &Layout) -> String {
    use crate::engine::MlaPath::{Absorbed, Naive};
    let (n, p, r, v, l) = (
        layout.num_heads,
        layout.qk_nope_head_dim,
        layout.qk_rope_head_dim,
        layout.v_head_dim,
        layout.kv_lora_rank,
    );
    let h = layout.hidden_size;
    match (op, path) {
        ("kv_a_proj_with_mqa", _) => format!(
            "Compression: x [{h}] → [c_kv | k_pe], L+R = {} values per token: all MLA keeps of a token for attention.",
            l + r
        ),
        ("kv_a_layernorm", _) => format!(
            "c_kv normalised: the latent, L = {l} values. It is cached as is; the absorbed path never stores a per-head K or V."
        ),
        ("k_rope", _) => format!(
            "k_pe roped: R = {r} values, one key head shared by all {n} heads, cached beside c_kv (a latent cache row is L+R = {}).",
            l + r
        ),
        ("q_b_proj", _) => format!(
            "The query: per head q_nope (P = {p}) | q_pe (R = {r}), {} values per token.",
            n * (p + r)
        ),
        ("q_rope", _) => "q_pe roped. q_nope is never rotated: RoPE depends on the position, so only the unrotated part can take W_UK in.".to_string(),
        ("kv_b_proj", _) => format!(
            "Naive: W_UK and W_UV expand each token's c_kv into per-head k_nope [{n}×{p}] and v [{n}×{v}]: with k_pe, {} B per cached token in bf16, read at every decode step.",
            n * (p + r + v) * 2
        ),
        ("attn_output", Some(Naive)) => format!(
            "Naive attention: {n} heads of width P+R = {} over the expanded cache, weighted sum over V = {v}: 2N(P+R+V) = {} FLOPs per cached token for as many bytes.",
            p + r,
            2 * n * (p + r + v)
        ),
        ("q_absorbed", _) => format!(
            "Absorbed: q_lat = W_UKᵀ·q_nope per head ([{l}×{p}]·[{p}] → [{l}]): W_UK moves onto the query, once per decoded token instead of once per cached token."
        ),
        ("attn_latent", _) => format!(
            "MQA over the latent cache: score = (q_lat·c_kv + q_pe·k_pe)/sqrt({}), o_lat = Σ p·c_kv → [{n}, {l}]. One key head of width {} read by all heads: {} B per cached token.",
            p + r,
            l + r,
            (l + r) * 2
        ),
        ("attn_output", Some(Absorbed)) => format!(
            "W_UV after the weighted sum: o = W_UV·o_lat → [{n}, {v}]. Σ_t p·(W_UV·c_kv[t]) = W_UV·(Σ_t p·c_kv[t]), so W_UV runs once, not once per cached token."
        ),
        ("o_proj", _) => format!(
            "o_proj: [{}] → [{h}]. Both paths hand it the same per-head outputs, up to rounding.",
            n * v
        ),
        _ => String::new(),
    }
}
