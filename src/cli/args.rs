//! Options shared by the commands that build a model, and their parsers.

use crate::backend::DeviceChoice;
use crate::error::{Error, Result};
use crate::model::{Layout, Model};
use clap::{Args, ValueEnum};
use std::ops::Range;
use std::path::PathBuf;

/// Where the model comes from.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Built-in layout name (glm5, glm5-tiny, deepseek-v3, deepseek-v3-tiny) or a .ron file;
    /// weights are synthetic.
    #[arg(long, conflicts_with = "model")]
    pub layout: Option<String>,
    /// An HF checkpoint directory (config.json + *.safetensors).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Memory for keeping fetched weights between steps, in MiB.
    #[arg(long, default_value_t = 8192)]
    pub weight_cache_mb: usize,
}

impl ModelArgs {
    pub fn with_layout(name: &str) -> ModelArgs {
        ModelArgs {
            layout: Some(name.to_string()),
            model: None,
            seed: 0,
            weight_cache_mb: 8192,
        }
    }

    /// Builds the model: an HF checkpoint, or a layout (default glm5-tiny) with synthetic weights.
    pub fn load(&self) -> Result<Model> {
        let budget = self.weight_cache_mb.saturating_mul(1 << 20);
        match &self.model {
            Some(dir) => Model::hf_checkpoint(dir, budget),
            None => {
                let layout = Layout::resolve(self.layout.as_deref().unwrap_or("glm5-tiny"))?;
                Model::synthetic(layout, self.seed, budget)
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    Cpu,
    Cuda,
    Auto,
}

impl From<DeviceArg> for DeviceChoice {
    fn from(d: DeviceArg) -> DeviceChoice {
        match d {
            DeviceArg::Cpu => DeviceChoice::Cpu,
            DeviceArg::Cuda => DeviceChoice::Cuda,
            DeviceArg::Auto => DeviceChoice::Auto,
        }
    }
}

/// `3,141,59` → token ids.
pub fn parse_tokens(text: &str) -> Result<Vec<u32>> {
    let tokens: Vec<u32> = text
        .split(',')
        .map(|t| {
            let t = t.trim();
            t.parse::<u32>().map_err(|_| {
                Error::invalid(format!(
                    "--tokens: '{t}' is not a token id (expected e.g. 3,141,59)"
                ))
            })
        })
        .collect::<Result<_>>()?;
    if tokens.is_empty() {
        return Err(Error::invalid("--tokens: no token ids given"));
    }
    Ok(tokens)
}

/// `A..B` (half-open, like Rust), `A..=B` (inclusive) or `A` (one layer).
pub fn parse_layers(text: &str, num_layers: usize) -> Result<Range<usize>> {
    let bad = || {
        Error::invalid(format!(
            "--layers: '{text}' is not a layer range (expected A..B, A..=B or A)"
        ))
    };
    let num = |s: &str| s.trim().parse::<usize>().map_err(|_| bad());
    let range = if let Some((a, b)) = text.split_once("..=") {
        num(a)?..num(b)?.checked_add(1).ok_or_else(bad)?
    } else if let Some((a, b)) = text.split_once("..") {
        num(a)?..num(b)?
    } else {
        let a = num(text)?;
        a..a + 1
    };
    if range.start >= range.end || range.end > num_layers {
        return Err(Error::invalid(format!(
            "--layers {text}: the model has layers 0..{num_layers}, and the range must hold at least one"
        )));
    }
    Ok(range)
}

/// A prompt that fits any vocabulary: spread-out ids, deterministic.
pub fn default_prompt(vocab: usize, len: usize) -> Vec<u32> {
    (0..len).map(|i| ((i * 7919 + 1) % vocab) as u32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_ranges() {
        assert_eq!(parse_layers("0..2", 78).unwrap(), 0..2);
        assert_eq!(parse_layers("0..=2", 78).unwrap(), 0..3);
        assert_eq!(parse_layers("5", 78).unwrap(), 5..6);
        assert!(parse_layers("2..2", 78).is_err());
        assert!(parse_layers("0..79", 78).is_err());
        assert!(parse_layers("x", 78).is_err());
    }

    #[test]
    fn token_lists() {
        assert_eq!(parse_tokens("3,141, 59").unwrap(), vec![3, 141, 59]);
        assert!(parse_tokens("3,,4").is_err());
        assert!(parse_tokens("-1").is_err());
    }
}
