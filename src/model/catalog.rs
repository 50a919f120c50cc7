//! The tensors a layout implies: canonical (HF) name, shape and what kind of weight each is.
//!
//! Every weight source answers to these names. Routed experts are named one by one
//! (`model.layers.L.mlp.experts.E.gate_proj.weight`) so they can be fetched one at a time; sources
//! that store them stacked map the name onto a slice.

use super::layout::{IndexerMode, Layout, MlpKind};
use std::collections::BTreeMap;

/// What a tensor is, which fixes how synthetic weights are drawn for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorRole {
    /// Token embeddings.
    Embedding,
    /// A projection [out, in]: values ~ 1/sqrt(in).
    Projection,
    /// RMSNorm / LayerNorm scale: values near 1.
    NormWeight,
    /// LayerNorm / projection bias: small values.
    Bias,
    /// The router's `e_score_correction_bias`: small, non-zero.
    RouterBias,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub shape: Vec<usize>,
    pub role: TensorRole,
}

/// Name prefix of decoder layer `l`.
pub fn layer_prefix(l: usize) -> String {
    format!("model.layers.{l}")
}

/// Name of expert `e`'s `proj` weight (`gate_proj`, `up_proj` or `down_proj`) in layer `l`.
pub fn expert_weight_name(l: usize, e: usize, proj: &str) -> String {
    format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight")
}

/// All tensors of a layout by name. Built on demand; a full-size GLM-5 has ~60k entries.
#[derive(Debug, Clone)]
pub struct Catalog {
    specs: BTreeMap<String, TensorSpec>,
}

impl Catalog {
    pub fn new(layout: &Layout) -> Catalog {
        let mut specs = BTreeMap::new();
        let mut add = |name: String, shape: Vec<usize>, role: TensorRole| {
            specs.insert(name, TensorSpec { shape, role });
        };
        let h = layout.hidden_size;
        let n = layout.num_heads;
        use TensorRole::*;
        add(
            "model.embed_tokens.weight".into(),
            vec![layout.vocab_size, h],
            Embedding,
        );
        add("model.norm.weight".into(), vec![h], NormWeight);
        if !layout.tie_word_embeddings {
            add(
                "lm_head.weight".into(),
                vec![layout.vocab_size, h],
                Projection,
            );
        }
        for l in 0..layout.num_layers {
            let p = layer_prefix(l);
            add(format!("{p}.input_layernorm.weight"), vec![h], NormWeight);
            add(
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                NormWeight,
            );
            let a = format!("{p}.self_attn");
            match layout.q_lora_rank {
                Some(r) => {
                    add(format!("{a}.q_a_proj.weight"), vec![r, h], Projection);
                    if layout.attention_bias {
                        add(format!("{a}.q_a_proj.bias"), vec![r], Bias);
                    }
                    add(format!("{a}.q_a_layernorm.weight"), vec![r], NormWeight);
                    add(
                        format!("{a}.q_b_proj.weight"),
                        vec![n * layout.qk_head_dim(), r],
                        Projection,
                    );
                }
                None => add(
                    format!("{a}.q_proj.weight"),
                    vec![n * layout.qk_head_dim(), h],
                    Projection,
                ),
            }
            add(
                format!("{a}.kv_a_proj_with_mqa.weight"),
                vec![layout.latent_width(), h],
                Projection,
            );
            if layout.attention_bias {
                add(
                    format!("{a}.kv_a_proj_with_mqa.bias"),
                    vec![layout.latent_width()],
                    Bias,
                );
            }
            add(
                format!("{a}.kv_a_layernorm.weight"),
                vec![layout.kv_lora_rank],
                NormWeight,
            );
            add(
                format!("{a}.kv_b_proj.weight"),
                vec![
                    n * (layout.qk_nope_head_dim + layout.v_head_dim),
                    layout.kv_lora_rank,
                ],
                Projection,
            );
            add(
                format!("{a}.o_proj.weight"),
                vec![h, n * layout.v_head_dim],
                Projection,
            );
            if layout.attention_bias {
                add(format!("{a}.o_proj.bias"), vec![h], Bias);
            }
            if let (Some(ix), Some(IndexerMode::Full), Some(r)) =
                (&layout.indexer, layout.indexer_mode(l), layout.q_lora_rank)
            {
                let i = format!("{a}.indexer");
                add(
                    format!("{i}.wq_b.weight"),
                    vec![ix.n_heads * ix.head_dim, r],
                    Projection,
                );
                add(format!("{i}.wk.weight"), vec![ix.head_dim, h], Projection);
                add(format!("{i}.k_norm.weight"), vec![ix.head_dim], NormWeight);
                add(format!("{i}.k_norm.bias"), vec![ix.head_dim], Bias);
                add(
                    format!("{i}.weights_proj.weight"),
                    vec![ix.n_heads, h],
                    Projection,
                );
            }
            let m = format!("{p}.mlp");
            match (layout.mlp_kind(l), &layout.moe) {
                (MlpKind::Moe, Some(moe)) => {
                    let i = moe.moe_intermediate_size;
                    add(
                        format!("{m}.gate.weight"),
                        vec![moe.n_routed_experts, h],
                        Projection,
                    );
                    add(
                        format!("{m}.gate.e_score_correction_bias"),
                        vec![moe.n_routed_experts],
                        RouterBias,
                    );
                    for e in 0..moe.n_routed_experts {
                        add(
                            expert_weight_name(l, e, "gate_proj"),
                            vec![i, h],
                            Projection,
                        );
                        add(expert_weight_name(l, e, "up_proj"), vec![i, h], Projection);
                        add(
                            expert_weight_name(l, e, "down_proj"),
                            vec![h, i],
                            Projection,
                        );
                    }
                    if moe.n_shared_experts > 0 {
                        let si = i * moe.n_shared_experts;
                        add(
                            format!("{m}.shared_experts.gate_proj.weight"),
                            vec![si, h],
                            Projection,
                        );
                        add(
                            format!("{m}.shared_experts.up_proj.weight"),
                            vec![si, h],
                            Projection,
                        );
                        add(
                            format!("{m}.shared_experts.down_proj.weight"),
                            vec![h, si],
                            Projection,
                        );
                    }
                }
                _ => {
                    let i = layout.intermediate_size;
                    add(format!("{m}.gate_proj.weight"), vec![i, h], Projection);
                    add(format!("{m}.up_proj.weight"), vec![i, h], Projection);
                    add(format!("{m}.down_proj.weight"), vec![h, i], Projection);
                }
            }
        }
        Catalog { specs }
    }

    /// The tensors `keep` returns a shape for, with that shape (a tensor-parallel rank's share).
    pub fn filter_map(
        self,
        mut keep: impl FnMut(&str, &TensorSpec) -> Option<Vec<usize>>,
    ) -> Catalog {
        let specs = self
            .specs
            .into_iter()
            .filter_map(|(name, spec)| {
                let shape = keep(&name, &spec)?;
                Some((
                    name,
                    TensorSpec {
                        shape,
                        role: spec.role,
                    },
                ))
            })
            .collect();
        Catalog { specs }
    }

    pub fn get(&self, name: &str) -> Option<&TensorSpec> {
        self.specs.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &TensorSpec)> {
        self.specs.iter()
    }

    pub fn len(&self) -> usize {
        self.specs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }
}

/// The name the LM head is read from (the embedding when the two are tied).
pub fn lm_head_name(layout: &Layout) -> &'static str {
    if layout.tie_word_embeddings {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    }
}
