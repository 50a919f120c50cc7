//! The feed-forward half of a layer: a dense SiLU-gated MLP, or MoE (the routed experts, handed
//! to the backend together, plus shared experts).

use super::attention::LayerCtx;
use super::sink::{Reads, Sink};
use super::trace::OpKind;
use crate::backend::Backend;
use crate::error::Result;
use crate::tensor::Tensor;

/// down(SiLU(gate(x)) · up(x)) with the three weights named.
fn gated(
    b: &dyn Backend,
    r: &mut Reads,
    x: &Tensor,
    gate: &str,
    up: &str,
    down: &str,
) -> Result<Tensor> {
    let (wg, wu, wd) = (r.weight(gate)?, r.weight(up)?, r.weight(down)?);
    let act = b.silu_mul(&b.linear(x, &wg, None)?, &b.linear(x, &wu, None)?)?;
    b.linear(&act, &wd, None)
}

/// Dense MLP, op by op; its output is also reported as the `mlp` module's output.
pub fn dense(ctx: &LayerCtx, x: &Tensor, sink: &mut Sink) -> Result<Tensor> {
    let (b, l) = (ctx.backend, Some(ctx.layer));
    let gate = sink.op(l, &ctx.name("mlp.gate_proj"), OpKind::Linear, &[x], |r| {
        b.linear(x, &*r.weight(&ctx.name("mlp.gate_proj.weight"))?, None)
    })?;
    let up = sink.op(l, &ctx.name("mlp.up_proj"), OpKind::Linear, &[x], |r| {
        b.linear(x, &*r.weight(&ctx.name("mlp.up_proj.weight"))?, None)
    })?;
    let act = sink.op(
        l,
        &ctx.name("mlp.act_fn"),
        OpKind::Activation,
        &[&gate, &up],
        |_| b.silu_mul(&gate, &up),
    )?;
    let down = sink.op(
        l,
        &ctx.name("mlp.down_proj"),
        OpKind::Linear,
        &[&act],
        |r| b.linear(&act, &*r.weight(&ctx.name("mlp.down_proj.weight"))?, None),
    )?;
    sink.report(
        l,
        &ctx.name("mlp"),
        OpKind::Sum,
        &down,
        super::trace::BufferRef::of(&down),
        vec![super::trace::BufferRef::of(&down)],
    )?;
    Ok(down)
}

/// Imposes the forced expert choices of `op` (teacher forcing), with weights from this run's
/// own router scores at the forced experts.
fn force_routing(
    ctx: &LayerCtx,
    op: &str,
    logits: &Tensor,
    routed: &mut crate::backend::Routing,
) -> Result<()> {
    let Some(rows) = ctx.forced.rows(ctx.phase, op) else {
        return Ok(());
    };
    let moe = ctx
        .layout
        .moe
        .as_ref()
        .expect("MoE layers have a moe section");
    ctx.forced
        .apply(ctx.phase, op, &mut routed.experts, |_| moe.n_routed_experts)?;
    for &row in rows.keys() {
        let scores = super::moe::expert_scores(logits.row(row));
        routed.weights[row] = super::moe::weights_of(&scores, &routed.experts[row], moe);
    }
    Ok(())
}

/// MoE: router, the chosen routed experts (see [`super::experts`]), and the shared experts.
pub fn moe(ctx: &LayerCtx, x: &Tensor, sink: &mut Sink) -> Result<Tensor> {
    let (b, l) = (ctx.backend, Some(ctx.layer));
    let moe = ctx
        .layout
        .moe
        .as_ref()
        .expect("validated: MoE layers have a moe section");
    let n = x.rows();
    let k = moe.num_experts_per_tok;
    let logits = sink.op(l, &ctx.name("mlp.gate"), OpKind::Linear, &[x], |r| {
        b.linear(x, &*r.weight(&ctx.name("mlp.gate.weight"))?, None)
    })?;
    let mut routing = None;
    let bias_name = ctx.name("mlp.gate.e_score_correction_bias");
    let ids = sink.op(
        l,
        &ctx.name("mlp.gate.topk_indices"),
        OpKind::Router,
        &[&logits],
        |r| {
            let mut routed = b.route(&logits, &*r.weight(&bias_name)?, moe)?;
            force_routing(
                ctx,
                &ctx.name("mlp.gate.topk_indices"),
                &logits,
                &mut routed,
            )?;
            let ids: Vec<usize> = routed.experts.iter().flatten().copied().collect();
            routing = Some(routed);
            Ok(Tensor::from_indices(&[n, k], &ids))
        },
    )?;
    let weights = sink.op(
        l,
        &ctx.name("mlp.gate.topk_weights"),
        OpKind::Router,
        &[&logits],
        |r| {
            let routed = match routing.take() {
                Some(routed) => routed,
                None => {
                    let mut routed = b.route(&logits, &*r.weight(&bias_name)?, moe)?;
                    force_routing(
                        ctx,
                        &ctx.name("mlp.gate.topk_indices"),
                        &logits,
                        &mut routed,
                    )?;
                    routed
                }
            };
            Ok(Tensor::from_vec(
                &[n, k],
                routed.weights.iter().flatten().copied().collect(),
            ))
        },
    )?;

    let routed = super::experts::routed(ctx, x, &ids, &weights, sink)?;
    if moe.n_shared_experts == 0 {
        let buffer = super::trace::BufferRef::of(&routed);
        sink.report(
            l,
            &ctx.name("mlp"),
            OpKind::Sum,
            &routed,
            buffer,
            vec![buffer],
        )?;
        return Ok(routed);
    }
    let shared = sink.op(
        l,
        &ctx.name("mlp.shared_experts"),
        OpKind::Linear,
        &[x],
        |r| {
            let name = |proj: &str| ctx.name(&format!("mlp.shared_experts.{proj}.weight"));
            gated(
                b,
                r,
                x,
                &name("gate_proj"),
                &name("up_proj"),
                &name("down_proj"),
            )
        },
    )?;
    sink.op(
        l,
        &ctx.name("mlp"),
        OpKind::Sum,
        &[&routed, &shared],
        |_| b.add(&routed, &shared),
    )
}
