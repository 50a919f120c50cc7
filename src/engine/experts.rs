//! The routed experts of an MoE layer in the trace: their weighted sum per token
//! (`mlp.experts`), and with `--expert-ops` first one op per chosen expert (`mlp.experts.E`: the
//! down projection of its tokens, before their routing weights, rows in token order). The backend computes them all in one call
//! ([`Backend::routed_experts`]), made by whichever of these ops is computed first: a replay
//! may take any of them from an earlier run.

use super::attention::LayerCtx;
use super::sink::Sink;
use super::trace::{BufferRef, OpKind};
use crate::backend::experts::{ExpertJob, ExpertWeights, RoutedOutput};
use crate::error::{Error, Result};
use crate::model::catalog::expert_weight_name;
use crate::tensor::Tensor;
use std::collections::HashMap;

/// The experts' ops after the router: `ids` and `weights` [n, top_k] are its choice.
pub fn routed(
    ctx: &LayerCtx,
    x: &Tensor,
    ids: &Tensor,
    weights: &Tensor,
    sink: &mut Sink,
) -> Result<Tensor> {
    let l = Some(ctx.layer);
    let jobs = jobs(ctx, ids, weights)?;
    if !ctx.expert_ops {
        let inputs = [x, ids, weights];
        return sink.op(l, &ctx.name("mlp.experts"), OpKind::Experts, &inputs, |r| {
            let mut fetch = |e: usize| {
                let name = |proj| expert_weight_name(ctx.layer, e, proj);
                Ok(ExpertWeights {
                    gate: r.weight(&name("gate_proj"))?,
                    up: r.weight(&name("up_proj"))?,
                    down: r.weight(&name("down_proj"))?,
                })
            };
            Ok(ctx.backend.routed_experts(x, &jobs, &mut fetch, false)?.sum)
        });
    }
    let mut batched = Batched {
        ctx,
        x,
        jobs: &jobs,
        done: None,
    };
    let mut outputs = Vec::with_capacity(jobs.len());
    for (i, job) in jobs.iter().enumerate() {
        let name = ctx.name(&format!("mlp.experts.{}", job.expert));
        outputs.push(sink.op(l, &name, OpKind::Expert, &[x], |r| {
            let done = batched.get()?;
            for w in done.reads.get(&job.expert).into_iter().flatten() {
                r.fetched(*w);
            }
            done.per_job
                .get_mut(i)
                .and_then(Option::take)
                .ok_or_else(|| Error::invalid("an expert's output was asked for twice"))
        })?);
    }
    let mut inputs: Vec<&Tensor> = vec![ids, weights];
    inputs.extend(&outputs);
    sink.op(
        l,
        &ctx.name("mlp.experts"),
        OpKind::Experts,
        &inputs,
        |_| {
            batched
                .get()?
                .sum
                .take()
                .ok_or_else(|| Error::invalid("the experts' sum was asked for twice"))
        },
    )
}

/// Tokens per chosen expert, in ascending expert order (the order HF accumulates in), of the
/// experts this rank owns (expert parallel: another rank computes the others).
fn jobs(ctx: &LayerCtx, ids: &Tensor, weights: &Tensor) -> Result<Vec<ExpertJob>> {
    let moe = ctx
        .layout
        .moe
        .as_ref()
        .expect("validated: MoE layers have a moe section");
    let mut per_expert: Vec<(Vec<usize>, Vec<f32>)> =
        vec![(Vec::new(), Vec::new()); moe.n_routed_experts];
    for t in 0..ids.rows() {
        for (&e, &w) in ids.row(t).iter().zip(weights.row(t)) {
            let slot = per_expert
                .get_mut(e as usize)
                .filter(|_| e >= 0.0)
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "the router chose expert {e} of {}",
                        moe.n_routed_experts
                    ))
                })?;
            slot.0.push(t);
            slot.1.push(w);
        }
    }
    Ok(per_expert
        .into_iter()
        .enumerate()
        .filter(|(e, (tokens, _))| {
            !tokens.is_empty() && ctx.tp.owns_expert(*e, moe.n_routed_experts)
        })
        .map(|(expert, (tokens, weights))| ExpertJob {
            expert,
            tokens,
            weights,
        })
        .collect())
}

/// The one backend call behind the experts' ops, made when the first of them needs it.
struct Batched<'a> {
    ctx: &'a LayerCtx<'a>,
    x: &'a Tensor,
    jobs: &'a [ExpertJob],
    done: Option<Done>,
}

struct Done {
    /// Taken by the ops as they are computed.
    per_job: Vec<Option<Tensor>>,
    sum: Option<Tensor>,
    /// Each expert's weights as read, for its op's reads.
    reads: HashMap<usize, [BufferRef; 3]>,
}

impl Batched<'_> {
    fn get(&mut self) -> Result<&mut Done> {
        if self.done.is_none() {
            let (ctx, mut reads) = (self.ctx, HashMap::new());
            let mut fetch = |e: usize| {
                let get = |proj| ctx.weights.get(&expert_weight_name(ctx.layer, e, proj));
                let w = ExpertWeights {
                    gate: get("gate_proj")?,
                    up: get("up_proj")?,
                    down: get("down_proj")?,
                };
                reads.insert(e, [&w.gate, &w.up, &w.down].map(|t| BufferRef::weight(t)));
                Ok(w)
            };
            let out: RoutedOutput = ctx
                .backend
                .routed_experts(self.x, self.jobs, &mut fetch, true)?;
            if out.per_job.len() != self.jobs.len() {
                return Err(Error::invalid(format!(
                    "the experts' call returned {} outputs for {} experts",
                    out.per_job.len(),
                    self.jobs.len()
                )));
            }
            self.done = Some(Done {
                per_job: out.per_job.into_iter().map(Some).collect(),
                sum: Some(out.sum),
                reads,
            });
        }
        Ok(self.done.as_mut().expect("made above"))
    }
}
