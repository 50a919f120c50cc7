//! The plan against the whole tensors, the math of sharded linears, and a rank's weights.

use super::*;
use crate::model::weights::WeightSource;

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
                        let rows: Vec<f32> = held.iter().flat_map(|t| t.data().to_vec()).collect();
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
) -> (crate::model::WeightStore, Vec<crate::model::WeightStore>) {
    use crate::model::weights::synthetic::SyntheticWeights;
    use crate::model::WeightStore;
    let layout = Layout::resolve("glm5-tiny-wide").unwrap();
    let source = || -> Box<dyn WeightSource> {
        let synthetic = Box::new(SyntheticWeights::new(&layout, 7));
        match quant {
            Some(ty) => Box::new(crate::model::quant::QuantizedSource::new(synthetic, ty).unwrap()),
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

#[test]
fn a_ranks_output_is_placed_in_the_unsharded_one_along_its_one_differing_dimension() {
    // Heads of [tokens, heads, d]: rank 1 of 2 holds heads 2..4 of 4.
    assert_eq!(
        slice_in_whole(&[3, 2, 16], &[3, 4, 16], 2, 1),
        Ok(Some((1, 2, 2)))
    );
    // Columns of [tokens, heads · d].
    assert_eq!(
        slice_in_whole(&[3, 64], &[3, 256], 4, 3),
        Ok(Some((1, 192, 64)))
    );
    // The vocabulary in parts of ⌈V/N⌉: 10 over 4 ranks is 3, 3, 3, 1.
    assert_eq!(slice_in_whole(&[2, 1], &[2, 10], 4, 3), Ok(Some((1, 9, 1))));
    assert_eq!(vocab_part(10, 4, 3), (9, 1));
    // Replicated: the whole.
    assert_eq!(slice_in_whole(&[3, 256], &[3, 256], 2, 1), Ok(None));
    // Not one rank's slice: two dimensions differ, a wrong share, other ranks.
    assert!(slice_in_whole(&[2, 2, 16], &[3, 4, 16], 2, 0).is_err());
    assert!(slice_in_whole(&[3, 3, 16], &[3, 4, 16], 2, 0).is_err());
    assert!(slice_in_whole(&[3, 16], &[3, 4, 16], 4, 0).is_err());
}

#[test]
fn partial_sums_and_collectives_are_named_as_the_engine_names_them() {
    for name in [
        "model.embed_tokens",
        "model.layers.3.self_attn.o_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.3.mlp.experts",
        "model.layers.3.mlp.shared_experts",
        "model.layers.3.mlp",
    ] {
        assert!(partial_sum(name), "{name}");
    }
    for name in [
        "model.layers.3.mlp.gate",
        "logits",
        "model.layers.0.self_attn.q_b_proj",
    ] {
        assert!(!partial_sum(name), "{name}");
    }
    assert_eq!(
        collective_of("model.layers.3.mlp.all_reduce"),
        Some((Collective::AllReduce, "model.layers.3.mlp"))
    );
    assert_eq!(
        collective_of("logits.all_gather"),
        Some((Collective::AllGather, "logits"))
    );
    assert_eq!(collective_of("model.layers.3.mlp"), None);
    let layout = Layout::resolve("glm5-tiny").unwrap();
    let [k, v] = head_parts(&layout, "model.layers.0.self_attn.kv_cache").unwrap();
    assert_eq!((k, v), (4 * layout.qk_head_dim(), 4 * layout.v_head_dim));
    assert_eq!(
        head_parts(&layout, "model.layers.0.self_attn.kv_b_proj"),
        None
    );
    assert_eq!(rank_layout(&layout, 2).unwrap().num_heads, 2);
    assert!(rank_layout(&layout, 3).is_err());
}

#[test]
fn rank_stores_are_cut_once_per_rank_count_and_checked() {
    let model =
        crate::model::Model::synthetic(Layout::resolve("glm5-tiny").unwrap(), 0, 1 << 24).unwrap();
    let of = |tp| model.rank_stores.of(&model.weights, &model.layout, tp);
    let (a, b, four) = (of(2).unwrap(), of(2).unwrap(), of(4).unwrap());
    assert_eq!((a.len(), four.len()), (2, 4));
    assert!(a.iter().zip(&b).all(|(x, y)| std::sync::Arc::ptr_eq(x, y)));
    assert!(!std::sync::Arc::ptr_eq(&a[0], &four[0]));
    // Only the last rank count's stores are kept.
    assert!(!std::sync::Arc::ptr_eq(&a[0], &of(2).unwrap()[0]));
    for tp in [0, 3, MAX_TP + 1] {
        assert!(check_tp(&model.layout, tp).is_err(), "tp {tp}");
    }
}

/// Makes generated tensors on the host from their recipes, counting them (a device stands in).
struct HostMaker(std::sync::atomic::AtomicUsize);

impl crate::model::weights::WeightMaker for HostMaker {
    fn make(&self, shape: &[usize], recipe: crate::model::weights::Recipe) -> Result<Tensor> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let n = shape.iter().product();
        Ok(Tensor::from_vec(shape, recipe.values(n)))
    }
}

#[test]
fn generated_weights_made_from_recipes_equal_those_read_on_every_rank() {
    use crate::model::weights::WeightMaker;
    use std::sync::atomic::Ordering::Relaxed;
    let layout = Layout::resolve("glm5-tiny").unwrap();
    let plain = crate::model::Model::synthetic(layout.clone(), 5, 1 << 26).unwrap();
    let made = crate::model::Model::synthetic(layout.clone(), 5, 1 << 26).unwrap();
    let maker = std::sync::Arc::new(HostMaker(Default::default()));
    made.weights
        .set_maker(Some(maker.clone() as std::sync::Arc<dyn WeightMaker>));
    for (name, _) in made.weights.catalog().iter() {
        let (a, b) = (
            plain.weights.get(name).unwrap(),
            made.weights.get(name).unwrap(),
        );
        let bits = |t: &Tensor| t.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b), "{name}");
    }
    let whole = maker.0.load(Relaxed);
    assert_eq!(whole, made.weights.catalog().len(), "every tensor made");
    // A rank's row shards come from recipes too (its rows of the full tensor); column shards
    // are read and cut.
    let full = plain.weights.source();
    for rank in 0..2 {
        let store = rank_store(&made.weights, &layout, 2, rank).unwrap();
        store.set_maker(Some(maker.clone() as std::sync::Arc<dyn WeightMaker>));
        let reference = rank_store(&plain.weights, &layout, 2, rank).unwrap();
        for (name, _) in store.catalog().iter() {
            let before = maker.0.load(Relaxed);
            let (a, b) = (reference.get(name).unwrap(), store.get(name).unwrap());
            assert_eq!(a.data(), b.data(), "{name} rank {rank}");
            let shape = full.shape(name).unwrap();
            let by_rows = matches!(
                weight_shard(&layout, name, &shape, 2, rank).unwrap(),
                Shard::Whole | Shard::Rows { .. }
            );
            assert_eq!(maker.0.load(Relaxed) - before, by_rows as usize, "{name}");
        }
    }
}
