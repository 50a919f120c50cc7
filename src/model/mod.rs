//! What a model is: its layout (architecture numbers), the tensors that layout implies, and where
//! their values come from.

pub mod catalog;
pub mod hf_config;
pub mod layout;
pub mod weights;

pub use catalog::{Catalog, TensorRole, TensorSpec};
pub use layout::{Family, Layout, MlpKind};
pub use weights::{WeightSource, WeightStore};

use crate::error::Result;
use std::path::Path;

/// A layout together with the weights to run it.
pub struct Model {
    pub layout: Layout,
    pub weights: WeightStore,
}

impl Model {
    /// A built-in or RON layout with synthetic weights drawn from `seed`.
    pub fn synthetic(layout: Layout, seed: u64, cache_budget_bytes: usize) -> Result<Model> {
        let source = weights::synthetic::SyntheticWeights::new(&layout, seed);
        let weights = WeightStore::new(&layout, Box::new(source), cache_budget_bytes)?;
        Ok(Model { layout, weights })
    }

    /// An HF checkpoint directory (`config.json` + safetensors).
    pub fn hf_checkpoint(dir: &Path, cache_budget_bytes: usize) -> Result<Model> {
        let layout = hf_config::layout_from_config_file(&dir.join("config.json"))?;
        let source = weights::safetensors::CheckpointWeights::open(dir)?;
        let weights = WeightStore::new(&layout, Box::new(source), cache_budget_bytes)?;
        Ok(Model { layout, weights })
    }
}
