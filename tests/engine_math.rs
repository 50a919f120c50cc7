//! The math holds: absorbed equals naive, decode equals prefill, routing picks what a direct
//! computation picks, synthetic weights are identical across runs.

mod common;

use common::*;
use mladb::engine::{MlaPath, MlaPaths, Phase};
use mladb::stats::rel_l2;

const LAYOUTS: [&str; 2] = ["glm5-tiny", "deepseek-v3-tiny"];

#[test]
fn absorbed_and_naive_attention_agree_in_every_layer() {
    for layout in LAYOUTS {
        let model = synthetic(layout, 1);
        // 14 tokens: longer than glm5-tiny's index_topk (8), so the DSA really selects.
        let p = prompt(model.layout.vocab_size, 14);
        let naive = MlaPaths {
            prefill: MlaPath::Naive,
            decode: MlaPath::Naive,
        };
        let absorbed = MlaPaths {
            prefill: MlaPath::Absorbed,
            decode: MlaPath::Absorbed,
        };
        let (a, _) = record(&model, naive, &p, 10, 2);
        let (b, _) = record(&model, absorbed, &p, 10, 2);
        for phase in [Phase::Prefill, Phase::Decode(0), Phase::Decode(3)] {
            for l in 0..model.layout.num_layers {
                let name = format!("model.layers.{l}.self_attn.attn_output");
                let err = rel_l2(
                    output(&b, phase, &name).data(),
                    output(&a, phase, &name).data(),
                );
                assert!(
                    err < 1e-5,
                    "{layout} {phase} layer {l}: absorbed vs naive rel err {err:.3e}"
                );
            }
            let err = rel_l2(
                output(&b, phase, "logits").data(),
                output(&a, phase, "logits").data(),
            );
            assert!(err < 1e-5, "{layout} {phase}: logits rel err {err:.3e}");
        }
        // The naive run really ran naive ops and the absorbed run absorbed ones.
        assert!(a
            .output(Phase::Decode(0), "model.layers.0.self_attn.kv_b_proj")
            .is_some());
        assert!(b
            .output(Phase::Decode(0), "model.layers.0.self_attn.q_absorbed")
            .is_some());
        assert!(b
            .output(Phase::Prefill, "model.layers.0.self_attn.kv_b_proj")
            .is_none());
    }
}

#[test]
fn decoding_token_t_equals_the_last_row_of_a_longer_prefill() {
    for layout in LAYOUTS {
        let model = synthetic(layout, 2);
        let p = prompt(model.layout.vocab_size, 13);
        for decode_path in [MlaPath::Absorbed, MlaPath::Naive] {
            let paths = MlaPaths {
                prefill: MlaPath::Naive,
                decode: decode_path,
            };
            // Prefill 12, decode the 13th; against a prefill of all 13.
            let (stepped, _) = record(&model, paths, &p, 12, 0);
            let (whole, _) = record(&model, paths, &p, 13, 0);
            for l in 0..model.layout.num_layers {
                let name = format!("model.layers.{l}");
                let d = output(&stepped, Phase::Decode(0), &name);
                let w = output(&whole, Phase::Prefill, &name);
                let err = rel_l2(d.data(), last_row(w));
                assert!(
                    err < 1e-5,
                    "{layout} {decode_path:?} layer {l}: rel err {err:.3e}"
                );
            }
            let d = output(&stepped, Phase::Decode(0), "logits");
            let w = output(&whole, Phase::Prefill, "logits");
            let err = rel_l2(d.data(), last_row(w));
            assert!(
                err < 1e-5,
                "{layout} {decode_path:?}: logits rel err {err:.3e}"
            );
        }
    }
}

#[test]
fn routing_picks_the_experts_a_direct_computation_picks() {
    for layout in LAYOUTS {
        let model = synthetic(layout, 3);
        let moe = model.layout.moe.clone().unwrap();
        let p = prompt(model.layout.vocab_size, 9);
        let (rec, _) = record(&model, MlaPaths::production(), &p, 9, 0);
        for l in 0..model.layout.num_layers {
            if model.layout.mlp_kind(l) != mladb::model::MlpKind::Moe {
                continue;
            }
            let x = output(
                &rec,
                Phase::Prefill,
                &format!("model.layers.{l}.post_attention_layernorm"),
            );
            let w = model
                .weights
                .get(&format!("model.layers.{l}.mlp.gate.weight"))
                .unwrap();
            let bias = model
                .weights
                .get(&format!(
                    "model.layers.{l}.mlp.gate.e_score_correction_bias"
                ))
                .unwrap();
            let ids = output(
                &rec,
                Phase::Prefill,
                &format!("model.layers.{l}.mlp.gate.topk_indices"),
            );
            let weights = output(
                &rec,
                Phase::Prefill,
                &format!("model.layers.{l}.mlp.gate.topk_weights"),
            );
            let e = moe.n_routed_experts;
            let per_group = e / moe.n_group;
            for t in 0..x.rows() {
                // Direct, in f64: score every expert, rank groups by their two best, then take
                // the best eligible experts.
                let s: Vec<f64> = (0..e)
                    .map(|j| {
                        let z: f64 = x
                            .row(t)
                            .iter()
                            .zip(w.row(j))
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum();
                        1.0 / (1.0 + (-z).exp())
                    })
                    .collect();
                let choice: Vec<f64> = (0..e).map(|j| s[j] + bias.data()[j] as f64).collect();
                let mut groups: Vec<(f64, usize)> = (0..moe.n_group)
                    .map(|g| {
                        let mut v: Vec<f64> = choice[g * per_group..(g + 1) * per_group].to_vec();
                        v.sort_by(|a, b| b.total_cmp(a));
                        (v.iter().take(2).sum(), g)
                    })
                    .collect();
                groups.sort_by(|a, b| b.0.total_cmp(&a.0));
                let kept: Vec<usize> = groups.iter().take(moe.topk_group).map(|g| g.1).collect();
                let mut eligible: Vec<usize> =
                    (0..e).filter(|j| kept.contains(&(j / per_group))).collect();
                eligible.sort_by(|a, b| choice[*b].total_cmp(&choice[*a]));
                let mut expected: Vec<usize> = eligible[..moe.num_experts_per_tok].to_vec();
                let mut got: Vec<usize> = ids.row(t).iter().map(|v| *v as usize).collect();
                let sum: f64 = expected.iter().map(|&j| s[j]).sum();
                for (k, &j) in got.iter().enumerate() {
                    let want = s[j] / sum * moe.routed_scaling_factor;
                    assert!(
                        (weights.row(t)[k] as f64 - want).abs() < 1e-5,
                        "{layout} layer {l} token {t}"
                    );
                }
                expected.sort();
                got.sort();
                assert_eq!(got, expected, "{layout} layer {l} token {t}");
            }
        }
    }
}

#[test]
fn synthetic_runs_are_bit_identical() {
    let model = synthetic("glm5-tiny", 5);
    let again = synthetic("glm5-tiny", 5);
    let p = prompt(model.layout.vocab_size, 11);
    let (a, oa) = record(&model, MlaPaths::production(), &p, 8, 3);
    let (b, ob) = record(&again, MlaPaths::production(), &p, 8, 3);
    assert_eq!(oa.tokens, ob.tokens);
    assert_eq!(a.events.len(), b.events.len());
    for (x, y) in a.outputs.iter().zip(&b.outputs) {
        assert_eq!(x.data(), y.data());
    }
    let other = synthetic("glm5-tiny", 6);
    let (c, _) = record(&other, MlaPaths::production(), &p, 8, 0);
    assert_ne!(
        output(&a, Phase::Prefill, "logits").data(),
        output(&c, Phase::Prefill, "logits").data()
    );
}

#[test]
fn sparse_attention_really_selects_once_the_context_passes_index_topk() {
    let model = synthetic("glm5-tiny", 4);
    let topk = model.layout.indexer.as_ref().unwrap().topk;
    let p = prompt(model.layout.vocab_size, topk + 4);
    let (rec, _) = record(&model, MlaPaths::production(), &p, topk + 4, 0);
    let probs = output(&rec, Phase::Prefill, "model.layers.0.self_attn.attn_probs");
    let n = p.len();
    let shape = probs.shape().to_vec();
    assert_eq!(shape, vec![model.layout.num_heads, n, n]);
    for i in 0..n {
        let row = &probs.data()[i * n..(i + 1) * n]; // head 0
        let nonzero = row.iter().filter(|v| **v > 0.0).count();
        assert_eq!(
            nonzero,
            (i + 1).min(topk),
            "query {i} attends to min(i+1, topk) keys"
        );
        assert!(row[i + 1..].iter().all(|v| *v == 0.0), "causal");
    }
}

#[test]
fn each_chosen_expert_has_an_op_and_their_weighted_sum_is_mlp_experts() {
    for layout in LAYOUTS {
        let model = synthetic(layout, 8);
        let hidden = model.layout.hidden_size;
        let p = prompt(model.layout.vocab_size, 9);
        let options = mladb::engine::EngineOptions {
            expert_ops: true,
            ..mladb::engine::EngineOptions::all_layers(&model, MlaPaths::production())
        };
        let mut engine =
            mladb::engine::Engine::new(&model, &mladb::backend::cpu::CpuBackend, options).unwrap();
        let mut rec = mladb::engine::trace::Recorder::default();
        let schedule = mladb::engine::generate::Schedule {
            prompt: p,
            prefill_len: 7,
            decode_steps: 2,
        };
        mladb::engine::generate::run(&mut engine, &schedule, &mut rec).unwrap();
        let mut checked = 0;
        for phase in [Phase::Prefill, Phase::Decode(0), Phase::Decode(1)] {
            for l in 0..model.layout.num_layers {
                if model.layout.mlp_kind(l) != mladb::model::MlpKind::Moe {
                    continue;
                }
                let op = |name: &str| output(&rec, phase, &format!("model.layers.{l}.{name}"));
                let (x, ids, weights) = (
                    op("post_attention_layernorm"),
                    op("mlp.gate.topk_indices"),
                    op("mlp.gate.topk_weights"),
                );
                let sum = op("mlp.experts");
                let mut chosen: Vec<usize> = ids.data().iter().map(|&v| v as usize).collect();
                chosen.sort();
                chosen.dedup();
                // The trace has an op for the chosen experts and no other, in expert order.
                let prefix = format!("model.layers.{l}.mlp.experts.");
                let in_trace: Vec<usize> = rec
                    .events
                    .iter()
                    .filter(|e| e.phase == phase)
                    .filter_map(|e| e.name.strip_prefix(&prefix)?.parse().ok())
                    .collect();
                assert_eq!(in_trace, chosen, "{layout} {phase} layer {l}");
                let mut rebuilt = vec![0f64; x.rows() * hidden];
                for &e in &chosen {
                    let y = op(&format!("mlp.experts.{e}"));
                    let w = |proj: &str| {
                        let name = format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight");
                        model.weights.get(&name).unwrap()
                    };
                    let (gate, up, down) = (w("gate_proj"), w("up_proj"), w("down_proj"));
                    let tokens: Vec<usize> = (0..x.rows())
                        .filter(|&t| ids.row(t).contains(&(e as f32)))
                        .collect();
                    assert_eq!(y.shape(), [tokens.len(), hidden], "{layout} expert {e}");
                    for (r, &t) in tokens.iter().enumerate() {
                        // Direct, in f64: down(SiLU(gate·x) · up·x).
                        let dot = |m: &mladb::tensor::Tensor, i: usize| -> f64 {
                            m.row(i)
                                .iter()
                                .zip(x.row(t))
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum()
                        };
                        let act: Vec<f64> = (0..gate.rows())
                            .map(|i| {
                                let g = dot(&gate, i);
                                g / (1.0 + (-g).exp()) * dot(&up, i)
                            })
                            .collect();
                        let k = ids.row(t).iter().position(|&v| v == e as f32).unwrap();
                        for c in 0..hidden {
                            let want: f64 = down
                                .row(c)
                                .iter()
                                .zip(&act)
                                .map(|(a, b)| *a as f64 * b)
                                .sum();
                            let got = y.row(r)[c] as f64;
                            assert!((got - want).abs() < 1e-4, "{layout} expert {e} token {t}");
                            rebuilt[t * hidden + c] += weights.row(t)[k] as f64 * got;
                        }
                    }
                }
                let sum: Vec<f64> = sum.data().iter().map(|&v| v as f64).collect();
                let err: f64 = sum
                    .iter()
                    .zip(&rebuilt)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f64::max);
                assert!(err < 1e-4, "{layout} {phase} layer {l}: {err}");
                checked += 1;
            }
        }
        assert!(checked > 0, "{layout}: no MoE layer was checked");
    }
}
