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

use super::catalog::Catalog;
use super::layout::Layout;
use super::quant::QuantTensor;
use super::weights::WeightSource;
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

/// Checks that `layout` splits into `tp` ranks: at least one, and heads, MLP widths and routed
/// experts in whole equal parts (as vLLM requires). The error names what does not divide.
pub fn check_tp(layout: &Layout, tp: usize) -> Result<()> {
    if tp == 0 {
        return Err(Error::invalid("--tp: at least 1 rank"));
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

/// Rank `rank`'s shard of the weight `name` of `layout` (`None` where it holds nothing).
pub fn shard_weight(
    layout: &Layout,
    name: &str,
    full: &Tensor,
    tp: usize,
    rank: usize,
) -> Result<Option<Tensor>> {
    let experts = layout.moe.as_ref().map_or(0, |m| m.n_routed_experts);
    let split = split_of(layout, name)?;
    Ok(match shard_of(split, full.shape(), tp, rank, experts) {
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
    let data = (0..rows)
        .flat_map(|r| t.row(r)[start..start + len].iter().copied())
        .collect();
    Tensor::from_vec(&[rows, len], data)
}

/// The weights one rank holds: each tensor of the full model as [`shard_of`] cuts it, read
/// from the full model's source (a row shard reads only its rows; a column shard reads whole
/// rows and keeps its columns). An expert another rank owns is not there. Quantized tensors keep
/// their blocks where the shard is whole blocks (rows always; columns when they start and end on
/// block boundaries); otherwise the rank reads them decoded.
pub struct RankSource {
    full: std::sync::Arc<dyn WeightSource>,
    layout: Layout,
    tp: usize,
    rank: usize,
}

impl RankSource {
    /// Rank `rank` of `tp` over the full model's `source`; the layout must divide (see
    /// [`check_tp`]).
    pub fn new(
        full: std::sync::Arc<dyn WeightSource>,
        layout: &Layout,
        tp: usize,
        rank: usize,
    ) -> Result<RankSource> {
        check_tp(layout, tp)?;
        if rank >= tp {
            return Err(Error::invalid(format!("rank {rank} of {tp}")));
        }
        Ok(RankSource {
            full,
            layout: layout.clone(),
            tp,
            rank,
        })
    }

    /// What this rank holds of `name` (`None`: not a weight of the layout).
    pub fn shard(&self, name: &str) -> Option<Shard> {
        let experts = self.layout.moe.as_ref().map_or(0, |m| m.n_routed_experts);
        let split = split_of(&self.layout, name).ok()?;
        let shape = self.full.shape(name)?;
        Some(shard_of(split, &shape, self.tp, self.rank, experts))
    }

    /// The shapes of the tensors this rank holds: the full model's catalog, cut.
    pub fn catalog(&self) -> Catalog {
        Catalog::new(&self.layout).filter_map(|name, spec| match self.shard(name)? {
            Shard::Absent => None,
            shard => Some(shard_shape(&spec.shape, shard)),
        })
    }
}

/// The shape of `shard` of a tensor of `shape`.
fn shard_shape(shape: &[usize], shard: Shard) -> Vec<usize> {
    let cols: usize = shape.iter().skip(1).product();
    match shard {
        Shard::Whole | Shard::Absent => shape.to_vec(),
        Shard::Rows { len, .. } => {
            let mut s = shape.to_vec();
            s[0] = len;
            s
        }
        Shard::Columns { len, .. } => vec![shape[0], len.min(cols)],
    }
}

impl WeightSource for RankSource {
    fn describe(&self) -> String {
        format!(
            "{}, rank {} of {}",
            self.full.describe(),
            self.rank,
            self.tp
        )
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        match self.shard(name)? {
            Shard::Absent => None,
            shard => Some(shard_shape(&self.full.shape(name)?, shard)),
        }
    }

    fn read_rows(&self, name: &str, start_row: usize, out: &mut [f32]) -> Result<()> {
        let absent = || Error::invalid(format!("{name}: not held by rank {}", self.rank));
        match self.shard(name).ok_or_else(absent)? {
            Shard::Absent => Err(absent()),
            Shard::Whole => self.full.read_rows(name, start_row, out),
            Shard::Rows { start, .. } => self.full.read_rows(name, start + start_row, out),
            Shard::Columns { start, len } => {
                let full_cols: usize = self.full.shape(name).ok_or_else(absent)?[1..]
                    .iter()
                    .product();
                let rows = out.len() / len.max(1);
                let mut whole = vec![0.0f32; rows * full_cols];
                self.full.read_rows(name, start_row, &mut whole)?;
                for (r, dst) in out.chunks_mut(len.max(1)).enumerate() {
                    dst.copy_from_slice(&whole[r * full_cols + start..][..len]);
                }
                Ok(())
            }
        }
    }

    fn readable(&self, name: &str) -> Result<()> {
        self.full.readable(name)
    }

    fn quantized(&self, name: &str) -> Option<Result<QuantTensor>> {
        let shard = self.shard(name)?;
        let full = match self.full.quantized(name)? {
            Ok(q) => q,
            Err(e) => return Some(Err(e)),
        };
        match shard {
            Shard::Absent => None,
            Shard::Whole => Some(Ok(full)),
            Shard::Rows { start, len } => Some(QuantTensor::new(
                full.ty,
                len,
                full.cols,
                full.rows_bytes(start, len).into(),
            )),
            Shard::Columns { start, len } => {
                let block = full.ty.block_size();
                if !start.is_multiple_of(block) || !len.is_multiple_of(block) {
                    return None; // read decoded
                }
                let (per_block, row_bytes) = (full.ty.type_size(), full.row_bytes());
                let (from, count) = (start / block * per_block, len / block * per_block);
                let bytes: Vec<u8> = (0..full.rows)
                    .flat_map(|r| {
                        full.bytes()[r * row_bytes + from..][..count]
                            .iter()
                            .copied()
                    })
                    .collect();
                Some(QuantTensor::new(full.ty, full.rows, len, bytes.into()))
            }
        }
    }

    fn original(&self, name: &str, start_row: usize, out: &mut [f32]) -> Option<Result<()>> {
        // The values before quantization, cut as the decoded ones are.
        let cols: usize = self.full.shape(name)?[1..].iter().product();
        match self.shard(name)? {
            Shard::Absent => None,
            Shard::Whole => self.full.original(name, start_row, out),
            Shard::Rows { start, .. } => self.full.original(name, start + start_row, out),
            Shard::Columns { start, len } => {
                let rows = out.len() / len.max(1);
                let mut whole = vec![0.0f32; rows * cols];
                if let Err(e) = self.full.original(name, start_row, &mut whole)? {
                    return Some(Err(e));
                }
                for (r, dst) in out.chunks_mut(len.max(1)).enumerate() {
                    dst.copy_from_slice(&whole[r * cols + start..][..len]);
                }
                Some(Ok(()))
            }
        }
    }
}

/// Every weight of `layout` has a rule (a layout's catalog checked whole).
pub fn check_plan(layout: &Layout) -> Result<()> {
    Catalog::new(layout)
        .iter()
        .try_for_each(|(name, _)| split_of(layout, name).map(|_| ()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layouts() -> Vec<Layout> {
        Layout::builtin_names()
            .into_iter()
            .map(|n| Layout::resolve(n).unwrap())
            .collect()
    }

    /// A tensor of `shape` whose every value is distinct.
    fn counting(shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_vec(shape, (0..n).map(|i| i as f32).collect())
    }

    #[test]
    fn every_weight_of_every_layout_has_a_rule() {
        for layout in layouts() {
            check_plan(&layout).unwrap_or_else(|e| panic!("{}: {e}", layout.name));
        }
        let glm5 = Layout::resolve("glm5").unwrap();
        assert!(split_of(&glm5, "model.layers.0.self_attn.unknown.weight").is_err());
        assert!(split_of(&glm5, "model.layers.0.mlp.experts.x.up_proj.weight").is_err());
    }

    #[test]
    fn the_attention_splits_by_heads_and_the_latent_stays_whole() {
        let l = Layout::resolve("glm5").unwrap();
        let name = |s: &str| format!("model.layers.3.self_attn.{s}");
        assert_eq!(
            split_of(&l, &name("kv_b_proj.weight")).unwrap(),
            Split::Rows {
                unit: l.qk_nope_head_dim + l.v_head_dim
            }
        );
        assert_eq!(
            split_of(&l, &name("o_proj.weight")).unwrap(),
            Split::Columns { unit: l.v_head_dim }
        );
        for replicated in [
            "kv_a_proj_with_mqa.weight",
            "q_a_proj.weight",
            "indexer.wk.weight",
        ] {
            assert_eq!(split_of(&l, &name(replicated)).unwrap(), Split::Replicated);
        }
        // GLM-5's 64 heads at TP 8: rank 3 holds heads 24..32 of kv_b_proj.
        let shape = [64 * (l.qk_nope_head_dim + l.v_head_dim), l.kv_lora_rank];
        let split = split_of(&l, &name("kv_b_proj.weight")).unwrap();
        let per_head = l.qk_nope_head_dim + l.v_head_dim;
        assert_eq!(
            shard_of(split, &shape, 8, 3, 0),
            Shard::Rows {
                start: 24 * per_head,
                len: 8 * per_head
            }
        );
    }

    #[test]
    fn shards_put_back_together_are_the_whole_tensor() {
        for layout in layouts().into_iter().filter(|l| l.name.ends_with("tiny")) {
            for tp in [1, 2, 4] {
                check_tp(&layout, tp).unwrap();
                for (name, spec) in Catalog::new(&layout).iter() {
                    let full = counting(&spec.shape);
                    let shards: Vec<Option<Tensor>> = (0..tp)
                        .map(|r| shard_weight(&layout, name, &full, tp, r).unwrap())
                        .collect();
                    let held: Vec<&Tensor> = shards.iter().flatten().collect();
                    let whole = |t: &&Tensor| t.data() == full.data();
                    match split_of(&layout, name).unwrap() {
                        Split::Replicated => assert!(held.len() == tp && held.iter().all(whole)),
                        Split::Expert { .. } => assert!(held.len() == 1 && whole(&held[0])),
                        Split::Rows { .. } | Split::Vocab => {
                            let rows: Vec<f32> =
                                held.iter().flat_map(|t| t.data().to_vec()).collect();
                            assert_eq!(rows, full.data(), "{name} at tp {tp}");
                        }
                        Split::Columns { .. } => {
                            for r in 0..full.rows() {
                                let row: Vec<f32> =
                                    held.iter().flat_map(|t| t.row(r).to_vec()).collect();
                                assert_eq!(row, full.row(r), "{name} at tp {tp}, row {r}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// x·Wᵀ for x [n, in] and W [out, in].
    fn linear(x: &Tensor, w: &Tensor) -> Vec<f64> {
        let (n, out, inp) = (x.rows(), w.rows(), w.cols());
        let mut y = vec![0.0f64; n * out];
        for t in 0..n {
            for o in 0..out {
                y[t * out + o] = (0..inp)
                    .map(|i| x.row(t)[i] as f64 * w.row(o)[i] as f64)
                    .sum();
            }
        }
        y
    }

    fn random(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let data = (0..n as u64)
            .map(|i| crate::model::weights::synthetic::normalish(seed, i))
            .collect();
        Tensor::from_vec(shape, data)
    }

    #[test]
    fn column_parallel_outputs_concatenate_and_row_parallel_ones_sum_to_the_whole() {
        let l = Layout::resolve("glm5-tiny").unwrap();
        let tp = 2;
        // kv_b_proj, column-parallel by heads: the ranks' outputs side by side.
        let name = "model.layers.0.self_attn.kv_b_proj.weight";
        let w = random(
            &[
                l.num_heads * (l.qk_nope_head_dim + l.v_head_dim),
                l.kv_lora_rank,
            ],
            1,
        );
        let c_kv = random(&[3, l.kv_lora_rank], 2);
        let whole = linear(&c_kv, &w);
        let parts: Vec<Vec<f64>> = (0..tp)
            .map(|r| linear(&c_kv, &shard_weight(&l, name, &w, tp, r).unwrap().unwrap()))
            .collect();
        let out = w.rows();
        for t in 0..3 {
            let joined: Vec<f64> = parts
                .iter()
                .flat_map(|p| p[t * out / tp..(t + 1) * out / tp].to_vec())
                .collect();
            assert_eq!(joined, whole[t * out..(t + 1) * out]);
        }
        // o_proj, row-parallel by heads: each rank multiplies its heads' columns of the
        // attention output, and the partial sums add up to the whole.
        let name = "model.layers.0.self_attn.o_proj.weight";
        let w = random(&[l.hidden_size, l.num_heads * l.v_head_dim], 3);
        let attn = random(&[3, l.num_heads * l.v_head_dim], 4);
        let whole = linear(&attn, &w);
        let mut sum = vec![0.0f64; whole.len()];
        for r in 0..tp {
            let Shard::Columns { start, len } =
                shard_of(split_of(&l, name).unwrap(), w.shape(), tp, r, 0)
            else {
                panic!("o_proj is row-parallel");
            };
            let x = columns_of(&attn, start, len);
            let part = linear(&x, &shard_weight(&l, name, &w, tp, r).unwrap().unwrap());
            sum.iter_mut().zip(part).for_each(|(s, p)| *s += p);
        }
        for (a, b) in sum.iter().zip(&whole) {
            assert!((a - b).abs() <= 1e-9 * b.abs().max(1.0), "{a} vs {b}");
        }
    }

    #[test]
    fn experts_have_one_owner_each_in_contiguous_blocks() {
        for tp in [1, 2, 4, 8] {
            let owners: Vec<usize> = (0..256).map(|e| expert_owner(e, 256, tp)).collect();
            assert!(owners.windows(2).all(|w| w[0] <= w[1]));
            for r in 0..tp {
                assert_eq!(owners.iter().filter(|&&o| o == r).count(), 256 / tp);
            }
        }
    }

    /// Rank stores of glm5-tiny-wide (quantized to `quant`, or not) over one full source.
    fn rank_stores(
        tp: usize,
        quant: Option<crate::gguf::GgmlType>,
    ) -> (super::super::WeightStore, Vec<super::super::WeightStore>) {
        use super::super::weights::synthetic::SyntheticWeights;
        use super::super::WeightStore;
        let layout = Layout::resolve("glm5-tiny-wide").unwrap();
        let source = || -> Box<dyn WeightSource> {
            let synthetic = Box::new(SyntheticWeights::new(&layout, 7));
            match quant {
                Some(ty) => {
                    Box::new(super::super::quant::QuantizedSource::new(synthetic, ty).unwrap())
                }
                None => synthetic,
            }
        };
        let full = WeightStore::new(&layout, source(), usize::MAX).unwrap();
        let shared: std::sync::Arc<dyn WeightSource> = std::sync::Arc::from(source());
        let ranks = (0..tp)
            .map(|r| {
                let rank = RankSource::new(shared.clone(), &layout, tp, r).unwrap();
                WeightStore::with_catalog(rank.catalog(), Box::new(rank), usize::MAX).unwrap()
            })
            .collect();
        (full, ranks)
    }

    #[test]
    fn a_ranks_store_reads_its_shard_of_every_weight() {
        let layout = Layout::resolve("glm5-tiny-wide").unwrap();
        let tp = 2;
        let (full, ranks) = rank_stores(tp, None);
        for (name, _) in full.catalog().iter() {
            let whole = full.get(name).unwrap();
            for (r, store) in ranks.iter().enumerate() {
                let want = shard_weight(&layout, name, &whole, tp, r).unwrap();
                match want {
                    None => assert!(store.catalog().get(name).is_none(), "{name} on rank {r}"),
                    Some(want) => {
                        let got = store.get(name).unwrap();
                        assert_eq!(got.shape(), want.shape(), "{name} on rank {r}");
                        assert_eq!(got.data(), want.data(), "{name} on rank {r}");
                    }
                }
            }
        }
        // Rank 1 holds the second half of the experts only.
        assert!(ranks[1]
            .get("model.layers.1.mlp.experts.0.up_proj.weight")
            .is_err());
        assert!(ranks[1]
            .get("model.layers.1.mlp.experts.15.up_proj.weight")
            .is_ok());
    }

    #[test]
    fn a_ranks_quantized_shards_are_the_whole_tensors_blocks() {
        let ty = crate::gguf::GgmlType::Q8_0;
        let (full, ranks) = rank_stores(2, Some(ty));
        let mut compared = 0;
        for (name, spec) in full.catalog().iter() {
            let Some(q) = full.quantized(name).unwrap() else {
                continue;
            };
            let whole = q.dequantize(Default::default()).unwrap();
            for (r, store) in ranks.iter().enumerate() {
                let Some(mine) = store.catalog().get(name) else {
                    continue;
                };
                let got = match store.quantized(name).unwrap() {
                    Some(shard) => shard.dequantize(Default::default()).unwrap(),
                    // A column shard off the block grid is read decoded.
                    None => store.get(name).unwrap().data().to_vec(),
                };
                let cut = shard_weight(
                    &Layout::resolve("glm5-tiny-wide").unwrap(),
                    name,
                    &Tensor::from_vec(&spec.shape, whole.clone()),
                    2,
                    r,
                )
                .unwrap()
                .unwrap();
                assert_eq!(got, cut.data(), "{name} on rank {r}, {:?}", mine.shape);
                compared += 1;
            }
        }
        assert!(compared > 20, "{compared} quantized shards compared");
    }

    #[test]
    fn layouts_that_do_not_divide_are_refused_with_the_reason() {
        let glm5 = Layout::resolve("glm5").unwrap();
        for tp in [1, 2, 4, 8] {
            check_tp(&glm5, tp).unwrap();
        }
        let err = check_tp(&glm5, 3).unwrap_err().to_string();
        assert!(
            err.contains("--tp 3") && err.contains("64 attention heads"),
            "{err}"
        );
        assert!(check_tp(&glm5, 0).is_err());
        let tiny = Layout::resolve("glm5-tiny").unwrap();
        let err = check_tp(&tiny, 8).unwrap_err().to_string();
        assert!(err.contains("4 attention heads"), "{err}");
        // The vocabulary need not divide: the last rank's part is shorter.
        let shard = |rank| shard_of(Split::Vocab, &[10, 4], 4, rank, 0);
        assert_eq!(shard(0), Shard::Rows { start: 0, len: 3 });
        assert_eq!(shard(3), Shard::Rows { start: 9, len: 1 });
    }
}
