//! The Learn view's DSA indexer section: what the indexer scores, what its top-k keeps, what that
//! saves at long context with this layout's numbers, and how many keys the layer's query
//! attended to in this run.

use super::cost::Dims;
use super::table::si;
use crate::engine::trace::OpEvent;
use crate::model::layout::IndexerMode;
use crate::model::Layout;
use crate::tui::app::App;
use ratatui::text::{Line, Span};

/// The context the savings are told at (GLM-5's trained length is 200k; 128k is the table's
/// longest row).
const LONG: u64 = 128 * 1024;

pub fn lines(app: &App, layout: &Layout, layer: usize) -> Vec<Line<'static>> {
    let title = Line::from(Span::styled(
        format!("The DSA indexer (sparse attention), layer {layer}"),
        app.theme.title(),
    ));
    let Some(ix) = &layout.indexer else {
        return vec![
            title,
            Line::from(format!(
                "  {} has no indexer: every query attends to all earlier tokens (dense MLA, as DeepSeek-V3).",
                layout.name
            )),
        ];
    };
    let (h, d, k) = (ix.n_heads as u64, ix.head_dim as u64, ix.topk as u64);
    let dims = Dims::of(layout);
    let (_, _, mla_flops, mla_bytes) = dims.per_token();
    let kept = k.min(LONG);
    let mut out = vec![
        title,
        Line::from(format!(
            "  Before attention, a small scorer picks which earlier tokens each query attends to; MLA then reads only those rows of the latent cache. Per query: q = wq_b(q_resid), H = {h} heads of D = {d}; per token one key k = LayerNorm(wk(x)) of D = {d}, RoPE on the first {} dims of both ({} layout).",
            layout.qk_rope_head_dim,
            if ix.rope_interleaved { "interleaved" } else { "split-half" }
        )),
        Line::from(format!(
            "  score[t] = Σ_h w[h]·ReLU(q[h]·k[t]/√D), with w = weights_proj(x)/√H: 2·H·D = {} FLOPs and {} B of key (bf16) per cached token, against the latent's {} B.",
            2 * h * d,
            d * dims.elem,
            mla_bytes
        )),
        Line::from(format!(
            "  It keeps the top K = {k} scores of each query (ties go to the lower position); a query with at most K earlier tokens keeps them all, so attention is dense up to K tokens of context."
        )),
        Line::from(format!(
            "  At {}k tokens of context, per decoded token: absorbed MLA over the K kept keys {} and {} read, instead of {} and {} over all of them; the indexer's own pass over every key {} and {}.",
            LONG / 1024,
            si((mla_flops * kept) as f64, "FLOP"),
            si((mla_bytes * kept) as f64, "B"),
            si((mla_flops * LONG) as f64, "FLOP"),
            si((mla_bytes * LONG) as f64, "B"),
            si((2 * h * d * LONG) as f64, "FLOP"),
            si((d * dims.elem * LONG) as f64, "B"),
        )),
    ];
    out.push(Line::from(live(app, layout, layer, ix.topk)));
    out
}

/// What the layer's indexer did in the current run, for the selected op's phase (else the last
/// phase that ran it).
fn live(app: &App, layout: &Layout, layer: usize, topk: usize) -> String {
    if layout.indexer_mode(layer) == Some(IndexerMode::Shared) {
        return format!(
            "  Here: layer {layer} runs no indexer of its own; it reuses the selection of the layer before it (the layout's indexer_types)."
        );
    }
    let Some(run) = app.mirror.current() else {
        return "  Here: no run yet.".to_string();
    };
    let name = format!("model.layers.{layer}.self_attn.indexer.topk");
    let of_phase = app
        .selected_op()
        .and_then(|(_, e)| run.find(e.phase, &name))
        .or_else(|| run.events.iter().rposition(|e| e.name == name));
    let Some(i) = of_phase else {
        return format!(
            "  Here: layer {layer}'s indexer has not run yet in this run (step on to self_attn.indexer.topk)."
        );
    };
    let e: &OpEvent = &run.events[i];
    // The last query of the op sees every position before it and itself.
    let context = e.positions.1;
    let attended = context.min(topk);
    let how = if context > topk {
        format!(
            "sparse: {} of its {context} earlier tokens are skipped",
            context - topk
        )
    } else {
        format!("dense: its context ({context}) is within K = {topk}")
    };
    format!(
        "  Here ({}, op {}): the last query, at position {}, attends to {attended} keys — {how}.",
        e.phase,
        e.index,
        context.saturating_sub(1)
    )
}
