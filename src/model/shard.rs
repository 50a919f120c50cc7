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
//! A row-parallel layer's bias is held by every rank and added once (rank 0), after the
//! all-reduce would double it otherwise.

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
