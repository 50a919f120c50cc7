//! External dumps: a safetensors file of named activations from another engine (HF transformers
//! through tools/hf_dump.py, vLLM, SGLang, or mladb's own `--dump`), keyed `PHASE/NAME`, with a
//! name map from the other engine's names to mladb's op names.

use super::compare::{compare_outputs, OpComparison};
use super::record::RunRecord;
use crate::engine::trace::Phase;
use crate::error::{Error, Result};
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::Path;

/// Rules turning another engine's names into mladb op names.
#[derive(Debug, Clone, Deserialize)]
pub struct NameMap {
    rules: Vec<Rule>,
}

#[derive(Debug, Clone, Deserialize)]
struct Rule {
    from: String,
    to: Option<String>,
}

const HF_MAP: &str = include_str!("../../tools/name-maps/hf.ron");

impl NameMap {
    /// The map for HF transformers module names.
    pub fn hf() -> NameMap {
        ron::from_str(HF_MAP).expect("the built-in HF name map parses")
    }

    /// `hf` (built in), or a RON file of rules.
    pub fn resolve(name_or_path: &str) -> Result<NameMap> {
        if name_or_path == "hf" {
            return Ok(NameMap::hf());
        }
        let path = Path::new(name_or_path);
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        ron::from_str(&text).map_err(|e| {
            Error::parse(
                path,
                format!(
                    "line {}, column {}: {}",
                    e.span.start.line, e.span.start.col, e.code
                ),
            )
        })
    }

    /// The mladb op name for an external name, or `None` when the map leaves it out.
    pub fn map(&self, name: &str) -> Option<String> {
        for rule in &self.rules {
            if let Some(parts) = glob(&rule.from, name) {
                let to = rule.to.as_ref()?;
                let mut out = String::new();
                let mut parts = parts.into_iter();
                for (i, piece) in to.split('*').enumerate() {
                    if i > 0 {
                        out.push_str(parts.next().unwrap_or("*"));
                    }
                    out.push_str(piece);
                }
                return Some(out);
            }
        }
        Some(name.to_string())
    }
}

/// Matches `pattern` (with `*` = one dot-free part) against `name`, returning the parts.
fn glob<'a>(pattern: &str, name: &'a str) -> Option<Vec<&'a str>> {
    let p: Vec<&str> = pattern.split('.').collect();
    let n: Vec<&str> = name.split('.').collect();
    if p.len() != n.len() {
        return None;
    }
    let mut parts = Vec::new();
    for (a, b) in p.iter().zip(&n) {
        if *a == "*" {
            parts.push(*b);
        } else if a != b {
            return None;
        }
    }
    Some(parts)
}

/// A loaded dump: tensors by (phase, mladb op name), in f32.
pub struct ExternalDump {
    pub tensors: HashMap<(Phase, String), (Vec<usize>, Vec<f32>)>,
    /// Keys the map left out or that did not parse as PHASE/NAME.
    pub skipped: usize,
}

impl ExternalDump {
    pub fn load(path: &Path, map: &NameMap) -> Result<ExternalDump> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| Error::parse(path, format!("not a valid safetensors file: {e}")))?;
        let mut tensors = HashMap::new();
        let mut skipped = 0;
        for (key, view) in st.tensors() {
            let Some((phase, name)) = key.split_once('/') else {
                skipped += 1;
                continue;
            };
            let (Ok(phase), Some(name)) = (phase.parse::<Phase>(), map.map(name)) else {
                skipped += 1;
                continue;
            };
            let data: Vec<f32> = match view.dtype() {
                Dtype::F32 => view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                Dtype::F16 => view
                    .data()
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                Dtype::BF16 => view
                    .data()
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                other => {
                    return Err(Error::parse(
                        path,
                        format!("{key} is {other:?}; dumps must hold F32, F16 or BF16"),
                    ))
                }
            };
            tensors.insert((phase, name), (view.shape().to_vec(), data));
        }
        if tensors.is_empty() {
            return Err(Error::parse(
                path,
                "no PHASE/NAME tensors (expected keys like prefill/logits)",
            ));
        }
        Ok(ExternalDump { tensors, skipped })
    }

    /// A run's own outputs as a dump (what `mladb run --dump` writes, without the file).
    pub fn from_run(run: &RunRecord) -> ExternalDump {
        let tensors = run
            .events
            .iter()
            .zip(&run.outputs)
            .map(|(e, t)| {
                (
                    (e.phase, e.name.clone()),
                    (e.shape.clone(), t.data().to_vec()),
                )
            })
            .collect();
        ExternalDump {
            tensors,
            skipped: 0,
        }
    }

    /// Compares every op of `run` the dump holds, in execution order.
    pub fn compare(&self, run: &RunRecord, num_heads: usize) -> Vec<OpComparison> {
        run.events
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let (shape, data) = self.tensors.get(&(e.phase, e.name.clone()))?;
                Some(compare_outputs(
                    e,
                    i,
                    run.outputs[i].data(),
                    shape,
                    data,
                    num_heads,
                ))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_map_rules() {
        let m = NameMap::hf();
        assert_eq!(m.map("lm_head").as_deref(), Some("logits"));
        assert_eq!(
            m.map("model.layers.12.self_attn").as_deref(),
            Some("model.layers.12.self_attn.o_proj")
        );
        assert_eq!(m.map("model.layers.3.mlp.act_fn"), None);
        assert_eq!(
            m.map("model.layers.3.self_attn.kv_a_proj_with_mqa")
                .as_deref(),
            Some("model.layers.3.self_attn.kv_a_proj_with_mqa")
        );
        assert_eq!(m.map("model.layers.3.self_attn.indexer"), None);
        assert_eq!(
            m.map("model.layers.3.self_attn.indexer.wk").as_deref(),
            Some("model.layers.3.self_attn.indexer.wk")
        );
    }
}
