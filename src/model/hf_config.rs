//! HF `config.json` → [`Layout`], for `glm_moe_dsa` (GLM-5) and `deepseek_v3` configs.
//!
//! Missing keys take the defaults of the corresponding transformers config class, so a trimmed
//! config means what transformers would make of it. Both RoPE spellings are read: the v5
//! `rope_parameters` dict and the older `rope_theta` + `rope_scaling` pair.

use super::layout::{
    Family, IndexerLayout, IndexerMode, Layout, MlpKind, MlpPlan, MoeLayout, RopeLayout,
    RopeScaling,
};
use crate::error::{Error, Result};
use serde_json::{Map, Value};
use std::path::Path;

/// Reads `config.json` and converts it; errors name the file.
pub fn layout_from_config_file(path: &Path) -> Result<Layout> {
    let text = crate::input::read_capped(path, crate::input::MAX_CONFIG_BYTES)?;
    let value: Value = serde_json::from_slice(&text)
        .map_err(|e| Error::parse(path, format!("not valid JSON: {e}")))?;
    let name = path
        .parent()
        .and_then(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "hf-model".to_string());
    layout_from_config(&value, &name).map_err(|e| Error::parse(path, e.to_string()))
}

/// Per-family defaults, as the transformers config classes define them.
struct Defaults {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    moe_intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    n_routed_experts: usize,
    q_lora_rank: usize,
    qk_nope_head_dim: usize,
    v_head_dim: usize,
    n_group: usize,
    topk_group: usize,
    rms_norm_eps: f64,
    max_position_embeddings: usize,
}

const GLM5_DEFAULTS: Defaults = Defaults {
    vocab_size: 154880,
    hidden_size: 6144,
    intermediate_size: 12288,
    moe_intermediate_size: 2048,
    num_hidden_layers: 78,
    num_attention_heads: 64,
    n_routed_experts: 256,
    q_lora_rank: 2048,
    qk_nope_head_dim: 192,
    v_head_dim: 256,
    n_group: 1,
    topk_group: 1,
    rms_norm_eps: 1e-5,
    max_position_embeddings: 202752,
};

const DEEPSEEK_V3_DEFAULTS: Defaults = Defaults {
    vocab_size: 129280,
    hidden_size: 7168,
    intermediate_size: 18432,
    moe_intermediate_size: 2048,
    num_hidden_layers: 61,
    num_attention_heads: 128,
    n_routed_experts: 256,
    q_lora_rank: 1536,
    qk_nope_head_dim: 128,
    v_head_dim: 128,
    n_group: 8,
    topk_group: 4,
    rms_norm_eps: 1e-6,
    max_position_embeddings: 4096,
};

/// Typed reads from the JSON object; `null` counts as absent, as in transformers.
struct Config<'a> {
    map: &'a Map<String, Value>,
}

impl<'a> Config<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| {
                    Error::invalid(format!("`{key}` must be a non-negative integer, found {v}"))
                }),
        }
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| Error::invalid(format!("`{key}` must be a number, found {v}"))),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| Error::invalid(format!("`{key}` must be true or false, found {v}"))),
        }
    }

    fn str_list(&self, key: &str) -> Result<Option<Vec<String>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| Error::invalid(format!("`{key}` must list strings")))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(Error::invalid(format!("`{key}` must be a list, found {v}"))),
        }
    }
}

/// Converts a parsed `config.json`; `name` becomes the layout's name.
pub fn layout_from_config(value: &Value, name: &str) -> Result<Layout> {
    let map = value
        .as_object()
        .ok_or_else(|| Error::invalid("config.json must hold a JSON object"))?;
    let c = Config { map };
    let model_type = c
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| Error::invalid("config.json has no `model_type`"))?;
    let (family, d) = match model_type {
        "glm_moe_dsa" => (Family::Glm5, &GLM5_DEFAULTS),
        "deepseek_v3" => (Family::DeepseekV3, &DEEPSEEK_V3_DEFAULTS),
        other => {
            return Err(Error::invalid(format!(
                "unsupported model_type '{other}': mladb runs glm_moe_dsa (GLM-5) and deepseek_v3"
            )))
        }
    };
    if let Some(act) = c.get("hidden_act").and_then(Value::as_str) {
        if act != "silu" {
            return Err(Error::invalid(format!(
                "hidden_act '{act}' is not supported (only silu)"
            )));
        }
    }
    if let Some(scoring) = c.get("scoring_func").and_then(Value::as_str) {
        if scoring != "sigmoid" {
            return Err(Error::invalid(format!(
                "scoring_func '{scoring}' is not supported (only sigmoid)"
            )));
        }
    }
    let num_layers = c.usize_or("num_hidden_layers", d.num_hidden_layers)?;
    // Before any per-layer list is made from it (the layout's validation comes later).
    super::layout::check_num_layers(num_layers)?;
    let num_heads = c.usize_or("num_attention_heads", d.num_attention_heads)?;
    let kv_heads = c.usize_or("num_key_value_heads", num_heads)?;
    if kv_heads != num_heads {
        return Err(Error::invalid(format!(
            "num_key_value_heads {kv_heads} differs from num_attention_heads {num_heads}: MLA models have one KV head per query head"
        )));
    }
    let q_lora_rank = match map.get("q_lora_rank") {
        Some(Value::Null) => None,
        _ => Some(c.usize_or("q_lora_rank", d.q_lora_rank)?),
    };
    let first_k_dense = c.usize_or("first_k_dense_replace", 3)?.min(num_layers);
    let mlp = match c.str_list("mlp_layer_types")? {
        Some(kinds) if kinds.len() != num_layers => {
            return Err(Error::invalid(format!(
                "mlp_layer_types lists {} layers but num_hidden_layers is {num_layers}",
                kinds.len()
            )))
        }
        Some(kinds) => MlpPlan::PerLayer(
            kinds
                .iter()
                .map(|k| match k.as_str() {
                    "dense" => Ok(MlpKind::Dense),
                    "sparse" | "moe" => Ok(MlpKind::Moe),
                    other => Err(Error::invalid(format!(
                        "unknown mlp_layer_types entry '{other}'"
                    ))),
                })
                .collect::<Result<_>>()?,
        ),
        None => MlpPlan::FirstDense(first_k_dense),
    };
    let n_routed = c.usize_or("n_routed_experts", d.n_routed_experts)?;
    let moe = MoeLayout {
        n_routed_experts: n_routed,
        num_experts_per_tok: c.usize_or("num_experts_per_tok", 8)?,
        n_shared_experts: c.usize_or("n_shared_experts", 1)?,
        moe_intermediate_size: c.usize_or("moe_intermediate_size", d.moe_intermediate_size)?,
        n_group: c.usize_or("n_group", d.n_group)?,
        topk_group: c.usize_or("topk_group", d.topk_group)?,
        routed_scaling_factor: c.f64_or("routed_scaling_factor", 2.5)?,
        norm_topk_prob: c.bool_or("norm_topk_prob", true)?,
    };
    let indexer = match family {
        Family::DeepseekV3 => None,
        Family::Glm5 => Some(IndexerLayout {
            n_heads: c.usize_or("index_n_heads", 32)?,
            head_dim: c.usize_or("index_head_dim", 128)?,
            topk: c.usize_or("index_topk", 2048)?,
            rope_interleaved: true,
            layer_modes: indexer_modes(&c, num_layers)?,
        }),
    };
    let rope = rope_from_config(&c, family)?;
    let layout = Layout {
        name: name.to_string(),
        family,
        vocab_size: c.usize_or("vocab_size", d.vocab_size)?,
        hidden_size: c.usize_or("hidden_size", d.hidden_size)?,
        num_layers,
        num_heads,
        q_lora_rank,
        kv_lora_rank: c.usize_or("kv_lora_rank", 512)?,
        qk_nope_head_dim: c.usize_or("qk_nope_head_dim", d.qk_nope_head_dim)?,
        qk_rope_head_dim: c.usize_or("qk_rope_head_dim", 64)?,
        v_head_dim: c.usize_or("v_head_dim", d.v_head_dim)?,
        intermediate_size: c.usize_or("intermediate_size", d.intermediate_size)?,
        mlp,
        moe: Some(moe),
        indexer,
        rope,
        rms_norm_eps: c.f64_or("rms_norm_eps", d.rms_norm_eps)?,
        lora_norm_eps: 1e-6,
        attention_bias: c.bool_or("attention_bias", false)?,
        tie_word_embeddings: c.bool_or("tie_word_embeddings", false)?,
        max_position_embeddings: c
            .usize_or("max_position_embeddings", d.max_position_embeddings)?,
    };
    let layout = drop_unused_moe(layout);
    layout.validate()?;
    Ok(layout)
}

/// A config whose layers are all dense keeps no MoE section (its defaults would be meaningless).
fn drop_unused_moe(mut layout: Layout) -> Layout {
    if (0..layout.num_layers).all(|l| layout.mlp_kind(l) == MlpKind::Dense) {
        layout.moe = None;
    }
    layout
}

/// `indexer_types`, or the pattern / frequency schedule transformers derives it from.
fn indexer_modes(c: &Config, num_layers: usize) -> Result<Option<Vec<IndexerMode>>> {
    let parse = |s: &str| match s {
        "full" | "F" => Ok(IndexerMode::Full),
        "shared" | "S" => Ok(IndexerMode::Shared),
        other => Err(Error::invalid(format!("unknown indexer type '{other}'"))),
    };
    let modes: Vec<IndexerMode> = if let Some(types) = c.str_list("indexer_types")? {
        types.iter().map(|t| parse(t)).collect::<Result<_>>()?
    } else if let Some(pattern) = c.get("index_topk_pattern").and_then(Value::as_str) {
        pattern
            .chars()
            .map(|ch| parse(&ch.to_string()))
            .collect::<Result<_>>()?
    } else {
        let freq = c.usize_or("index_topk_freq", 1)?.max(1);
        let offset = c.usize_or("index_skip_topk_offset", 2)?;
        (0..num_layers)
            .map(|i| {
                if ((i + 1).saturating_sub(offset)) % freq == 0 {
                    IndexerMode::Full
                } else {
                    IndexerMode::Shared
                }
            })
            .collect()
    };
    if modes.len() != num_layers {
        return Err(Error::invalid(format!(
            "indexer types list {} layers but num_hidden_layers is {num_layers}",
            modes.len()
        )));
    }
    if modes.iter().all(|m| *m == IndexerMode::Full) {
        return Ok(None);
    }
    Ok(Some(modes))
}

fn rope_from_config(c: &Config, family: Family) -> Result<RopeLayout> {
    // v5 configs hold everything in `rope_parameters`; older ones split theta and scaling.
    let params = c.get("rope_parameters").or_else(|| c.get("rope_scaling"));
    let params = match params {
        None => None,
        Some(Value::Object(m)) => Some(m),
        Some(v) => {
            return Err(Error::invalid(format!(
                "rope parameters must be an object, found {v}"
            )))
        }
    };
    let p = params.map(|map| Config { map });
    let theta = match p.as_ref().and_then(|p| p.get("rope_theta")) {
        Some(_) => p.as_ref().unwrap().f64_or("rope_theta", 10000.0)?,
        None => c.f64_or("rope_theta", 10000.0)?,
    };
    let rope_type = p
        .as_ref()
        .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let scaling = match rope_type {
        "default" => RopeScaling::None,
        "yarn" => {
            let p = p.as_ref().expect("a rope_type implies a parameter object");
            let max_pos = c.usize_or("max_position_embeddings", 4096)?;
            let original = p.usize_or("original_max_position_embeddings", max_pos)?;
            let factor = match p.get("factor") {
                Some(_) => p.f64_or("factor", 1.0)?,
                None => max_pos as f64 / original as f64,
            };
            let opt = |key: &str| -> Result<Option<f64>> {
                match p.get(key) {
                    None => Ok(None),
                    Some(_) => p.f64_or(key, 0.0).map(Some),
                }
            };
            // transformers treats a 0 or missing beta as its default (`or 32`, `or 1`).
            let beta_fast = opt("beta_fast")?.filter(|b| *b != 0.0).unwrap_or(32.0);
            let beta_slow = opt("beta_slow")?.filter(|b| *b != 0.0).unwrap_or(1.0);
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast,
                beta_slow,
                mscale: opt("mscale")?,
                mscale_all_dim: opt("mscale_all_dim")?,
                attention_factor: opt("attention_factor")?,
                truncate: p.bool_or("truncate", true)?,
            }
        }
        other => {
            return Err(Error::invalid(format!(
                "rope_type '{other}' is not supported (default and yarn are)"
            )))
        }
    };
    let interleaved = match family {
        Family::Glm5 => true,
        Family::DeepseekV3 => c.bool_or("rope_interleave", true)?,
    };
    Ok(RopeLayout {
        theta,
        interleaved,
        scaling,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn trimmed_glm5_config_takes_transformers_defaults() {
        let layout = layout_from_config(
            &json!({"model_type": "glm_moe_dsa", "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}),
            "glm",
        )
        .unwrap();
        let builtin = Layout::resolve("glm5").unwrap();
        assert_eq!(layout.hidden_size, builtin.hidden_size);
        assert_eq!(layout.num_layers, builtin.num_layers);
        assert_eq!(layout.moe, builtin.moe);
        assert_eq!(layout.indexer, builtin.indexer);
        assert_eq!(layout.rope, builtin.rope);
        assert_eq!(layout.softmax_scale(), 1.0 / 16.0);
    }

    #[test]
    fn deepseek_v3_yarn_from_old_style_rope_scaling() {
        let layout = layout_from_config(
            &json!({
                "model_type": "deepseek_v3",
                "rope_theta": 10000,
                "max_position_embeddings": 163840,
                "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            }),
            "dsv3",
        )
        .unwrap();
        let builtin = Layout::resolve("deepseek-v3").unwrap();
        assert_eq!(layout.rope, builtin.rope);
        assert_eq!(layout.moe, builtin.moe);
        let expected = (192f64).powf(-0.5) * (0.1 * 40f64.ln() + 1.0).powi(2);
        assert!((layout.softmax_scale() - expected).abs() < 1e-15);
    }

    #[test]
    fn unknown_model_type_is_a_clear_error() {
        let err = layout_from_config(&json!({"model_type": "llama"}), "x").unwrap_err();
        assert!(
            err.to_string().contains("unsupported model_type 'llama'"),
            "{err}"
        );
    }

    #[test]
    fn indexer_schedule_follows_freq_and_offset() {
        let layout = layout_from_config(
            &json!({"model_type": "glm_moe_dsa", "num_hidden_layers": 6, "index_topk_freq": 2,
                    "index_skip_topk_offset": 2}),
            "x",
        )
        .unwrap();
        use IndexerMode::*;
        assert_eq!(
            layout.indexer.unwrap().layer_modes.unwrap(),
            vec![Full, Full, Shared, Full, Shared, Full]
        );
    }
}
