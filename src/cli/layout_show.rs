//! `mladb layout show NAME`: a layout as a person reads it (sizes, attention, MoE, indexer,
//! RoPE, norms), in the README's words; `--ron` keeps the file form for `--layout FILE`.

use crate::model::layout::{Family, IndexerLayout, IndexerMode, MlpKind, MoeLayout, RopeScaling};
use crate::model::Layout;

/// The family as the README names it.
pub fn family_name(f: Family) -> &'static str {
    match f {
        Family::Glm5 => "GLM-5",
        Family::DeepseekV3 => "DeepSeek-V3",
    }
}

/// A number as written in a config (`1e-5`, `2.5`, `1000000`).
fn num(v: f64) -> String {
    if v != 0.0 && v.abs() < 1e-3 {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// Layer numbers as ranges: `0-2, 5, 7-9`.
fn ranges(layers: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            layers[i].to_string()
        } else {
            format!("{}-{}", layers[i], layers[j])
        });
        i = j + 1;
    }
    out.join(", ")
}

fn mlp(l: &Layout) -> String {
    let of = |kind| -> Vec<usize> {
        (0..l.num_layers)
            .filter(|&i| l.mlp_kind(i) == kind)
            .collect()
    };
    let (dense, moe) = (of(MlpKind::Dense), of(MlpKind::Moe));
    match (dense.is_empty(), moe.is_empty()) {
        (_, true) => format!("every layer dense (width {})", l.intermediate_size),
        (true, false) => "every layer MoE".to_string(),
        (false, false) => format!(
            "dense (width {}) in layer{} {}, MoE in {}",
            l.intermediate_size,
            if dense.len() == 1 { "" } else { "s" },
            ranges(&dense),
            ranges(&moe)
        ),
    }
}

fn moe(m: &MoeLayout) -> String {
    let groups = if m.n_group > 1 {
        format!(
            ", {} groups of which {} may be chosen",
            m.n_group, m.topk_group
        )
    } else {
        String::new()
    };
    format!(
        "{} routed experts, {} per token{groups}, {} shared · expert width {} · routed scaling {}{}",
        m.n_routed_experts,
        m.num_experts_per_tok,
        m.n_shared_experts,
        m.moe_intermediate_size,
        num(m.routed_scaling_factor),
        if m.norm_topk_prob {
            " · top-k weights normalised"
        } else {
            ""
        }
    )
}

fn indexer(l: &Layout, ix: &IndexerLayout) -> String {
    let shared: Vec<usize> = (0..l.num_layers)
        .filter(|&i| l.indexer_mode(i) == Some(IndexerMode::Shared))
        .collect();
    let modes = if shared.is_empty() {
        "every layer runs its own".to_string()
    } else {
        format!(
            "layers {} reuse the previous layer's selection",
            ranges(&shared)
        )
    };
    format!(
        "DeepSeek sparse attention: {} heads × {} · keeps the top {} keys · {} RoPE · {modes}",
        ix.n_heads,
        ix.head_dim,
        ix.topk,
        if ix.rope_interleaved {
            "interleaved"
        } else {
            "split-half"
        }
    )
}

fn rope(l: &Layout) -> String {
    let r = &l.rope;
    let layout = if r.interleaved {
        "interleaved"
    } else {
        "split-half"
    };
    let scaling = match &r.scaling {
        RopeScaling::None => "no scaling".to_string(),
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
            let opt = |name: &str, v: &Option<f64>| {
                v.map_or(String::new(), |v| format!(", {name} {}", num(v)))
            };
            format!(
                "YaRN: factor {} over {} original positions, beta fast {} / slow {}{}{}{}{}",
                num(*factor),
                original_max_position_embeddings,
                num(*beta_fast),
                num(*beta_slow),
                opt("mscale", mscale),
                opt("mscale_all_dim", mscale_all_dim),
                opt("attention factor", attention_factor),
                if *truncate { "" } else { ", not truncated" }
            )
        }
    };
    format!("theta {} · {layout} · {scaling}", num(r.theta))
}

/// The plain summary `layout show` prints.
pub fn summary(l: &Layout) -> String {
    let query = match l.q_lora_rank {
        Some(r) => format!("query through a rank-{r} compression"),
        None => "query by a plain q_proj".to_string(),
    };
    let rows: Vec<(&str, String)> = vec![
        (
            "sizes",
            format!(
                "{} layers · hidden {} · vocabulary {} · {} positions",
                l.num_layers, l.hidden_size, l.vocab_size, l.max_position_embeddings
            ),
        ),
        (
            "attention",
            format!(
                "MLA, {} heads · latent (kv_lora_rank) {} · per head qk {} ({} + {} rope), v {} · {query}{}",
                l.num_heads,
                l.kv_lora_rank,
                l.qk_nope_head_dim + l.qk_rope_head_dim,
                l.qk_nope_head_dim,
                l.qk_rope_head_dim,
                l.v_head_dim,
                if l.attention_bias { " · with biases" } else { "" }
            ),
        ),
        ("MLP", mlp(l)),
        ("MoE", l.moe.as_ref().map_or("none".to_string(), moe)),
        (
            "indexer",
            l.indexer
                .as_ref()
                .map_or("none (dense attention)".to_string(), |ix| indexer(l, ix)),
        ),
        ("RoPE", rope(l)),
        (
            "norms",
            format!(
                "RMSNorm eps {} · q_a / kv_a layernorm eps {}",
                num(l.rms_norm_eps),
                num(l.lora_norm_eps)
            ),
        ),
        (
            "LM head",
            if l.tie_word_embeddings {
                "tied to the embeddings"
            } else {
                "its own weights"
            }
            .to_string(),
        ),
    ];
    let mut out = format!(
        "{}: {} (HF model_type {}), {:.3e} parameters\n",
        l.name,
        family_name(l.family),
        l.family.hf_model_type(),
        l.parameter_count() as f64
    );
    for (name, text) in rows {
        out.push_str(&format!("  {name:<10} {text}\n"));
    }
    out.push_str("  (layout show --ron prints it as a layout file for --layout FILE)");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_join_runs_of_layers() {
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        assert_eq!(ranges(&[3]), "3");
        assert_eq!(ranges(&[]), "");
    }

    #[test]
    fn the_summary_of_every_builtin_has_no_debug_names() {
        for name in Layout::builtin_names() {
            let text = summary(&Layout::resolve(name).unwrap());
            for debug in [
                "r#None",
                "Some(",
                "FirstDense",
                "Glm5",
                "DeepseekV3",
                "Yarn {",
            ] {
                assert!(!text.contains(debug), "{name}: {debug} in\n{text}");
            }
            assert!(text.contains("latent (kv_lora_rank)"), "{text}");
        }
    }
}
