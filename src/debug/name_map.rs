//! Name maps: rules that turn another engine's module names (HF transformers, vLLM, SGLang,
//! llama.cpp) into mladb op names, with what it takes to make the numbers comparable: a fused
//! output cut into the columns of several ops, and how tensor-parallel ranks hold a tensor
//! (whole, a slice of columns each, or partial sums). One map serves dumps (`--reference`) and
//! live engines (`mladb attach`). The shipped maps live in `tools/name-maps/`, each saying which
//! version of the engine's code it was read from.

use crate::error::{Error, Result};
use crate::model::layout::Layout;
use serde::Deserialize;
use std::ops::Range;
use std::path::Path;

/// How the tensor-parallel ranks of an engine hold a module's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum Shard {
    /// Every rank holds the whole tensor (replicated layers, outputs after an all-reduce).
    #[default]
    Replicated,
    /// Each rank holds a contiguous slice of the features (its heads or output columns), rank 0
    /// first: per token, the ranks' features are concatenated.
    Columns,
    /// Each rank holds a partial sum of the whole tensor (a row-parallel linear before its
    /// all-reduce): the ranks' tensors are added.
    RowSum,
}

/// Rules turning another engine's names into mladb op names.
#[derive(Debug, Clone, Deserialize)]
pub struct NameMap {
    /// The engine the map is for (`hf`, `vllm`, `sglang`, `llamacpp`).
    #[serde(default)]
    pub engine: String,
    /// Where the engine's names were read: repository, commit, date, files.
    #[serde(default)]
    pub source: String,
    rules: Vec<Rule>,
}

#[derive(Debug, Clone, Deserialize)]
struct Rule {
    from: String,
    #[serde(default)]
    to: Option<String>,
    #[serde(default)]
    shard: Shard,
    /// A fused output cut into consecutive column pieces, each an op of its own.
    #[serde(default)]
    split: Vec<Piece>,
    /// The split applies to each rank's tensor (a merged column-parallel linear: rank r holds
    /// `[gate_r | up_r]`): each piece's width is divided among the ranks, and the ranks' parts
    /// of a piece are joined by columns.
    #[serde(default)]
    split_per_rank: bool,
    /// The module is an attention wrapper whose kernel writes a buffer the wrapper allocated.
    #[serde(default)]
    kernel_output: bool,
    /// A choice listed in another order than mladb's (top-k indices sorted by score): compared
    /// live as sets; a dump, compared element by element, leaves it out.
    #[serde(default)]
    choice: bool,
}

#[derive(Debug, Clone, Deserialize)]
struct Piece {
    to: Option<String>,
    /// A sum of integers and layout fields: `kv_lora_rank + qk_rope_head_dim`.
    width: String,
}

/// What one engine tensor stands for in mladb's run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The mladb op name.
    pub op: String,
    /// The columns of the (reassembled) tensor that are this op's, when the output is fused.
    pub columns: Option<Range<usize>>,
    pub shard: Shard,
    /// The module's kernel writes an output buffer its wrapper allocated.
    pub kernel_output: bool,
    /// `columns` are cut from each rank's tensor, scaled to its share (see the rule's
    /// `split_per_rank`).
    pub per_rank: bool,
}

const HF_MAP: &str = include_str!("../../tools/name-maps/hf.ron");
const VLLM_MAP: &str = include_str!("../../tools/name-maps/vllm.ron");
const SGLANG_MAP: &str = include_str!("../../tools/name-maps/sglang.ron");
const LLAMACPP_MAP: &str = include_str!("../../tools/name-maps/llamacpp.ron");

/// The maps built in, by the names `--name-map` takes.
pub const BUILT_IN: &[&str] = &["hf", "vllm", "sglang", "llamacpp"];

impl NameMap {
    /// The map for HF transformers module names.
    pub fn hf() -> NameMap {
        NameMap::built_in("hf").expect("hf is built in")
    }

    /// A shipped map by name (`hf`, `vllm`, `sglang`, `llamacpp`).
    pub fn built_in(name: &str) -> Option<NameMap> {
        let text = match name {
            "hf" => HF_MAP,
            "vllm" => VLLM_MAP,
            "sglang" => SGLANG_MAP,
            "llamacpp" | "llama.cpp" => LLAMACPP_MAP,
            _ => return None,
        };
        Some(ron::from_str(text).unwrap_or_else(|e| panic!("the built-in {name} map parses: {e}")))
    }

    /// The map for an engine's hello (`vllm`, `sglang`, ...); HF's for one mladb has none for.
    pub fn for_engine(engine: &str) -> NameMap {
        NameMap::built_in(engine).unwrap_or_else(NameMap::hf)
    }

    /// No rules: every name is taken as an mladb op name (mladb's own dumps).
    pub fn identity() -> NameMap {
        NameMap {
            engine: "mladb".into(),
            source: String::new(),
            rules: Vec::new(),
        }
    }

    /// A built-in map by name, or a RON file of rules.
    pub fn resolve(name_or_path: &str) -> Result<NameMap> {
        if let Some(map) = NameMap::built_in(name_or_path) {
            return Ok(map);
        }
        let path = Path::new(name_or_path);
        let text = crate::input::read_text_capped(path, crate::input::MAX_LAYOUT_BYTES)?;
        let map: NameMap = ron::from_str(&text).map_err(|e| Error::ron(path, e))?;
        for rule in &map.rules {
            for piece in &rule.split {
                width_terms(&piece.width).map_err(|e| Error::parse(path, e))?;
            }
        }
        Ok(map)
    }

    /// The mladb op name for an external name, or `None` when the map leaves it out or cuts it
    /// into several ops (a dump's tensors are compared whole; see [`NameMap::targets`]).
    pub fn map(&self, name: &str) -> Option<String> {
        match self.rule_for(name) {
            Some((rule, parts)) if rule.split.is_empty() && !rule.choice => {
                rule.to.as_ref().map(|to| substitute(to, &parts))
            }
            Some(_) => None,
            None => Some(name.to_string()),
        }
    }

    /// What an engine tensor stands for: one op, several column pieces of a fused output, or
    /// nothing. Widths are read from `layout`; a width naming no layout field is an error.
    pub fn targets(&self, name: &str, layout: &Layout) -> std::result::Result<Vec<Target>, String> {
        let Some((rule, parts)) = self.rule_for(name) else {
            return Ok(vec![Target {
                op: name.to_string(),
                columns: None,
                shard: Shard::Replicated,
                kernel_output: false,
                per_rank: false,
            }]);
        };
        if rule.split.is_empty() {
            return Ok(rule
                .to
                .iter()
                .map(|to| Target {
                    op: substitute(to, &parts),
                    columns: None,
                    shard: rule.shard,
                    kernel_output: rule.kernel_output,
                    per_rank: false,
                })
                .collect());
        }
        let mut out = Vec::new();
        let mut start = 0;
        for piece in &rule.split {
            let width = width_of(&piece.width, layout)?;
            if let Some(to) = &piece.to {
                out.push(Target {
                    op: substitute(to, &parts),
                    columns: Some(start..start + width),
                    shard: rule.shard,
                    kernel_output: rule.kernel_output,
                    per_rank: rule.split_per_rank,
                });
            }
            start += width;
        }
        Ok(out)
    }

    /// The first rule whose pattern matches, with the parts its `*`s matched.
    fn rule_for<'a>(&self, name: &'a str) -> Option<(&Rule, Vec<&'a str>)> {
        self.rules
            .iter()
            .find_map(|rule| glob(&rule.from, name).map(|parts| (rule, parts)))
    }
}

/// `to` with each `*` replaced by the next matched part.
fn substitute(to: &str, parts: &[&str]) -> String {
    let mut out = String::new();
    let mut parts = parts.iter();
    for (i, piece) in to.split('*').enumerate() {
        if i > 0 {
            out.push_str(parts.next().copied().unwrap_or("*"));
        }
        out.push_str(piece);
    }
    out
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

/// The terms of a width: integers and layout field names, joined by `+`.
fn width_terms(text: &str) -> std::result::Result<Vec<&str>, String> {
    let terms: Vec<&str> = text.split('+').map(str::trim).collect();
    for t in &terms {
        if t.parse::<usize>().is_err() && !LAYOUT_FIELDS.contains(t) {
            return Err(format!(
                "split width '{text}': '{t}' is neither a number nor one of {}",
                LAYOUT_FIELDS.join(", ")
            ));
        }
    }
    Ok(terms)
}

/// The layout fields a split width may name.
const LAYOUT_FIELDS: &[&str] = &[
    "hidden_size",
    "num_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "index_n_heads",
    "index_head_dim",
    "vocab_size",
];

/// A width's value for `layout`; a field the layout lacks (no q_lora_rank, no indexer) is an
/// error naming it.
fn width_of(text: &str, layout: &Layout) -> std::result::Result<usize, String> {
    let mut sum = 0usize;
    for t in width_terms(text)? {
        let v = match t.parse::<usize>() {
            Ok(n) => Some(n),
            Err(_) => layout_field(layout, t),
        };
        let v =
            v.ok_or_else(|| format!("split width '{text}': layout {} has no {t}", layout.name))?;
        sum += v;
    }
    Ok(sum)
}

fn layout_field(l: &Layout, name: &str) -> Option<usize> {
    Some(match name {
        "hidden_size" => l.hidden_size,
        "num_heads" => l.num_heads,
        "q_lora_rank" => l.q_lora_rank?,
        "kv_lora_rank" => l.kv_lora_rank,
        "qk_nope_head_dim" => l.qk_nope_head_dim,
        "qk_rope_head_dim" => l.qk_rope_head_dim,
        "v_head_dim" => l.v_head_dim,
        "intermediate_size" => l.intermediate_size,
        "moe_intermediate_size" => l.moe.as_ref()?.moe_intermediate_size,
        "n_routed_experts" => l.moe.as_ref()?.n_routed_experts,
        "index_n_heads" => l.indexer.as_ref()?.n_heads,
        "index_head_dim" => l.indexer.as_ref()?.head_dim,
        "vocab_size" => l.vocab_size,
        _ => return None,
    })
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
        assert_eq!(
            m.map("model.layers.3.self_attn.indexer"),
            None,
            "a choice: not in dumps"
        );
        let layout = Layout::resolve("glm5-tiny").unwrap();
        assert_eq!(
            m.targets("model.layers.3.self_attn.indexer", &layout)
                .unwrap()[0]
                .op,
            "model.layers.3.self_attn.indexer.topk"
        );
        assert_eq!(
            m.map("model.layers.3.self_attn.indexer.wk").as_deref(),
            Some("model.layers.3.self_attn.indexer.wk")
        );
    }

    #[test]
    fn every_built_in_map_parses_and_names_its_source() {
        for name in BUILT_IN {
            let m = NameMap::built_in(name).unwrap();
            assert_eq!(m.engine, *name, "{name}");
            assert!(!m.source.is_empty(), "{name} says where it was read");
            for rule in &m.rules {
                for piece in &rule.split {
                    width_terms(&piece.width).unwrap();
                }
            }
        }
    }

    #[test]
    fn a_fused_output_is_cut_by_the_layout_and_shards_are_declared() {
        let map: NameMap = ron::from_str(
            r#"(rules: [
                (from: "m.*.fused", split: [
                    (to: Some("m.*.a"), width: "q_lora_rank"),
                    (to: None, width: "8"),
                    (to: Some("m.*.b"), width: "kv_lora_rank + qk_rope_head_dim"),
                ]),
                (from: "m.*.heads", to: Some("m.*.attn_output"), shard: Columns, kernel_output: true),
                (from: "m.*.dropped", to: None),
            ])"#,
        )
        .unwrap();
        let layout = crate::model::layout::Layout::resolve("glm5-tiny").unwrap();
        let q = layout.q_lora_rank.unwrap();
        let kv = layout.kv_lora_rank + layout.qk_rope_head_dim;
        let t = map.targets("m.3.fused", &layout).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(
            (t[0].op.as_str(), t[0].columns.clone()),
            ("m.3.a", Some(0..q))
        );
        assert_eq!(
            (t[1].op.as_str(), t[1].columns.clone()),
            ("m.3.b", Some(q + 8..q + 8 + kv))
        );
        assert_eq!(map.map("m.3.fused"), None, "a dump cannot cut it");
        let h = map.targets("m.0.heads", &layout).unwrap();
        assert_eq!(h[0].shard, Shard::Columns);
        assert!(h[0].kernel_output);
        assert!(map.targets("m.0.dropped", &layout).unwrap().is_empty());
        let plain = map.targets("model.norm", &layout).unwrap();
        assert_eq!(plain[0].op, "model.norm");
        assert_eq!(plain[0].shard, Shard::Replicated);
        assert!(width_terms("kv_lora_rank + heads")
            .unwrap_err()
            .contains("'heads'"));
        let no_q: NameMap = ron::from_str(
            r#"(rules: [(from: "x", split: [(to: Some("y"), width: "index_head_dim")])])"#,
        )
        .unwrap();
        let v3 = crate::model::layout::Layout::resolve("deepseek-v3-tiny").unwrap();
        assert!(no_q
            .targets("x", &v3)
            .unwrap_err()
            .contains("has no index_head_dim"));
    }
}
