//! Tensor parallelism inside the engine: N ranks, each with its share of the weights (cut by the
//! plan of [`crate::model::shard`]), its share of the heads, and its own replica of the latent
//! cache, run one after another in one process between the collectives that join them. The
//! collectives are ops of the trace, one event per rank: the all-reduce sums the ranks' partial
//! sums in rank order (one f32 sum in one order, so every rank holds the same values), the
//! all-gather lays the ranks' parts side by side.
//!
//! Without tensor parallelism there is one rank holding the model's own weights, and no
//! collective runs.

use super::cache::{LatentCache, LayerCache};
use super::faults::Fault;
use super::forward::EngineOptions;
use super::sink::Sink;
use super::trace::OpKind;
use crate::error::Result;
use crate::model::layout::Layout;
use crate::model::shard;
use crate::model::{Model, WeightStore};
use crate::tensor::Tensor;

/// One rank's share of the model and its caches.
pub struct RankState {
    /// The layout the rank runs: its share of the heads.
    pub layout: Layout,
    /// Its weights; `None` for the single rank of a run without tensor parallelism (the
    /// model's own).
    weights: Option<WeightStore>,
    /// One entry per layer of the model; `None` outside the layer range.
    pub caches: Vec<Option<LayerCache>>,
}

impl RankState {
    /// The ranks of a run of `model` under `options` (one without tensor parallelism).
    pub fn all(model: &Model, options: &EngineOptions) -> Result<Vec<RankState>> {
        let layout = &model.layout;
        let tp = options.tp.max(1);
        (0..tp)
            .map(|rank| {
                let (layout, weights) = match tp {
                    1 => (layout.clone(), None),
                    _ => (
                        shard::rank_layout(layout, tp)?,
                        Some(shard::rank_store(&model.weights, layout, tp, rank)?),
                    ),
                };
                let caches = (0..layout.num_layers)
                    .map(|l| {
                        options.layers.contains(&l).then(|| LayerCache {
                            latent: LatentCache::with_dtype(
                                layout.latent_width(),
                                options.poison,
                                options.kv_cache,
                            ),
                            expanded: None,
                            index_keys: None,
                            kv_b_plain: None,
                        })
                    })
                    .collect();
                Ok(RankState {
                    layout,
                    weights,
                    caches,
                })
            })
            .collect()
    }

    /// The layout it runs, the weights it reads and its caches, borrowed apart.
    pub fn parts<'a>(
        &'a mut self,
        model: &'a Model,
    ) -> (&'a Layout, &'a WeightStore, &'a mut Vec<Option<LayerCache>>) {
        let weights = self.weights.as_ref().unwrap_or(&model.weights);
        (&self.layout, weights, &mut self.caches)
    }
}

/// Which rank runs a layer's ops, for the ops that differ by rank.
#[derive(Clone, Copy)]
pub struct TpRank<'a> {
    pub rank: usize,
    pub size: usize,
    /// The full model's weights: what the tensor-parallel faults misread.
    pub full: &'a WeightStore,
}

impl TpRank<'_> {
    /// Whether this rank computes routed expert `expert` of `experts` (expert parallel).
    pub fn owns_expert(&self, expert: usize, experts: usize) -> bool {
        self.size == 1 || shard::expert_owner(expert, experts, self.size) == self.rank
    }

    /// Whether this rank adds a row-parallel layer's bias (rank 0 alone: the all-reduce would
    /// add it once per rank).
    pub fn adds_row_parallel_bias(&self) -> bool {
        self.rank == 0
    }

    /// The trace's rank of this rank's events: `None` without tensor parallelism.
    pub fn trace_rank(&self) -> Option<usize> {
        (self.size > 1).then_some(self.rank)
    }
}

/// The all-reduce after op `op` (its partial sums `parts`, one per rank): one event per rank,
/// each the sum of every part in rank order. With one rank, `parts` as they are.
/// FAULT tp-missing-allreduce: after o_proj each rank keeps its own partial sum.
/// FAULT tp-double-reduce: after o_proj the sum is reduced again (N times the sum).
pub fn all_reduce<'a>(
    sink: &mut Sink<'a>,
    stores: &[&'a WeightStore],
    layer: Option<usize>,
    op: &str,
    parts: Vec<Tensor>,
    faults: &super::faults::Faults,
) -> Result<Vec<Tensor>> {
    let b = sink.backend;
    let attention = op.ends_with(".self_attn.o_proj");
    let active = |f: Fault| attention && faults.active(f, sink.phase);
    let (missing, double) = (
        active(Fault::TpMissingAllreduce),
        active(Fault::TpDoubleReduce),
    );
    let sum = |parts: &[Tensor]| -> Result<Tensor> {
        let mut total = b.scale(&parts[0], 1.0)?;
        for p in &parts[1..] {
            total = b.add(&total, p)?;
        }
        Ok(total)
    };
    let kind = (shard::Collective::AllReduce, OpKind::AllReduce);
    collective(sink, stores, layer, op, kind, parts, |parts, r| match () {
        _ if missing => b.scale(&parts[r], 1.0),
        _ if double => b.scale(&sum(parts)?, parts.len() as f32),
        _ => sum(parts),
    })
}

/// The all-gather after op `op`: every rank's part [rows, width_r] side by side along the last
/// dimension, one event per rank. With one rank, `parts` as they are.
pub fn all_gather<'a>(
    sink: &mut Sink<'a>,
    stores: &[&'a WeightStore],
    layer: Option<usize>,
    op: &str,
    parts: Vec<Tensor>,
) -> Result<Vec<Tensor>> {
    let b = sink.backend;
    let kind = (shard::Collective::AllGather, OpKind::AllGather);
    collective(sink, stores, layer, op, kind, parts, |parts, _| {
        let mut whole = b.scale(&parts[0], 1.0)?;
        for p in &parts[1..] {
            whole = b.concat_groups(&whole, p, 1)?;
        }
        let rows = parts[0].rows();
        let width = whole.numel() / rows.max(1);
        Ok(whole.reshaped(&[rows, width]))
    })
}

/// A collective after op `op` over the ranks' `parts`: rank r's output is `output(parts, r)`,
/// reported as op `OP.SUFFIX` of rank r reading every part. With one rank, `parts` as they are.
fn collective<'a>(
    sink: &mut Sink<'a>,
    stores: &[&'a WeightStore],
    layer: Option<usize>,
    op: &str,
    (collective, kind): (shard::Collective, OpKind),
    parts: Vec<Tensor>,
    output: impl Fn(&[Tensor], usize) -> Result<Tensor>,
) -> Result<Vec<Tensor>> {
    if parts.len() == 1 {
        return Ok(parts);
    }
    let name = format!("{op}.{}", collective.suffix());
    let inputs: Vec<&Tensor> = parts.iter().collect();
    let mut out = Vec::with_capacity(parts.len());
    for (r, store) in stores.iter().enumerate() {
        sink.set_rank(Some(r), store);
        out.push(sink.op(layer, &name, kind, &inputs, |_| output(&parts, r))?);
    }
    Ok(out)
}
