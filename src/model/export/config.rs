//! What an exported checkpoint is a model of: the layout with fewer layers, experts or tokens
//! ([`shrink`]), and its `config.json` as transformers writes one ([`hf_config`]), checked to
//! read back as the same layout.

use super::ExportDtype;
use crate::error::{Error, Result};
use crate::model::hf_config::layout_from_config;
use crate::model::layout::{Family, IndexerMode, Layout, MlpKind, MlpPlan, RopeScaling};
use serde_json::{json, Map, Value};

/// How many of each repeated part to keep; `None` keeps the layout's count. Every tensor keeps
/// its full-size shape: only the number of layers, dense layers, routed experts and vocabulary
/// rows shrinks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub layers: Option<usize>,
    pub first_dense: Option<usize>,
    pub experts: Option<usize>,
    pub vocab: Option<usize>,
}

/// The layout with `counts` applied, validated (a count that breaks the routing, such as
/// fewer experts than a token picks, is refused with the option that asked for it).
pub fn shrink(layout: &Layout, counts: &Counts) -> Result<Layout> {
    let mut out = layout.clone();
    let within = |flag: &str, value: usize, limit: usize, what: &str| {
        if value == 0 || value > limit {
            Err(Error::invalid(format!(
                "{flag} {value}: must be between 1 and the {limit} {what} of {}",
                layout.name
            )))
        } else {
            Ok(value)
        }
    };
    if let Some(n) = counts.layers {
        out.num_layers = within("--layers", n, layout.num_layers, "layers")?;
        if let MlpPlan::PerLayer(kinds) = &mut out.mlp {
            kinds.truncate(n);
        }
        if let Some(modes) = out.indexer.as_mut().and_then(|ix| ix.layer_modes.as_mut()) {
            modes.truncate(n);
        }
    }
    if let Some(k) = counts.first_dense {
        if k > out.num_layers {
            return Err(Error::invalid(format!(
                "--first-dense {k}: the model has only {} layers",
                out.num_layers
            )));
        }
        out.mlp = MlpPlan::FirstDense(k);
    }
    // More dense layers than layers is all dense, which config.json says as that many.
    if let MlpPlan::FirstDense(k) = &mut out.mlp {
        *k = (*k).min(out.num_layers);
    }
    if let Some(e) = counts.experts {
        let Some(moe) = out.moe.as_mut() else {
            return Err(Error::invalid(format!(
                "--experts {e}: {} has no routed experts",
                layout.name
            )));
        };
        moe.n_routed_experts = within("--experts", e, moe.n_routed_experts, "routed experts")?;
    }
    if let Some(v) = counts.vocab {
        out.vocab_size = within("--vocab", v, layout.vocab_size, "vocabulary entries")?;
    }
    // The forms config.json reads back: no MoE section without MoE layers, no per-layer
    // indexer modes when every layer runs its own.
    if (0..out.num_layers).all(|l| out.mlp_kind(l) == MlpKind::Dense) {
        out.moe = None;
    }
    if let Some(ix) = out.indexer.as_mut() {
        if ix
            .layer_modes
            .as_ref()
            .is_some_and(|m| m.iter().all(|m| *m == IndexerMode::Full))
        {
            ix.layer_modes = None;
        }
    }
    out.validate().map_err(|e| {
        let asked = [
            counts.layers.map(|n| format!("--layers {n}")),
            counts.first_dense.map(|n| format!("--first-dense {n}")),
            counts.experts.map(|n| format!("--experts {n}")),
            counts.vocab.map(|n| format!("--vocab {n}")),
        ];
        let asked: Vec<String> = asked.into_iter().flatten().collect();
        Error::invalid(format!(
            "{} with {}: {e}",
            layout.name,
            if asked.is_empty() {
                "its own counts".to_string()
            } else {
                asked.join(" ")
            }
        ))
    })?;
    Ok(out)
}

/// `config.json` for the layout, with the keys transformers' `GlmMoeDsaConfig` /
/// `DeepseekV3Config` write (and `quantization_config` for FP8 as the official FP8 checkpoints
/// have it). Refused when mladb's own import would read it back as another layout.
pub fn hf_config(layout: &Layout, dtype: ExportDtype) -> Result<Value> {
    let mut c = Map::new();
    let mut put = |key: &str, value: Value| {
        c.insert(key.to_string(), value);
    };
    let architecture = match layout.family {
        Family::Glm5 => "GlmMoeDsaForCausalLM",
        Family::DeepseekV3 => "DeepseekV3ForCausalLM",
    };
    put("architectures", json!([architecture]));
    put("model_type", json!(layout.family.hf_model_type()));
    put("vocab_size", json!(layout.vocab_size));
    put("hidden_size", json!(layout.hidden_size));
    put("intermediate_size", json!(layout.intermediate_size));
    put("num_hidden_layers", json!(layout.num_layers));
    put("num_attention_heads", json!(layout.num_heads));
    put("num_key_value_heads", json!(layout.num_heads));
    put("q_lora_rank", json!(layout.q_lora_rank));
    put("kv_lora_rank", json!(layout.kv_lora_rank));
    put("qk_nope_head_dim", json!(layout.qk_nope_head_dim));
    put("qk_rope_head_dim", json!(layout.qk_rope_head_dim));
    put("qk_head_dim", json!(layout.qk_head_dim()));
    put("head_dim", json!(layout.qk_rope_head_dim));
    put("v_head_dim", json!(layout.v_head_dim));
    put("hidden_act", json!("silu"));
    put("rms_norm_eps", json!(layout.rms_norm_eps));
    put("attention_bias", json!(layout.attention_bias));
    put("tie_word_embeddings", json!(layout.tie_word_embeddings));
    put(
        "max_position_embeddings",
        json!(layout.max_position_embeddings),
    );
    put("dtype", json!("bfloat16"));
    // The multi-token-prediction layer is not exported.
    put("num_nextn_predict_layers", json!(0));
    match &layout.mlp {
        MlpPlan::FirstDense(k) => put("first_k_dense_replace", json!(k)),
        MlpPlan::PerLayer(kinds) => put(
            "mlp_layer_types",
            json!(kinds
                .iter()
                .map(|k| match k {
                    MlpKind::Dense => "dense",
                    MlpKind::Moe => "sparse",
                })
                .collect::<Vec<_>>()),
        ),
    }
    if let Some(moe) = &layout.moe {
        put("n_routed_experts", json!(moe.n_routed_experts));
        put("num_experts_per_tok", json!(moe.num_experts_per_tok));
        put("n_shared_experts", json!(moe.n_shared_experts));
        put("moe_intermediate_size", json!(moe.moe_intermediate_size));
        put("n_group", json!(moe.n_group));
        put("topk_group", json!(moe.topk_group));
        put("routed_scaling_factor", json!(moe.routed_scaling_factor));
        put("norm_topk_prob", json!(moe.norm_topk_prob));
        put("scoring_func", json!("sigmoid"));
        put("topk_method", json!("noaux_tc"));
    }
    if let Some(ix) = &layout.indexer {
        put("index_n_heads", json!(ix.n_heads));
        put("index_head_dim", json!(ix.head_dim));
        put("index_topk", json!(ix.topk));
        put("indexer_rope_interleave", json!(ix.rope_interleaved));
        let types: Vec<&str> = (0..layout.num_layers)
            .map(|l| match layout.indexer_mode(l) {
                Some(IndexerMode::Shared) => "shared",
                _ => "full",
            })
            .collect();
        put("indexer_types", json!(types));
    }
    put("rope_interleave", json!(layout.rope.interleaved));
    let mut rope = Map::new();
    rope.insert("rope_theta".into(), json!(layout.rope.theta));
    match &layout.rope.scaling {
        RopeScaling::None => {
            rope.insert("rope_type".into(), json!("default"));
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            attention_factor,
            truncate,
        } => {
            rope.insert("rope_type".into(), json!("yarn"));
            rope.insert("factor".into(), json!(factor));
            rope.insert(
                "original_max_position_embeddings".into(),
                json!(original_max_position_embeddings),
            );
            rope.insert("beta_fast".into(), json!(beta_fast));
            rope.insert("beta_slow".into(), json!(beta_slow));
            for (key, value) in [
                ("mscale", mscale),
                ("mscale_all_dim", mscale_all_dim),
                ("attention_factor", attention_factor),
            ] {
                if let Some(v) = value {
                    rope.insert(key.into(), json!(v));
                }
            }
            rope.insert("truncate".into(), json!(truncate));
        }
    }
    put("rope_parameters", Value::Object(rope));
    if let ExportDtype::Fp8 { block } = dtype {
        put(
            "quantization_config",
            json!({
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": block,
            }),
        );
    }
    let config = Value::Object(c);
    let back = layout_from_config(&config, &layout.name).map_err(|e| {
        Error::invalid(format!(
            "{}: its config.json does not read back: {e}",
            layout.name
        ))
    })?;
    if back != *layout {
        let (ours, theirs) = (layout.to_ron(), back.to_ron());
        let differs = ours
            .lines()
            .zip(theirs.lines())
            .find(|(a, b)| a != b)
            .map(|(a, b)| format!("`{}` would read back as `{}`", a.trim(), b.trim()))
            .unwrap_or_else(|| "the layouts differ".into());
        return Err(Error::invalid(format!(
            "{} cannot be written as an HF config.json: {differs}",
            layout.name
        )));
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_layout_reads_back_from_its_config() {
        for name in Layout::builtin_names() {
            let layout = Layout::resolve(name).unwrap();
            let dtype = ExportDtype::Fp8 { block: [128, 128] };
            let config = hf_config(&layout, dtype).unwrap();
            assert_eq!(layout_from_config(&config, name).unwrap(), layout, "{name}");
        }
    }

    #[test]
    fn shrinking_keeps_every_shape_and_refuses_broken_routing() {
        let glm5 = Layout::resolve("glm5").unwrap();
        let counts = Counts {
            layers: Some(2),
            first_dense: Some(1),
            experts: Some(8),
            vocab: Some(1024),
        };
        let small = shrink(&glm5, &counts).unwrap();
        assert_eq!((small.num_layers, small.vocab_size), (2, 1024));
        assert_eq!(small.mlp_kind(0), MlpKind::Dense);
        assert_eq!(small.mlp_kind(1), MlpKind::Moe);
        assert_eq!(small.moe.as_ref().unwrap().n_routed_experts, 8);
        assert_eq!(
            (
                small.hidden_size,
                small.intermediate_size,
                small.q_lora_rank
            ),
            (6144, 12288, Some(2048))
        );
        let too_few = Counts {
            experts: Some(4),
            ..counts
        };
        let e = shrink(&glm5, &too_few).unwrap_err().to_string();
        assert!(
            e.contains("--experts 4") && e.contains("num_experts_per_tok"),
            "{e}"
        );
        let e = shrink(
            &glm5,
            &Counts {
                layers: Some(79),
                ..Counts::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--layers 79: must be between 1 and the 78 layers"),
            "{e}"
        );
        let dense = Counts {
            layers: Some(2),
            first_dense: Some(2),
            ..Counts::default()
        };
        assert!(shrink(&glm5, &dense).unwrap().moe.is_none());
        let one = shrink(
            &glm5,
            &Counts {
                layers: Some(1),
                ..Counts::default()
            },
        )
        .unwrap();
        assert_eq!((one.mlp, one.moe), (MlpPlan::FirstDense(1), None));
    }

    #[test]
    fn shrunken_layouts_read_back_from_their_config() {
        for (name, experts) in [("glm5", [8, 256]), ("deepseek-v3", [16, 64])] {
            let full = Layout::resolve(name).unwrap();
            for layers in [1, 2, 4, 5] {
                for first_dense in [None, Some(0), Some(1), Some(layers)] {
                    for e in experts {
                        let counts = Counts {
                            layers: Some(layers),
                            first_dense,
                            experts: Some(e),
                            vocab: Some(1000),
                        };
                        let small = shrink(&full, &counts).unwrap();
                        let config = hf_config(&small, ExportDtype::Bf16).unwrap();
                        let back = layout_from_config(&config, name).unwrap();
                        assert_eq!(back, small, "{name} {counts:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_layout_config_json_cannot_express_is_refused() {
        let mut layout = Layout::resolve("glm5-tiny").unwrap();
        layout.lora_norm_eps = 1e-5;
        let e = hf_config(&layout, ExportDtype::Bf16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot be written as an HF config.json"), "{e}");
        assert!(e.contains("lora_norm_eps"), "{e}");
    }
}
