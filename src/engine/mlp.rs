//! The feed-forward half of a layer: a dense SiLU-gated MLP, or MoE (routed experts, fetched one
//! at a time, plus shared experts).

use super::attention::LayerCtx;
use super::sink::Sink;
use super::trace::OpKind;
use crate::error::Result;
use crate::model::catalog::expert_weight_name;
use crate::tensor::Tensor;

/// down(SiLU(gate(x)) · up(x)) with weights under `prefix` (e.g. `mlp` or `mlp.shared_experts`),
/// reporting each op when `report` is set.
fn gated_mlp(
    ctx: &LayerCtx,
    x: &Tensor,
    prefix: &str,
    report: bool,
    sink: &mut Sink,
) -> Result<Tensor> {
    let b = ctx.backend;
    let l = Some(ctx.layer);
    let wg = ctx.weight(&format!("{prefix}.gate_proj.weight"))?;
    let wu = ctx.weight(&format!("{prefix}.up_proj.weight"))?;
    let wd = ctx.weight(&format!("{prefix}.down_proj.weight"))?;
    let gate = b.linear(x, &wg, None)?;
    let up = b.linear(x, &wu, None)?;
    let act = b.silu_mul(&gate, &up)?;
    let down = b.linear(&act, &wd, None)?;
    if report {
        sink.emit(
            l,
            &ctx.name(&format!("{prefix}.gate_proj")),
            OpKind::Linear,
            &gate,
            &[x],
            &[&wg],
        )?;
        sink.emit(
            l,
            &ctx.name(&format!("{prefix}.up_proj")),
            OpKind::Linear,
            &up,
            &[x],
            &[&wu],
        )?;
        sink.emit(
            l,
            &ctx.name(&format!("{prefix}.act_fn")),
            OpKind::Activation,
            &act,
            &[&gate, &up],
            &[],
        )?;
        sink.emit(
            l,
            &ctx.name(&format!("{prefix}.down_proj")),
            OpKind::Linear,
            &down,
            &[&act],
            &[&wd],
        )?;
    }
    Ok(down)
}

/// Dense MLP; its output is also reported as the `mlp` module's output.
pub fn dense(ctx: &LayerCtx, x: &Tensor, sink: &mut Sink) -> Result<Tensor> {
    let out = gated_mlp(ctx, x, "mlp", true, sink)?;
    sink.emit(
        Some(ctx.layer),
        &ctx.name("mlp"),
        OpKind::Sum,
        &out,
        &[&out],
        &[],
    )?;
    Ok(out)
}

/// MoE: router, the chosen routed experts (each fetched once for all tokens routed to it), and
/// the shared experts.
pub fn moe(ctx: &LayerCtx, x: &Tensor, sink: &mut Sink) -> Result<Tensor> {
    let b = ctx.backend;
    let l = Some(ctx.layer);
    let moe = ctx
        .layout
        .moe
        .as_ref()
        .expect("validated: MoE layers have a moe section");
    let w = ctx.weight("mlp.gate.weight")?;
    let logits = b.linear(x, &w, None)?;
    sink.emit(
        l,
        &ctx.name("mlp.gate"),
        OpKind::Linear,
        &logits,
        &[x],
        &[&w],
    )?;
    let bias = ctx.weight("mlp.gate.e_score_correction_bias")?;
    let routing = b.route(&logits, &bias, moe)?;
    let n = x.rows();
    let k = moe.num_experts_per_tok;
    let ids: Vec<usize> = routing.experts.iter().flatten().copied().collect();
    let ids = Tensor::from_indices(&[n, k], &ids);
    sink.emit(
        l,
        &ctx.name("mlp.gate.topk_indices"),
        OpKind::Router,
        &ids,
        &[&logits],
        &[&bias],
    )?;
    let weights = Tensor::from_vec(&[n, k], routing.weights.iter().flatten().copied().collect());
    sink.emit(
        l,
        &ctx.name("mlp.gate.topk_weights"),
        OpKind::Router,
        &weights,
        &[&logits],
        &[],
    )?;

    // Tokens per expert, in ascending expert order (the order HF accumulates in).
    let mut per_expert: Vec<(Vec<usize>, Vec<f32>)> =
        vec![(Vec::new(), Vec::new()); moe.n_routed_experts];
    for (t, (es, ws)) in routing.experts.iter().zip(&routing.weights).enumerate() {
        for (&e, &w) in es.iter().zip(ws) {
            per_expert[e].0.push(t);
            per_expert[e].1.push(w);
        }
    }
    let mut routed = Tensor::zeros(x.shape())?;
    for (e, (tokens, token_weights)) in per_expert.iter().enumerate() {
        if tokens.is_empty() {
            continue;
        }
        let xs = b.gather_rows(x, tokens)?;
        let wg = ctx
            .weights
            .get(&expert_weight_name(ctx.layer, e, "gate_proj"))?;
        let wu = ctx
            .weights
            .get(&expert_weight_name(ctx.layer, e, "up_proj"))?;
        let wd = ctx
            .weights
            .get(&expert_weight_name(ctx.layer, e, "down_proj"))?;
        let act = b.silu_mul(&b.linear(&xs, &wg, None)?, &b.linear(&xs, &wu, None)?)?;
        let y = b.linear(&act, &wd, None)?;
        b.scatter_add_rows(&mut routed, tokens, &y, token_weights)?;
    }
    sink.emit(
        l,
        &ctx.name("mlp.experts"),
        OpKind::Experts,
        &routed,
        &[x, &ids, &weights],
        &[],
    )?;
    if moe.n_shared_experts == 0 {
        sink.emit(l, &ctx.name("mlp"), OpKind::Sum, &routed, &[&routed], &[])?;
        return Ok(routed);
    }
    let shared = gated_mlp(ctx, x, "mlp.shared_experts", false, sink)?;
    sink.emit(
        l,
        &ctx.name("mlp.shared_experts"),
        OpKind::Linear,
        &shared,
        &[x],
        &[],
    )?;
    let out = b.add(&routed, &shared)?;
    sink.emit(
        l,
        &ctx.name("mlp"),
        OpKind::Sum,
        &out,
        &[&routed, &shared],
        &[],
    )?;
    Ok(out)
}
