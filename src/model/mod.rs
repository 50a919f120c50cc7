//! What a model is: its layout (architecture numbers), the tensors that layout implies, and where
//! their values come from.

pub mod catalog;
pub mod export;
pub mod gguf;
pub mod hf_config;
pub mod layout;
pub mod quant;
pub mod shard;
pub mod tokenizer;
pub mod weights;

pub use catalog::{Catalog, TensorRole, TensorSpec};
pub use layout::{Family, Layout, MlpKind};
pub use weights::{WeightSource, WeightStore};

use crate::error::Result;
use crate::gguf::GgmlType;
use std::path::Path;

/// A layout together with the weights to run it.
pub struct Model {
    pub layout: Layout,
    pub weights: WeightStore,
    /// The tensor-parallel ranks' weights, cut from `weights` when a run first asks.
    pub rank_stores: shard::RankStores,
}

impl Model {
    /// A built-in or RON layout with synthetic weights drawn from `seed`.
    pub fn synthetic(layout: Layout, seed: u64, cache_budget_bytes: usize) -> Result<Model> {
        let source = weights::synthetic::SyntheticWeights::new(&layout, seed);
        let weights = WeightStore::new(&layout, Box::new(source), cache_budget_bytes)?;
        Ok(Model {
            layout,
            weights,
            rank_stores: shard::RankStores::default(),
        })
    }

    /// An HF checkpoint directory (`config.json` + safetensors).
    pub fn hf_checkpoint(dir: &Path, cache_budget_bytes: usize) -> Result<Model> {
        Model::hf_checkpoint_quantized(dir, None, cache_budget_bytes)
    }

    /// An HF checkpoint, its projection weights quantized at load when `quant` is given.
    pub fn hf_checkpoint_quantized(
        dir: &Path,
        quant: Option<GgmlType>,
        cache_budget_bytes: usize,
    ) -> Result<Model> {
        let layout = hf_config::layout_from_config_file(&dir.join("config.json"))?;
        let source = weights::safetensors::CheckpointWeights::open(dir)?;
        Model::with_source(layout, Box::new(source), quant, cache_budget_bytes)
    }

    /// A layout with synthetic weights, quantized at load when `quant` is given.
    pub fn synthetic_quantized(
        layout: Layout,
        seed: u64,
        quant: Option<GgmlType>,
        cache_budget_bytes: usize,
    ) -> Result<Model> {
        let source = weights::synthetic::SyntheticWeights::new(&layout, seed);
        Model::with_source(layout, Box::new(source), quant, cache_budget_bytes)
    }

    /// A GGUF file (`glm-dsa` or `deepseek2` architecture).
    pub fn gguf(path: &Path, cache_budget_bytes: usize) -> Result<Model> {
        let source = gguf::GgufWeights::open(path)?;
        let layout = source.layout().clone();
        Model::with_source(layout, Box::new(source), None, cache_budget_bytes)
    }

    fn with_source(
        layout: Layout,
        source: Box<dyn WeightSource>,
        quant: Option<GgmlType>,
        cache_budget_bytes: usize,
    ) -> Result<Model> {
        let source: Box<dyn WeightSource> = match quant {
            Some(ty) => Box::new(quant::QuantizedSource::new(source, ty)?),
            None => source,
        };
        let weights = WeightStore::new(&layout, source, cache_budget_bytes)?;
        Ok(Model {
            layout,
            weights,
            rank_stores: shard::RankStores::default(),
        })
    }

    /// Whether any layer's kv_b_proj is stored quantized (force-dequantize has work to do).
    pub fn has_quantized_kv_b(&self) -> bool {
        (0..self.layout.num_layers).any(|l| {
            let name = format!("{}.self_attn.kv_b_proj.weight", catalog::layer_prefix(l));
            matches!(self.weights.quantized(&name), Ok(Some(_)))
        })
    }
}
