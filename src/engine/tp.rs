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
use crate::backend::{AllReduce, Backend};
use crate::error::Result;
use crate::model::layout::Layout;
use crate::model::shard;
use crate::model::{Model, WeightStore};
use crate::tensor::Tensor;
use std::sync::Arc;

/// One rank's share of the model and its caches.
pub struct RankState {
    /// The layout the rank runs: its share of the heads.
    pub layout: Layout,
    /// Its weights; `None` for the single rank of a run without tensor parallelism (the
    /// model's own).
    weights: Option<Arc<WeightStore>>,
    /// One entry per layer of the model; `None` outside the layer range.
    pub caches: Vec<Option<LayerCache>>,
}

impl RankState {
    /// The ranks of a run of `model` under `options` (one without tensor parallelism).
    pub fn all(model: &Model, options: &EngineOptions) -> Result<Vec<RankState>> {
        let layout = &model.layout;
        let tp = options.tp.max(1);
        let stores = match tp {
            1 => Vec::new(),
            _ => model.rank_stores.of(&model.weights, layout, tp)?,
        };
        (0..tp)
            .map(|rank| {
                let layout = match tp {
                    1 => layout.clone(),
                    _ => shard::rank_layout(layout, tp)?,
                };
                let weights = stores.get(rank).cloned();
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

    /// The weights it reads: its own, or the model's for the single rank of a run without
    /// tensor parallelism.
    pub fn weights<'a>(&'a self, model: &'a Model) -> &'a WeightStore {
        self.weights.as_deref().unwrap_or(&model.weights)
    }

    /// The layout it runs, the weights it reads and its caches, borrowed apart.
    pub fn parts<'a>(
        &'a mut self,
        model: &'a Model,
    ) -> (&'a Layout, &'a WeightStore, &'a mut Vec<Option<LayerCache>>) {
        let weights = self.weights.as_deref().unwrap_or(&model.weights);
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

/// The ranks of a pass: each one's weights and backend, and the sum across their devices (none:
/// each rank sums the parts itself).
#[derive(Clone, Copy)]
pub struct PassRanks<'a, 'p> {
    pub stores: &'p [&'a WeightStore],
    pub backends: &'p [&'a dyn Backend],
    pub device_sum: Option<&'a dyn AllReduce>,
}

/// The all-reduce after op `op` (its partial sums `parts`, one per rank): one event per rank,
/// each the sum of every part, on its rank's backend. With one rank, `parts` as they are.
/// The ranks' sum (the CPU's, in rank order; NCCL's across GPUs) gives every rank the same
/// values; ranks sharing one GPU each sum the parts in rank order themselves.
/// FAULT tp-missing-allreduce: after o_proj each rank keeps its own partial sum.
/// FAULT tp-double-reduce: after o_proj the sum is reduced again (N times the sum).
pub fn all_reduce<'a>(
    sink: &mut Sink<'a>,
    ranks: PassRanks<'a, '_>,
    layer: Option<usize>,
    op: &str,
    parts: Vec<Tensor>,
    faults: &super::faults::Faults,
) -> Result<Vec<Tensor>> {
    if parts.len() == 1 {
        return Ok(parts);
    }
    let attention = op.ends_with(".self_attn.o_proj");
    let active = |f: Fault| attention && faults.active(f, sink.phase);
    let (missing, double) = (
        active(Fault::TpMissingAllreduce),
        active(Fault::TpDoubleReduce),
    );
    let n = parts.len();
    // The ranks' sum runs at the first rank whose all-reduce is computed (not at all when every
    // rank's is replayed); ranks that share a GPU each sum for themselves.
    let mut device_sums: Option<Vec<Option<Tensor>>> = None;
    let kind = (shard::Collective::AllReduce, OpKind::AllReduce);
    collective(sink, ranks, layer, op, kind, &parts, |b, r| {
        let mut sum = || -> Result<Tensor> {
            let Some(device) = ranks.device_sum else {
                let mut total = b.scale(&parts[0], 1.0)?;
                for p in &parts[1..] {
                    total = b.add(&total, p)?;
                }
                return Ok(total);
            };
            if device_sums.is_none() {
                let all = device.sum(&parts.iter().collect::<Vec<_>>())?;
                device_sums = Some(all.into_iter().map(Some).collect());
            }
            device_sums
                .as_mut()
                .and_then(|s| s.get_mut(r))
                .and_then(Option::take)
                .ok_or_else(|| crate::Error::invalid("an all-reduce without this rank's sum"))
        };
        match () {
            _ if missing => b.scale(&parts[r], 1.0),
            _ if double => b.scale(&sum()?, n as f32),
            _ => sum(),
        }
    })
}

/// The all-gather after op `op`: every rank's part [rows, width_r] side by side along the last
/// dimension, one event per rank, made on each rank's backend (a part on another device is read
/// through the host). With one rank, `parts` as they are.
pub fn all_gather<'a>(
    sink: &mut Sink<'a>,
    ranks: PassRanks<'a, '_>,
    layer: Option<usize>,
    op: &str,
    parts: Vec<Tensor>,
) -> Result<Vec<Tensor>> {
    if parts.len() == 1 {
        return Ok(parts);
    }
    let kind = (shard::Collective::AllGather, OpKind::AllGather);
    collective(sink, ranks, layer, op, kind, &parts, |b, _| {
        let mut whole = b.scale(&parts[0], 1.0)?;
        for p in &parts[1..] {
            whole = b.concat_groups(&whole, p, 1)?;
        }
        let rows = parts[0].rows();
        let width = whole.numel() / rows.max(1);
        Ok(whole.reshaped(&[rows, width]))
    })
}

/// A collective after op `op` over the ranks' `parts`: rank r's output is `output(backend_r,
/// r)`, reported as op `OP.SUFFIX` of rank r reading every part.
fn collective<'a>(
    sink: &mut Sink<'a>,
    ranks: PassRanks<'a, '_>,
    layer: Option<usize>,
    op: &str,
    (collective, kind): (shard::Collective, OpKind),
    parts: &[Tensor],
    mut output: impl FnMut(&dyn Backend, usize) -> Result<Tensor>,
) -> Result<Vec<Tensor>> {
    let name = format!("{op}.{}", collective.suffix());
    let inputs: Vec<&Tensor> = parts.iter().collect();
    let mut out = Vec::with_capacity(parts.len());
    for (r, store) in ranks.stores.iter().enumerate() {
        let b = ranks.backends[r];
        sink.set_rank(Some(r), store, b);
        out.push(sink.op(layer, &name, kind, &inputs, |_| output(b, r))?);
    }
    Ok(out)
}
