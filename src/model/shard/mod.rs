//! Tensor parallelism's plan for MLA models: which weight is split how across N ranks, written
//! once here for the engine (each rank's weights) and the debugger (which slice of an unsharded
//! tensor a rank's shard is). It follows vLLM's sharding of DeepSeek-V3 and GLM-5 (SGLang's is
//! the same for these layers):
//!
//! | weights | split | why |
//! |---|---|---|
//! | `q_proj`, `q_b_proj`, `kv_b_proj` | rows, by heads | column-parallel: a rank computes its heads' queries and K/V (its W_UK/W_UV slice for absorption) |
//! | `o_proj` | columns, by heads | row-parallel: each rank's heads give a partial sum, all-reduced |
//! | `q_a_proj`, `kv_a_proj_with_mqa`, their norms | replicated | the latent is the same on every rank, and so is the latent cache |
//! | the DSA indexer | replicated | every rank selects the same keys |
//! | the MoE router (`gate`) | replicated | every rank routes alike |
//! | routed experts | whole, one owner each | expert parallel: expert e on rank ⌊e·N/E⌋; the combine is an all-reduce |
//! | shared experts, the dense MLP | gate/up by rows, down by columns | column- then row-parallel, all-reduced |
//! | `embed_tokens`, `lm_head` | rows, by vocabulary | vocab-parallel: a masked lookup all-reduced; logits all-gathered |
//! | layer norms, `model.norm` | replicated | |
//!
//! A row-parallel layer's bias is held by every rank but added by rank 0 alone: the all-reduce
//! would otherwise add it once per rank.
//!
//! [`RankSource`] is one rank's weights read from the full model's source, as the plan cuts them.
//!
//! What the ranks' outputs are, for the debugger (which compares them with an unsharded run):
//! an op after a column-parallel weight holds the rank's heads or columns, a slice of the
//! unsharded output along one dimension; an op before an all-reduce ([`partial_sum`]) holds a
//! partial sum, which only the all-reduce's output can be compared with; every other op is
//! replicated, the same on every rank. The collectives are ops of their own, named after the op
//! whose partial sums or parts they take ([`collective_of`]).

mod rank;

pub use rank::RankSource;

use super::catalog::Catalog;
use super::layout::Layout;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// How one weight is split over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Whole on every rank.
    Replicated,
    /// Column-parallel: the rows (output features) of [out, in] in N equal parts of whole
    /// `unit`s (a head's rows).
    Rows { unit: usize },
    /// Row-parallel: the columns (input features) in N equal parts of whole `unit`s; the ranks'
    /// products are partial sums.
    Columns { unit: usize },
    /// Expert parallel: routed expert `expert`, whole on the rank that owns it, absent on the
    /// others.
    Expert { expert: usize },
    /// Vocab-parallel: the rows (vocabulary entries) in parts of ⌈V/N⌉, the last one shorter.
    Vocab,
}

/// What a rank holds of a tensor of shape [rows, cols...] viewed as a matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shard {
    /// The whole tensor.
    Whole,
    /// Rows `start..start + len`.
    Rows { start: usize, len: usize },
    /// Columns `start..start + len` of every row.
    Columns { start: usize, len: usize },
    /// Nothing (an expert another rank owns).
    Absent,
}

/// The split of the weight `name` of `layout` (a name of its [`Catalog`]).
pub fn split_of(layout: &Layout, name: &str) -> Result<Split> {
    let unknown = || Error::invalid(format!("tensor parallelism: no rule for the weight {name}"));
    let qk = layout.qk_head_dim();
    let rule = match name {
        "model.embed_tokens.weight" | "lm_head.weight" => return Ok(Split::Vocab),
        "model.norm.weight" => return Ok(Split::Replicated),
        _ => {
            // model.layers.L.<module path>
            let rest = name.strip_prefix("model.layers.").ok_or_else(unknown)?;
            rest.split_once('.')
                .map(|(_, path)| path)
                .ok_or_else(unknown)?
        }
    };
    if let Some(expert) = rule.strip_prefix("mlp.experts.") {
        let (e, _) = expert.split_once('.').ok_or_else(unknown)?;
        let expert = e.parse::<usize>().map_err(|_| unknown())?;
        return Ok(Split::Expert { expert });
    }
    if rule.starts_with("self_attn.indexer.") {
        return Ok(Split::Replicated);
    }
    Ok(match rule {
        "self_attn.q_proj.weight" | "self_attn.q_b_proj.weight" => Split::Rows { unit: qk },
        "self_attn.kv_b_proj.weight" => Split::Rows {
            unit: layout.qk_nope_head_dim + layout.v_head_dim,
        },
        "self_attn.o_proj.weight" => Split::Columns {
            unit: layout.v_head_dim,
        },
        "mlp.gate_proj.weight"
        | "mlp.up_proj.weight"
        | "mlp.shared_experts.gate_proj.weight"
        | "mlp.shared_experts.up_proj.weight" => Split::Rows { unit: 1 },
        "mlp.down_proj.weight" | "mlp.shared_experts.down_proj.weight" => {
            Split::Columns { unit: 1 }
        }
        "input_layernorm.weight"
        | "post_attention_layernorm.weight"
        | "self_attn.q_a_proj.weight"
        | "self_attn.q_a_proj.bias"
        | "self_attn.q_a_layernorm.weight"
        | "self_attn.kv_a_proj_with_mqa.weight"
        | "self_attn.kv_a_proj_with_mqa.bias"
        | "self_attn.kv_a_layernorm.weight"
        | "self_attn.o_proj.bias"
        | "mlp.gate.weight"
        | "mlp.gate.e_score_correction_bias" => Split::Replicated,
        _ => return Err(unknown()),
    })
}

/// The most tensor-parallel ranks a run may ask for (each holds its own weights and caches).
pub const MAX_TP: usize = 64;

/// Checks that `layout` splits into `tp` ranks: at least one and at most [`MAX_TP`], and heads,
/// MLP widths and routed experts in whole equal parts (as vLLM requires). The error names what
/// does not divide.
pub fn check_tp(layout: &Layout, tp: usize) -> Result<()> {
    if !(1..=MAX_TP).contains(&tp) {
        return Err(Error::invalid(format!(
            "--tp {tp}: a rank count from 1 to {MAX_TP}"
        )));
    }
    let mut widths = vec![
        ("attention heads", layout.num_heads),
        (
            "dense MLP width (intermediate_size)",
            layout.intermediate_size,
        ),
    ];
    if let Some(moe) = &layout.moe {
        widths.push(("routed experts", moe.n_routed_experts));
        if moe.n_shared_experts > 0 {
            widths.push((
                "shared experts' width",
                moe.moe_intermediate_size * moe.n_shared_experts,
            ));
        }
    }
    match widths.iter().find(|(_, n)| n % tp != 0) {
        Some((what, n)) => Err(Error::invalid(format!(
            "--tp {tp}: the {n} {what} of {} do not split into {tp} equal parts",
            layout.name
        ))),
        None => Ok(()),
    }
}

/// The rank that owns routed expert `expert` of `experts` over `tp` ranks (contiguous blocks).
pub fn expert_owner(expert: usize, experts: usize, tp: usize) -> usize {
    expert * tp / experts.max(1)
}

/// What rank `rank` of `tp` holds of a tensor of `shape` split by `split`.
pub fn shard_of(split: Split, shape: &[usize], tp: usize, rank: usize, experts: usize) -> Shard {
    let rows = shape.first().copied().unwrap_or(1);
    let cols: usize = shape.iter().skip(1).product();
    let part = |total: usize, unit: usize| {
        let len = total / tp / unit.max(1) * unit.max(1);
        (rank * len, len)
    };
    match split {
        Split::Replicated => Shard::Whole,
        _ if tp == 1 => Shard::Whole,
        Split::Rows { unit } => {
            let (start, len) = part(rows, unit);
            Shard::Rows { start, len }
        }
        Split::Columns { unit } => {
            let (start, len) = part(cols, unit);
            Shard::Columns { start, len }
        }
        Split::Expert { expert } => match expert_owner(expert, experts, tp) == rank {
            true => Shard::Whole,
            false => Shard::Absent,
        },
        Split::Vocab => {
            let per = rows.div_ceil(tp);
            let start = (rank * per).min(rows);
            Shard::Rows {
                start,
                len: per.min(rows - start),
            }
        }
    }
}

/// What rank `rank` of `tp` holds of the weight `name` of `layout`, of shape `shape`.
pub fn weight_shard(
    layout: &Layout,
    name: &str,
    shape: &[usize],
    tp: usize,
    rank: usize,
) -> Result<Shard> {
    let experts = layout.moe.as_ref().map_or(0, |m| m.n_routed_experts);
    Ok(shard_of(split_of(layout, name)?, shape, tp, rank, experts))
}

/// Rank `rank`'s shard of the weight `name` of `layout` (`None` where it holds nothing).
pub fn shard_weight(
    layout: &Layout,
    name: &str,
    full: &Tensor,
    tp: usize,
    rank: usize,
) -> Result<Option<Tensor>> {
    Ok(match weight_shard(layout, name, full.shape(), tp, rank)? {
        Shard::Whole => Some(full.alias()),
        Shard::Absent => None,
        Shard::Rows { start, len } => Some(rows_of(full, start, len)),
        Shard::Columns { start, len } => Some(columns_of(full, start, len)),
    })
}

/// Rows `start..start + len` of `t` viewed as a matrix.
fn rows_of(t: &Tensor, start: usize, len: usize) -> Tensor {
    let cols = t.numel() / t.rows().max(1);
    let mut shape = t.shape().to_vec();
    shape[0] = len;
    Tensor::from_vec(
        &shape,
        t.data()[start * cols..(start + len) * cols].to_vec(),
    )
}

/// Columns `start..start + len` of every row of `t` viewed as a matrix [rows, cols].
fn columns_of(t: &Tensor, start: usize, len: usize) -> Tensor {
    let rows = t.rows();
    let mut data = vec![0.0f32; rows * len];
    copy_columns(t.data(), t.numel() / rows.max(1), start, &mut data, len);
    Tensor::from_vec(&[rows, len], data)
}

/// Columns `start..start + len` of the rows of `whole` (rows of `cols` values) into the rows of
/// `out` (rows of `len`).
fn copy_columns(whole: &[f32], cols: usize, start: usize, out: &mut [f32], len: usize) {
    for (r, dst) in out.chunks_mut(len.max(1)).enumerate() {
        dst.copy_from_slice(&whole[r * cols + start..][..len]);
    }
}

/// The layout one rank of `tp` runs: its share of the attention heads (every other number is
/// the model's; the MLP and experts take their widths from the weights they are handed).
pub fn rank_layout(layout: &Layout, tp: usize) -> Result<Layout> {
    check_tp(layout, tp)?;
    Ok(Layout {
        num_heads: layout.num_heads / tp,
        ..layout.clone()
    })
}

/// Rank `rank` of `tp`'s weights over the full model's store, with a share of its byte budget.
pub fn rank_store(
    full: &super::WeightStore,
    layout: &Layout,
    tp: usize,
    rank: usize,
) -> Result<super::WeightStore> {
    let source = RankSource::new(full.source(), layout, tp, rank)?;
    let store = super::WeightStore::with_catalog(
        source.catalog(),
        Box::new(source),
        full.budget_bytes() / tp.max(1),
    )?;
    // Each rank has a device of its own: `--device-cache-gb` bounds each.
    store.set_device_budget(full.device_budget());
    Ok(store)
}

/// The rank stores last made for a model, with their rank count: a second run at the same TP
/// (a benchmark's, the debugger's re-runs) finds its weights fetched, and on a device uploaded.
/// One rank count's stores are kept at a time, so memory stays that of one cut of the model.
#[derive(Default)]
pub struct RankStores(std::sync::Mutex<Option<(usize, Vec<std::sync::Arc<super::WeightStore>>)>>);

impl RankStores {
    /// Every rank's store of `tp` over `full`, made the first time they are asked for.
    pub fn of(
        &self,
        full: &super::WeightStore,
        layout: &Layout,
        tp: usize,
    ) -> Result<Vec<std::sync::Arc<super::WeightStore>>> {
        let mut made = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match &*made {
            Some((n, stores)) if *n == tp => Ok(stores.clone()),
            _ => {
                let stores = (0..tp)
                    .map(|r| rank_store(full, layout, tp, r).map(std::sync::Arc::new))
                    .collect::<Result<Vec<_>>>()?;
                *made = Some((tp, stores.clone()));
                Ok(stores)
            }
        }
    }
}

/// The first row of the vocabulary rank `rank` of `tp` holds, and how many it holds.
pub fn vocab_part(vocab: usize, tp: usize, rank: usize) -> (usize, usize) {
    match shard_of(Split::Vocab, &[vocab, 1], tp, rank, 0) {
        Shard::Rows { start, len } => (start, len),
        _ => (0, vocab),
    }
}

/// Which collective a tensor-parallel pass runs after an op, and the ops it runs after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// The ranks' partial sums summed, the sum on every rank.
    AllReduce,
    /// The ranks' parts laid side by side along the last dimension, the whole on every rank.
    AllGather,
}

impl Collective {
    /// The suffix of the collective op's name: `model.layers.3.mlp.all_reduce`.
    pub fn suffix(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
        }
    }
}

/// Whether the op `name` of a tensor-parallel rank outputs a partial sum (its all-reduce's
/// output is the unsharded op's).
pub fn partial_sum(name: &str) -> bool {
    name == "model.embed_tokens"
        || [
            ".self_attn.o_proj",
            ".mlp.down_proj",
            ".mlp.experts",
            ".mlp.shared_experts",
            ".mlp",
        ]
        .iter()
        .any(|s| name.ends_with(s) && name.starts_with("model.layers."))
}

/// For a collective op's name, the collective and the op of an unsharded run that its output
/// equals: `model.layers.3.mlp.all_reduce` → (all-reduce, `model.layers.3.mlp`).
pub fn collective_of(name: &str) -> Option<(Collective, &str)> {
    [Collective::AllReduce, Collective::AllGather]
        .into_iter()
        .find_map(|c| {
            let stem = name.strip_suffix(c.suffix())?.strip_suffix('.')?;
            Some((c, stem))
        })
}

/// For an op whose rows join several parts that are each split by heads, the parts' widths in
/// the unsharded run: the naive path's expanded cache rows are [K of every head | V of every
/// head], so a rank's row is its heads' K then its heads' V, not one slice of the whole row.
pub fn head_parts(layout: &Layout, name: &str) -> Option<[usize; 2]> {
    let expanded =
        name.ends_with(".self_attn.kv_cache") || name.ends_with(".self_attn.kv_cache_backfill");
    expanded.then(|| {
        [
            layout.num_heads * layout.qk_head_dim(),
            layout.num_heads * layout.v_head_dim,
        ]
    })
}

/// Where rank `rank` of `tp`'s output of shape `mine` sits in the unsharded output of shape
/// `whole`: the dimension it is a slice of, the slice's start and length (`None` for the whole);
/// an error where the shapes are not a rank's slice of one dimension.
pub fn slice_in_whole(
    mine: &[usize],
    whole: &[usize],
    tp: usize,
    rank: usize,
) -> std::result::Result<Option<(usize, usize, usize)>, String> {
    if mine == whole {
        return Ok(None);
    }
    let differs: Vec<usize> = (0..mine.len()).filter(|&d| mine[d] != whole[d]).collect();
    let fits = mine.len() == whole.len() && differs.len() == 1;
    let d = differs.first().copied().filter(|_| fits).ok_or_else(|| {
        format!("rank {rank}'s shape {mine:?} is not one rank's slice of the unsharded {whole:?}")
    })?;
    // Equal parts (heads, columns), or the vocabulary's parts of ⌈V/N⌉ with a shorter last.
    let start = rank * whole[d].div_ceil(tp);
    match start + mine[d] <= whole[d] && mine[d] == whole[d].div_ceil(tp).min(whole[d] - start) {
        true => Ok(Some((d, start, mine[d]))),
        false => Err(format!(
            "rank {rank}'s shape {mine:?} is not rank {rank} of {tp}'s slice of {whole:?}"
        )),
    }
}

/// Every weight of `layout` has a rule (a layout's catalog checked whole).
pub fn check_plan(layout: &Layout) -> Result<()> {
    Catalog::new(layout)
        .iter()
        .try_for_each(|(name, _)| split_of(layout, name).map(|_| ()))
}

#[cfg(test)]
mod tests;
