//! Model layouts: every architecture number of a GLM-5 or DeepSeek-V3 model, stored as RON in
//! `layouts/`. Built-in layouts are embedded in the binary and resolve by name; any `.ron` path
//! works too. HF `config.json` files convert to a layout in [`super::hf_config`].

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The model family, which fixes the few places where GLM-5 and DeepSeek-V3 differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Family {
    /// HF `model_type: glm_moe_dsa`: MLA + DeepSeek sparse attention (DSA) indexer.
    Glm5,
    /// HF `model_type: deepseek_v3`: MLA, no indexer.
    DeepseekV3,
}

impl Family {
    pub fn hf_model_type(self) -> &'static str {
        match self {
            Family::Glm5 => "glm_moe_dsa",
            Family::DeepseekV3 => "deepseek_v3",
        }
    }
}

/// Which MLP a decoder layer has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MlpKind {
    Dense,
    Moe,
}

/// How layers choose between a dense MLP and MoE.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MlpPlan {
    /// The first `k` layers are dense, the rest MoE (`first_k_dense_replace`).
    FirstDense(usize),
    /// One entry per layer.
    PerLayer(Vec<MlpKind>),
}

/// Mixture-of-experts sizes and routing (sigmoid scores, `noaux_tc` selection).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeLayout {
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_shared_experts: usize,
    pub moe_intermediate_size: usize,
    /// Experts are split into `n_group` groups; only `topk_group` groups may be chosen.
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f64,
    pub norm_topk_prob: bool,
}

/// Whether a layer runs its own DSA indexer or reuses the previous layer's selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum IndexerMode {
    Full,
    Shared,
}

/// DeepSeek sparse attention indexer sizes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexerLayout {
    pub n_heads: usize,
    pub head_dim: usize,
    /// Keys kept per query; contexts no longer than this attend densely.
    pub topk: usize,
    /// RoPE layout inside the indexer (GLM-5: interleaved; DeepSeek-V3.2: split-half).
    pub rope_interleaved: bool,
    /// Per-layer mode; `None` means every layer runs its own indexer.
    #[serde(default)]
    pub layer_modes: Option<Vec<IndexerMode>>,
}

/// RoPE frequency scaling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    None,
    /// YaRN (NTK-by-parts) as HF's `_compute_yarn_parameters` defines it.
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        /// Overrides the cos/sin scale derived from `mscale`/`mscale_all_dim`.
        attention_factor: Option<f64>,
        truncate: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeLayout {
    pub theta: f64,
    /// Rotate interleaved pairs (x0,x1),(x2,x3).. (GLM-5, DeepSeek-V3) instead of halves.
    pub interleaved: bool,
    pub scaling: RopeScaling,
}

/// Every architecture number of a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    pub name: String,
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    /// Rank of the query compression; `None` means a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Dense MLP width.
    pub intermediate_size: usize,
    pub mlp: MlpPlan,
    pub moe: Option<MoeLayout>,
    pub indexer: Option<IndexerLayout>,
    pub rope: RopeLayout,
    pub rms_norm_eps: f64,
    /// eps of `q_a_layernorm` and `kv_a_layernorm` (HF builds them with 1e-6 whatever
    /// `rms_norm_eps` says).
    pub lora_norm_eps: f64,
    pub attention_bias: bool,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
}

/// Caps on every size, so a hostile layout cannot make mladb allocate without bound.
const MAX_DIM: usize = 1 << 20;
const MAX_VOCAB: usize = 1 << 22;
const MAX_LAYERS: usize = 1024;
const MAX_HEADS: usize = 1024;
const MAX_EXPERTS: usize = 4096;

struct Builtin {
    name: &'static str,
    ron: &'static str,
}

const BUILTINS: &[Builtin] = &[
    Builtin {
        name: "glm5",
        ron: include_str!("../../layouts/glm5.ron"),
    },
    Builtin {
        name: "glm5-tiny",
        ron: include_str!("../../layouts/glm5-tiny.ron"),
    },
    Builtin {
        name: "glm5-tiny-wide",
        ron: include_str!("../../layouts/glm5-tiny-wide.ron"),
    },
    Builtin {
        name: "glm5-rank8",
        ron: include_str!("../../layouts/glm5-rank8.ron"),
    },
    Builtin {
        name: "deepseek-v3",
        ron: include_str!("../../layouts/deepseek-v3.ron"),
    },
    Builtin {
        name: "deepseek-v3-rank16",
        ron: include_str!("../../layouts/deepseek-v3-rank16.ron"),
    },
    Builtin {
        name: "deepseek-v3-tiny",
        ron: include_str!("../../layouts/deepseek-v3-tiny.ron"),
    },
];

impl Layout {
    /// Names of the layouts embedded in the binary.
    pub fn builtin_names() -> Vec<&'static str> {
        BUILTINS.iter().map(|b| b.name).collect()
    }

    /// A built-in layout by name, or a `.ron` file by path.
    pub fn resolve(name_or_path: &str) -> Result<Layout> {
        if let Some(b) = BUILTINS.iter().find(|b| b.name == name_or_path) {
            return Layout::from_ron_str(b.ron, Path::new(&format!("layouts/{}.ron", b.name)));
        }
        let path = Path::new(name_or_path);
        if path.extension().is_some_and(|e| e == "ron") || path.exists() {
            return Layout::from_ron_file(path);
        }
        Err(Error::invalid(format!(
            "unknown layout '{name_or_path}': not a built-in layout ({}) and not a .ron file",
            Layout::builtin_names().join(", ")
        )))
    }

    pub fn from_ron_file(path: &Path) -> Result<Layout> {
        let text = crate::input::read_text_capped(path, crate::input::MAX_LAYOUT_BYTES)?;
        Layout::from_ron_str(&text, path)
    }

    /// Parses and validates RON text; `origin` names the file in errors.
    pub fn from_ron_str(text: &str, origin: &Path) -> Result<Layout> {
        let layout: Layout = ron::from_str(text).map_err(|e| Error::ron(origin, e))?;
        layout
            .validate()
            .map_err(|e| Error::parse(origin, e.to_string()))?;
        Ok(layout)
    }

    pub fn to_ron(&self) -> String {
        let config = ron::ser::PrettyConfig::new()
            .struct_names(false)
            .depth_limit(3);
        ron::ser::to_string_pretty(self, config).expect("a layout always serialises")
    }

    /// Checks that every number is in range and that the numbers agree with each other.
    pub fn validate(&self) -> Result<()> {
        let dims = [
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            ("hidden_size", self.hidden_size, MAX_DIM),
            ("num_layers", self.num_layers, MAX_LAYERS),
            ("num_heads", self.num_heads, MAX_HEADS),
            ("kv_lora_rank", self.kv_lora_rank, MAX_DIM),
            ("qk_nope_head_dim", self.qk_nope_head_dim, MAX_DIM),
            ("qk_rope_head_dim", self.qk_rope_head_dim, MAX_DIM),
            ("v_head_dim", self.v_head_dim, MAX_DIM),
            ("intermediate_size", self.intermediate_size, MAX_DIM),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                1 << 30,
            ),
        ];
        for (name, value, cap) in dims {
            check_range(name, value, cap)?;
        }
        if let Some(r) = self.q_lora_rank {
            check_range("q_lora_rank", r, MAX_DIM)?;
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(Error::invalid(format!(
                "qk_rope_head_dim must be even (RoPE rotates pairs), got {}",
                self.qk_rope_head_dim
            )));
        }
        // The widest projection must stay under the per-dimension cap.
        let q_width = self.num_heads * self.qk_head_dim();
        let kv_b_width = self.num_heads * (self.qk_nope_head_dim + self.v_head_dim);
        check_range("num_heads * qk head dim", q_width, MAX_DIM)?;
        check_range("num_heads * (qk_nope + v) head dims", kv_b_width, MAX_DIM)?;
        check_finite_positive("rms_norm_eps", self.rms_norm_eps)?;
        check_finite_positive("lora_norm_eps", self.lora_norm_eps)?;
        check_finite_positive("rope.theta", self.rope.theta)?;
        if let RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            ..
        } = &self.rope.scaling
        {
            check_finite_positive("rope.scaling.factor", *factor)?;
            check_finite_positive("rope.scaling.beta_fast", *beta_fast)?;
            check_finite_positive("rope.scaling.beta_slow", *beta_slow)?;
            check_range(
                "rope.scaling.original_max_position_embeddings",
                *original_max_position_embeddings,
                1 << 30,
            )?;
        }
        if let MlpPlan::PerLayer(kinds) = &self.mlp {
            if kinds.len() != self.num_layers {
                return Err(Error::invalid(format!(
                    "mlp lists {} layers but num_layers is {}",
                    kinds.len(),
                    self.num_layers
                )));
            }
        }
        let any_moe = (0..self.num_layers).any(|l| self.mlp_kind(l) == MlpKind::Moe);
        match (&self.moe, any_moe) {
            (None, true) => {
                return Err(Error::invalid(
                    "some layers are MoE but the layout has no `moe` section",
                ))
            }
            (Some(moe), _) => moe.validate()?,
            (None, false) => {}
        }
        if let Some(ix) = &self.indexer {
            check_range("indexer.n_heads", ix.n_heads, MAX_HEADS)?;
            check_range("indexer.head_dim", ix.head_dim, MAX_DIM)?;
            check_range("indexer.topk", ix.topk, 1 << 30)?;
            check_range(
                "indexer n_heads * head_dim",
                ix.n_heads * ix.head_dim,
                MAX_DIM,
            )?;
            if self.qk_rope_head_dim > ix.head_dim {
                return Err(Error::invalid(format!(
                    "indexer.head_dim {} is smaller than qk_rope_head_dim {}",
                    ix.head_dim, self.qk_rope_head_dim
                )));
            }
            if self.q_lora_rank.is_none() {
                return Err(Error::invalid(
                    "the DSA indexer reads the compressed query: it needs q_lora_rank",
                ));
            }
            if let Some(modes) = &ix.layer_modes {
                if modes.len() != self.num_layers {
                    return Err(Error::invalid(format!(
                        "indexer.layer_modes lists {} layers but num_layers is {}",
                        modes.len(),
                        self.num_layers
                    )));
                }
            }
        }
        if self.family == Family::Glm5 && self.indexer.is_none() {
            return Err(Error::invalid("a Glm5 layout needs an `indexer` section"));
        }
        Ok(())
    }

    /// Query/key head dimension: qk_nope + qk_rope.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Width of one latent cache row: kv_lora_rank + qk_rope_head_dim.
    pub fn latent_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    pub fn mlp_kind(&self, layer: usize) -> MlpKind {
        match &self.mlp {
            MlpPlan::FirstDense(k) if layer < *k => MlpKind::Dense,
            MlpPlan::FirstDense(_) => MlpKind::Moe,
            // A layer past the list (a layout not yet validated) is dense, never a panic.
            MlpPlan::PerLayer(kinds) => kinds.get(layer).copied().unwrap_or(MlpKind::Dense),
        }
    }

    /// The indexer mode of a layer, or `None` when the model has no indexer.
    pub fn indexer_mode(&self, layer: usize) -> Option<IndexerMode> {
        let ix = self.indexer.as_ref()?;
        Some(match &ix.layer_modes {
            Some(modes) => modes[layer],
            None => IndexerMode::Full,
        })
    }

    /// Softmax scale of the main attention: (qk_nope + qk_rope)^-0.5, times mscale² under YaRN
    /// when `mscale_all_dim` is set (as HF's `yarn_apply_mscale`).
    pub fn softmax_scale(&self) -> f64 {
        self.softmax_scale_from(false)
    }

    /// [`Layout::softmax_scale`], or with `mscale` taken where `mscale_all_dim` belongs (the
    /// `yarn-mscale` fault; a difference only where the two differ).
    pub fn softmax_scale_from(&self, wrong_mscale: bool) -> f64 {
        let mut scale = (self.qk_head_dim() as f64).powf(-0.5);
        if let RopeScaling::Yarn {
            factor,
            mscale,
            mscale_all_dim: Some(all_dim),
            ..
        } = &self.rope.scaling
        {
            let m = if wrong_mscale {
                mscale.unwrap_or(0.0)
            } else {
                *all_dim
            };
            if *all_dim != 0.0 {
                let m = yarn_mscale(*factor, m);
                scale *= m * m;
            }
        }
        scale
    }

    /// Parameter count (for the summary line), computed without materialising anything.
    pub fn parameter_count(&self) -> u128 {
        let h = self.hidden_size as u128;
        let n = self.num_heads as u128;
        let mut per_layer_attn = 0u128;
        per_layer_attn += match self.q_lora_rank {
            Some(r) => h * r as u128 + r as u128 + r as u128 * n * self.qk_head_dim() as u128,
            None => h * n * self.qk_head_dim() as u128,
        };
        per_layer_attn += h * self.latent_width() as u128 + self.kv_lora_rank as u128;
        per_layer_attn +=
            self.kv_lora_rank as u128 * n * (self.qk_nope_head_dim + self.v_head_dim) as u128;
        per_layer_attn += n * self.v_head_dim as u128 * h + 2 * h;
        if let (Some(ix), Some(r)) = (&self.indexer, self.q_lora_rank) {
            per_layer_attn += r as u128 * (ix.n_heads * ix.head_dim) as u128
                + h * ix.head_dim as u128
                + 2 * ix.head_dim as u128
                + h * ix.n_heads as u128;
        }
        let mut total = 0u128;
        for l in 0..self.num_layers {
            total += per_layer_attn;
            total += match (self.mlp_kind(l), &self.moe) {
                (MlpKind::Dense, _) | (MlpKind::Moe, None) => {
                    3 * h * self.intermediate_size as u128
                }
                (MlpKind::Moe, Some(m)) => {
                    let e = m.n_routed_experts as u128;
                    let i = m.moe_intermediate_size as u128;
                    e * 3 * h * i + e * h + e + 3 * h * i * m.n_shared_experts as u128
                }
            };
        }
        let v = self.vocab_size as u128;
        total + v * h * if self.tie_word_embeddings { 1 } else { 2 } + h
    }
}

impl MoeLayout {
    fn validate(&self) -> Result<()> {
        check_range("moe.n_routed_experts", self.n_routed_experts, MAX_EXPERTS)?;
        check_range(
            "moe.moe_intermediate_size",
            self.moe_intermediate_size,
            MAX_DIM,
        )?;
        check_range("moe.n_group", self.n_group, MAX_EXPERTS)?;
        check_range("moe.topk_group", self.topk_group, self.n_group)?;
        check_range(
            "moe.num_experts_per_tok",
            self.num_experts_per_tok,
            self.n_routed_experts,
        )?;
        if self.n_shared_experts > 64 {
            return Err(Error::invalid(format!(
                "moe.n_shared_experts {} is over the cap of 64",
                self.n_shared_experts
            )));
        }
        if !self.n_routed_experts.is_multiple_of(self.n_group) {
            return Err(Error::invalid(format!(
                "moe.n_routed_experts {} is not a multiple of moe.n_group {}",
                self.n_routed_experts, self.n_group
            )));
        }
        let per_group = self.n_routed_experts / self.n_group;
        if per_group < 2 && self.n_group > 1 {
            return Err(Error::invalid(
                "group-limited routing scores each group by its top-2 experts: groups need at least 2 experts",
            ));
        }
        if self.num_experts_per_tok > per_group * self.topk_group {
            return Err(Error::invalid(format!(
                "moe.num_experts_per_tok {} exceeds the {} experts in the topk_group {} groups",
                self.num_experts_per_tok,
                per_group * self.topk_group,
                self.topk_group
            )));
        }
        if !(self.routed_scaling_factor.is_finite() && self.routed_scaling_factor > 0.0) {
            return Err(Error::invalid(format!(
                "moe.routed_scaling_factor must be a finite positive number, got {}",
                self.routed_scaling_factor
            )));
        }
        Ok(())
    }
}

/// YaRN's magnitude correction: 0.1·m·ln(s) + 1 for s > 1.
pub fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

/// The layer count's bounds, checked on its own where per-layer lists are built from it
/// before the whole layout validates (an HF config or GGUF metadata may claim billions).
pub(crate) fn check_num_layers(n: usize) -> Result<()> {
    check_range("num_layers", n, MAX_LAYERS)
}

fn check_range(name: &str, value: usize, cap: usize) -> Result<()> {
    if value == 0 || value > cap {
        return Err(Error::invalid(format!(
            "{name} is {value}: it must be between 1 and {cap}"
        )));
    }
    Ok(())
}

fn check_finite_positive(name: &str, value: f64) -> Result<()> {
    if !(value.is_finite() && value > 0.0) {
        return Err(Error::invalid(format!(
            "{name} is {value}: it must be a positive number"
        )));
    }
    Ok(())
}
