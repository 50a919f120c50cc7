//! The Learn view: MLA weight absorption walked through on the real numbers of the selected
//! layer: shapes, the two formulas, FLOPs and KV-cache bytes per token at the current context
//! length, both paths' outputs side by side, and the identity trick for quantized kv_b_proj.

use super::num;
use crate::debug::compare::diff;
use crate::debug::sample::{is_sampled, NEEDS_TENSORS};
use crate::engine::MlaPath;
use crate::service::AuxKind;
use crate::tui::app::App;
use crate::tui::keys::Action;
use ratatui::layout::Rect;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Clear, Paragraph, Wrap};
use ratatui::Frame;

/// FLOPs of one decoded token's attention in one layer at context `t`, per path.
pub fn decode_flops(n: u64, p: u64, r: u64, v: u64, l: u64, t: u64) -> (u64, u64) {
    // Naive with an expanded cache: decompress the new token (W_UK, W_UV), then scores over
    // P+R and the weighted sum over V, for every head and cached token.
    let naive = 2 * n * l * (p + v) + 2 * n * t * (p + r) + 2 * n * t * v;
    // Absorbed: fold W_UK into the query, scores over L+R and the weighted sum over L per head
    // and cached token, then W_UV.
    let absorbed = 2 * n * p * l + 2 * n * t * (l + r) + 2 * n * t * l + 2 * n * l * v;
    (naive, absorbed)
}

pub fn draw(frame: &mut Frame, app: &App, area: Rect, scroll: u16) {
    let t = &app.theme;
    let Some(layout) = app.mirror.layout() else {
        return;
    };
    let info = app.mirror.info.as_ref().expect("a layout implies info");
    let layer = app.selected_layer().unwrap_or(info.layers.start);
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
    let mut lines = vec![
        head(&format!("MLA weight absorption · layer {layer} of {} · context {context} tokens", layout.name)),
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
    ];
    let (fn_, fa) = decode_flops(
        n as u64,
        p as u64,
        r as u64,
        v as u64,
        l as u64,
        context as u64,
    );
    let latent_bytes = (l + r) * 2;
    let expanded_bytes = n * (p + r + v) * 2;
    lines.extend([
        head(&format!("Cost of one decoded token in this layer at context {context}")),
        text(format!(
            "  FLOPs: naive {} · absorbed {} ({:.2}×)",
            fmt_count(fn_),
            fmt_count(fa),
            fa as f64 / fn_ as f64
        )),
        text(format!(
            "  KV cache per token (bf16): latent (L+R)·2 = {latent_bytes} B · expanded N·(P+R+V)·2 = {expanded_bytes} B ({:.1}× smaller); at {context} tokens: {} vs {}",
            expanded_bytes as f64 / latent_bytes as f64,
            fmt_bytes((latent_bytes * context) as u64),
            fmt_bytes((expanded_bytes * context) as u64),
        )),
        text(String::new()),
    ]);
    lines.extend(outputs(app, layer));
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
    frame.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: false })
            .scroll((scroll, 0))
            .block(Block::default().borders(Borders::ALL).title(Span::styled(
                format!(
                    " Learn (j/k scroll, {} closes) ",
                    app.keymap.key_of(Action::Cancel)
                ),
                t.title(),
            ))),
        area,
    );
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
    let Some(run) = app.mirror.current() else {
        return vec![title];
    };
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
        return vec![
            title,
            Line::from(format!(
                "  layer {layer} has not run its attention yet: step on"
            )),
        ];
    };
    let Some(other) = app.mirror.aux(AuxKind::OtherPath) else {
        return vec![
            title,
            Line::from(format!(
                "  finish the run ({}) and open this view again to compute the other path",
                app.keymap.key_of(Action::Continue)
            )),
        ];
    };
    let (Some(i), Some(j)) = (run.find(phase, &name), other.find(phase, &name)) else {
        return vec![title, Line::from("  the other path has no such op")];
    };
    let (a, b) = (&run.outputs[i], &other.outputs[j]);
    if is_sampled(&run.events[i], a) || is_sampled(&other.events[j], b) {
        return vec![title, Line::from(format!("  {NEEDS_TENSORS}"))];
    }
    let cols = a.cols();
    let (Some(last), true) = (a.rows().checked_sub(1), a.shape() == b.shape()) else {
        return vec![
            title,
            Line::from(format!(
                "  the outputs' shapes are {:?} and {:?}: no last token to compare",
                a.shape(),
                b.shape()
            )),
        ];
    };
    let (ra, rb) = (a.row(last), b.row(last));
    let show = |x: &[f32]| {
        x.iter()
            .take(6)
            .map(|v| format!("{:>9}", num(*v as f64)))
            .collect::<String>()
    };
    let path = |p: MlaPath| format!("{:<9}", format!("{p:?}").to_lowercase());
    let d = diff(ra, rb, &[cols], None);
    vec![
        title,
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
    ]
}

fn fmt_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2} G", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2} M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1} k", n as f64 / 1e3),
        n => n.to_string(),
    }
}

fn fmt_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::decode_flops;

    #[test]
    fn glm5_decode_flops_follow_the_formulas() {
        // GLM-5: N 64, P 192, R 64, V 256, L 512; mla.md: 2·(576+512) FLOPs per head per token
        // for the absorbed attention itself.
        let (n, p, r, v, l) = (64u64, 192, 64, 256, 512);
        let (naive, absorbed) = decode_flops(n, p, r, v, l, 1000);
        let core = 2 * n * 1000 * (l + r + l);
        assert_eq!(absorbed - 2 * n * p * l - 2 * n * l * v, core);
        assert_eq!(naive, 2 * n * l * (p + v) + 2 * n * 1000 * (p + r + v));
    }
}
