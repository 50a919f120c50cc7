//! The Learn view: MLA weight absorption walked through on the real numbers of the selected
//! layer: what the latent is and why absorption pays, shapes and both formulas, the cost of a
//! decoded token on each path at long contexts (cost.rs, table.rs), both paths' outputs side by
//! side, the DSA indexer (indexer.rs), the identity trick for quantized kv_b_proj, and a walk
//! over the layer's ops (walk.rs).

mod cost;
mod indexer;
mod table;
mod values;
mod walk;

use super::num;
use crate::debug::compare::diff;
use crate::debug::sample::{is_sampled, NEEDS_TENSORS};
use crate::engine::MlaPath;
use crate::service::AuxKind;
use crate::tui::app::App;
use crate::tui::keys::Action;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Clear, Paragraph, Wrap};
use ratatui::Frame;

/// Draws the view scrolled `scroll` lines down, or as far as it goes; returns the scroll drawn.
pub fn draw(frame: &mut Frame, app: &App, area: Rect, scroll: u16) -> u16 {
    let t = &app.theme;
    let Some(layout) = app.mirror.layout() else {
        return 0;
    };
    let Some((layer, why_layer)) = app.learn_layer() else {
        return 0;
    };
    // On a wide screen the execution tree stays in view, so that the walk's moves show.
    let tree = app.areas.tree;
    let area = if area.width >= 140 && tree.width > 0 && tree.right() < area.right() {
        Rect {
            x: tree.right(),
            width: area.right() - tree.right(),
            ..area
        }
    } else {
        area
    };
    let (n, p, r, v, l, h) = (
        layout.num_heads,
        layout.qk_nope_head_dim,
        layout.qk_rope_head_dim,
        layout.v_head_dim,
        layout.kv_lora_rank,
        layout.hidden_size,
    );
    let context = app.mirror.position().map_or(1, |e| e.positions.1).max(1);
    let head = |s: &str| Line::from(Span::styled(s.to_string(), t.title()));
    let text = |s: String| Line::from(s);
    let mut lines = vec![head(&format!(
        "MLA weight absorption · layer {layer} of {} · context {context} tokens",
        layout.name
    ))];
    if let Some(why) = why_layer {
        lines.push(Line::from(Span::styled(why, t.diverge())));
    }
    lines.push(text(String::new()));
    lines.extend(why(app, layout));
    lines.extend([
        text(String::new()),
        head("The numbers"),
        text(format!("  heads N = {n}, qk_nope P = {p}, qk_rope R = {r}, v_head V = {v}, kv_lora_rank L = {l}, hidden = {h}")),
        text(format!("  q_nope [tokens, N, P] = [·, {n}, {p}]      q_pe [tokens, N, R] = [·, {n}, {r}]")),
        text(format!("  c_kv   [T, L] = [{context}, {l}]   (normalised latent; cached)   k_pe [T, R] = [{context}, {r}] (one head, roped; cached)")),
        text(format!(
            "  kv_b_proj [N·(P+V), L] = [{}, {l}], viewed [N, P+V, L]: per head rows 0..P are W_UK [{p}, {l}], rows P..P+V are W_UV [{v}, {l}]",
            n * (p + v)
        )),
        text(String::new()),
        head("Naive (prefill in production; everything with MLA disabled)"),
        text(format!("  k_nope[t,h] = W_UK[h]·c_kv[t]  ([{p}×{l}]·[{l}])      v[t,h] = W_UV[h]·c_kv[t]  ([{v}×{l}]·[{l}])")),
        text(format!("  score[h,t] = (q_nope[h]·k_nope[t,h] + q_pe[h]·k_pe[t]) / sqrt(P+R) = … / sqrt({})", p + r)),
        text(format!("  o[h] = Σ_t softmax(score)[h,t] · v[t,h]   → [N, V] = [{n}, {v}]")),
        text(String::new()),
        head("Absorbed (decode in production)"),
        text(format!("  q_lat[h] = W_UK[h]ᵀ·q_nope[h]   ([{l}×{p}]·[{p}] → [{l}]): W_UK moves onto the query")),
        text(format!("  score[h,t] = (q_lat[h]·c_kv[t] + q_pe[h]·k_pe[t]) / sqrt({})   (same scale: not sqrt({}))", p + r, l + r)),
        text(format!("  o_lat[h] = Σ_t p[h,t]·c_kv[t] → [{l}];  o[h] = W_UV[h]·o_lat[h] → [{v}]")),
        text(format!("  one KV head of width L+R = {} shared by all {n} heads (MQA over the latent cache)", l + r)),
        text(String::new()),
    ]);
    lines.extend(table::lines(app, layout, context as u64));
    lines.push(text(String::new()));
    lines.extend(values::lines(app, layer));
    lines.push(text(String::new()));
    lines.extend(outputs(app, layer));
    lines.push(text(String::new()));
    lines.extend(indexer::lines(app, layout, layer));
    lines.extend([
        text(String::new()),
        head("Quantized kv_b_proj: the identity trick"),
        text(format!(
            "  The absorbed path needs W_UK and W_UV as plain matrices. A quantized linear layer has none, so backends run it on I_L, the {l}×{l} identity:"
        )),
        text(format!(
            "  Y = I_L·W_deqᵀ = W_deqᵀ  [{l}, {}], then split per head into W_UK / W_UV.",
            n * (p + v)
        )),
        text("  This is exact only if the quantized matmul is exact on one-hot rows: a kernel that accumulates in reduced precision,".to_string()),
        text("  reorders blocks or assumes another layout yields a wrong W_UK/W_UV, while the naive path (the same quantized matmul on c_kv) is fine.".to_string()),
        text("  force-dequantize instead dequantizes kv_b_proj once at load and treats it as an unquantized layer.".to_string()),
        text(format!(
            "  Here: force-dequant is {}; {}",
            if app.mirror.flags.force_dequant { "on" } else { "off" },
            match quantized_kv_b_op(app, layer) {
                Some(op) => format!("layer {layer} made its kv_b_proj plain in op {op} (compare it with the other route by toggling the flag)."),
                None => "kv_b_proj is not quantized in this run (or its layer has not reached attention), so both routes give the same W (GGUF files and --quant give quantized weights).".to_string(),
            }
        )),
    ]);
    frame.render_widget(Clear, area);
    let block = Block::default().borders(Borders::ALL).title(Span::styled(
        format!(
            " Learn (j/k scroll, n/p walk, {} closes) ",
            app.keymap.key_of(Action::Cancel)
        ),
        t.title(),
    ));
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let walk_rows = walk::height(app, inner).min(inner.height.saturating_sub(3));
    let [body, foot] =
        Layout::vertical([Constraint::Min(1), Constraint::Length(walk_rows)]).areas(inner);
    // Scrolling stops where the last line reaches the foot of the body: never a blank view.
    let text = Paragraph::new(lines).wrap(Wrap { trim: false });
    let most = (text.line_count(body.width) as u16).saturating_sub(body.height);
    let scroll = scroll.min(most);
    frame.render_widget(text.scroll((scroll, 0)), body);
    walk::draw(frame, app, foot);
    scroll
}

/// What the latent is and why absorption exists, with this layout's numbers.
fn why(app: &App, layout: &crate::model::Layout) -> Vec<Line<'static>> {
    let d = cost::Dims::of(layout);
    let (nf, nb, af, ab) = d.per_token();
    let (n, p, r, v, l) = (d.heads, d.nope, d.rope, d.v, d.latent);
    let title = Line::from(Span::styled(
        "Why: the latent, and why absorb",
        app.theme.title(),
    ));
    vec![
        title,
        Line::from(format!(
            "  MLA caches one compressed vector per token, the latent c_kv (L = {l} values), plus one roped key k_pe (R = {r}) that all heads share: {} values, {ab} B in bf16. Plain multi-head attention would cache per-head K and V: N·(P+R+V) = {} values, {nb} B, {:.1}× more.",
            l + r,
            n * (p + r + v),
            nb as f64 / ab as f64
        )),
        Line::from(format!(
            "  kv_b_proj holds W_UK and W_UV, which turn c_kv back into per-head k_nope and v. The naive path does that and attends over the expanded K/V: every decode step reads {nb} B per cached token."
        )),
        Line::from(format!(
            "  Absorption regroups the products: q_nope·(W_UK·c_kv) = (W_UKᵀ·q_nope)·c_kv, so W_UK folds into the query once; Σ p·(W_UV·c_kv) = W_UV·(Σ p·c_kv), so W_UV runs once after the weighted sum. Attention then reads the latent cache alone: {af} FLOPs per cached token instead of {nf} ({:.1}×), for {ab} B instead of {nb} ({:.1}× fewer). Decode reads far more than it computes, so bytes decide.",
            af as f64 / nf as f64,
            nb as f64 / ab as f64
        )),
    ]
}

/// This run's attention output of the layer next to the other path's, for the last token.
/// The op that made this layer's quantized kv_b_proj plain, if the current run has one.
fn quantized_kv_b_op(app: &App, layer: usize) -> Option<String> {
    let run = app.mirror.current()?;
    run.events
        .iter()
        .find(|e| e.layer == Some(layer) && e.kind == crate::engine::OpKind::Dequantize)
        .map(|e| e.name.rsplit('.').next().unwrap_or(&e.name).to_string())
}

fn outputs(app: &App, layer: usize) -> Vec<Line<'static>> {
    let t = &app.theme;
    let title = Line::from(Span::styled(
        format!("The two paths' outputs, layer {layer} (attn_output, last token)"),
        t.title(),
    ));
    let Some(current) = app.mirror.current() else {
        return vec![title];
    };
    // The current run's comparison runs, else the last earlier run that has them (a replay
    // records them where the session computed them).
    let n = app.mirror.current_number();
    let found = app
        .mirror
        .aux(AuxKind::OtherPath)
        .map(|o| (current, o, None))
        .or_else(|| {
            (0..n).rev().find_map(|r| {
                let other = app.mirror.aux.get(&(r, AuxKind::OtherPath))?;
                Some((app.mirror.runs.get(r)?, &**other, Some(r)))
            })
        });
    let Some((run, other, earlier)) = found else {
        let why = if app.mirror.busy.is_some() {
            "  computing the other path…".to_string()
        } else if current.finished() {
            format!("  no comparison runs for run {n}: a live session computes them ({}); a replay has them only where they were recorded", app.keymap.key_of(Action::Compare))
        } else {
            format!(
                "  finish the run ({}) and open this view again to compute the other path",
                app.keymap.key_of(Action::Continue)
            )
        };
        return vec![title, Line::from(why)];
    };
    let mut head = vec![title];
    if let Some(r) = earlier {
        head.push(Line::from(Span::styled(
            format!("  from run {r}, the last run whose comparison runs were recorded"),
            t.dim(),
        )));
    }
    let name = format!("model.layers.{layer}.self_attn.attn_output");
    let phase = app
        .selected_op()
        .map(|(_, e)| e.phase)
        .filter(|ph| run.find(*ph, &name).is_some())
        .or_else(|| {
            run.events
                .iter()
                .rev()
                .find(|e| e.name == name)
                .map(|e| e.phase)
        });
    let Some(phase) = phase else {
        head.push(Line::from(format!(
            "  layer {layer} has not run its attention yet: step on"
        )));
        return head;
    };
    let (Some(i), Some(j)) = (run.find(phase, &name), other.find(phase, &name)) else {
        head.push(Line::from("  the other path has no such op"));
        return head;
    };
    let (a, b) = (&run.outputs[i], &other.outputs[j]);
    let sampled = is_sampled(&run.events[i], a) || is_sampled(&other.events[j], b);
    if sampled && (a.numel() != b.numel() || run.events[i].shape != other.events[j].shape) {
        head.push(Line::from(format!("  {NEEDS_TENSORS}")));
        return head;
    }
    let (Some(last), true) = (a.rows().checked_sub(1), a.shape() == b.shape()) else {
        head.push(Line::from(format!(
            "  the outputs' shapes are {:?} and {:?}: no last token to compare",
            a.shape(),
            b.shape()
        )));
        return head;
    };
    // A replay without tensors holds the same sampled elements of both: those, not a row.
    let (ra, rb) = match sampled {
        true => (a.data(), b.data()),
        false => (a.row(last), b.row(last)),
    };
    let cols = ra.len();
    if sampled {
        head.push(Line::from(Span::styled(
            format!("  a sample of {cols} values of the whole output (not the last token's row): {NEEDS_TENSORS}"),
            t.dim(),
        )));
    }
    let show = |x: &[f32]| {
        x.iter()
            .take(6)
            .map(|v| format!("{:>9}", num(*v as f64)))
            .collect::<String>()
    };
    let path = |p: MlaPath| format!("{p:<9}");
    let d = diff(ra, rb, &[cols], None);
    head.extend([
        Line::from(format!(
            "  {} {} …",
            path(run.flags.path_of(phase)),
            show(ra)
        )),
        Line::from(format!(
            "  {} {} …",
            path(other.flags.path_of(phase)),
            show(rb)
        )),
        Line::from(vec![
            Span::raw(format!("  {} of {cols} values: ", phase)),
            Span::styled(
                match d.non_finite_summary() {
                    // Counted first: the figures cover only the elements finite on both sides.
                    Some(counts) => format!("{counts}; {}", d.figures_summary()),
                    None => format!(
                        "rel L2 {}  max |Δ| {}  cosine {:.7}",
                        num(d.rel_l2),
                        num(d.max_abs),
                        d.cosine
                    ),
                },
                if d.exceeds(1e-4) { t.diverge() } else { t.ok() },
            ),
            Span::styled(
                "  (same function in exact arithmetic; f32 rounding differs)",
                t.dim(),
            ),
        ]),
    ]);
    head
}
