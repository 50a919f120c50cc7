//! GGUF models (`glm-dsa`, `deepseek2`): the layout from the file's metadata, and the file's
//! tensors under the canonical HF names the engine asks for.
//!
//! The metadata is turned into the equivalent HF `config.json` values and handed to
//! [`hf_config::layout_from_config`], so a GGUF file and an HF checkpoint of one model give the
//! same layout. Two MLA facts have no llama.cpp key and are read from mladb's own keys when a
//! file carries them (tools/hf_to_gguf.py writes them): `mladb.rope_interleave` (default: true,
//! the DeepSeek-V3 / GLM-5 layout) and `mladb.indexer_types` (per-layer "full"/"shared"; default
//! all full).
//!
//! kv_b_proj comes either merged (`attn_kv_b`, [N·(P+V), L] as in HF) or split (`attn_k_b`
//! [N, L, P] = W_UK transposed per head, `attn_v_b` [N, V, L]); the split form is reassembled
//! into the merged one on read. Routed experts are stacked (`ffn_*_exps` [E, rows, cols]): expert
//! e is the e-th slab.

use super::catalog::Catalog;
use super::hf_config;
use super::layout::Layout;
use super::quant::QuantTensor;
use super::weights::WeightSource;
use crate::error::{Error, Result};
use crate::gguf::{GgmlType, GgufFile, Value};
use serde_json::{json, Map};
use std::collections::HashMap;
use std::path::Path;

/// Whether `path` names a GGUF file (by its magic, so the extension does not matter).
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && magic == crate::gguf::MAGIC
}

/// Where an HF tensor lives in the file.
#[derive(Debug, Clone)]
enum Place {
    /// A whole GGUF tensor.
    Whole(String),
    /// Slab `expert` of a stacked expert tensor.
    Expert(String, usize),
    /// kv_b_proj reassembled from `attn_k_b` and `attn_v_b`.
    SplitKvB { k_b: String, v_b: String },
}

pub struct GgufWeights {
    file: GgufFile,
    layout: Layout,
    places: HashMap<String, Place>,
    shapes: HashMap<String, Vec<usize>>,
}

impl GgufWeights {
    pub fn open(path: &Path) -> Result<GgufWeights> {
        let file = GgufFile::open(path)?;
        let config = config_from_metadata(&file)?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "gguf".into());
        let layout = hf_config::layout_from_config(&config, &name)
            .map_err(|e| Error::parse(path, format!("layout from the GGUF metadata: {e}")))?;
        let catalog = Catalog::new(&layout);
        let mut places = HashMap::new();
        let mut shapes = HashMap::new();
        for (hf, spec) in catalog.iter() {
            let Some(place) = place_of(&file, hf, &layout) else {
                continue; // reported by WeightStore as missing, with the HF name
            };
            let shape = match &place {
                Place::Whole(g) => shape_of(&file, g),
                Place::Expert(g, _) => shape_of(&file, g)
                    .get(1..)
                    .map(<[usize]>::to_vec)
                    .unwrap_or_default(),
                Place::SplitKvB { k_b, v_b } => {
                    let (k, v) = (shape_of(&file, k_b), shape_of(&file, v_b));
                    match (k.as_slice(), v.as_slice()) {
                        ([n, l, p], [n2, vd, l2]) if n == n2 && l == l2 => vec![n * (p + vd), *l],
                        _ => k.into_iter().chain(v).collect(),
                    }
                }
            };
            // A misshapen tensor: report it under its GGUF name, which is what the user has.
            if shape != spec.shape {
                let gname = match &place {
                    Place::Whole(g) | Place::Expert(g, _) => g.clone(),
                    Place::SplitKvB { k_b, v_b } => format!("{k_b} + {v_b}"),
                };
                return Err(Error::ShapeMismatch {
                    name: format!("{gname} (for {hf})"),
                    source_desc: path.display().to_string(),
                    expected: spec.shape.clone(),
                    found: shape,
                });
            }
            shapes.insert(hf.clone(), shape);
            places.insert(hf.clone(), place);
        }
        Ok(GgufWeights {
            file,
            layout,
            places,
            shapes,
        })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Elements `start..start + out.len()` of GGUF tensor `g`, in storage order.
    fn read_elements(&self, g: &str, start: u64, out: &mut [f32]) -> Result<()> {
        let t = self.file.tensor(g)?;
        let row = t.row_len();
        let end = start + out.len() as u64;
        let (first, last) = (start / row, end.div_ceil(row));
        let values = self.file.dequantize_rows(g, first..last)?;
        let skip = (start - first * row) as usize;
        out.copy_from_slice(&values[skip..skip + out.len()]);
        Ok(())
    }

    /// The merged kv_b_proj [N·(P+V), L] from the split tensors.
    fn merged_kv_b(&self, k_b: &str, v_b: &str) -> Result<Vec<f32>> {
        let (k, v) = (shape_of(&self.file, k_b), shape_of(&self.file, v_b));
        let (n, l, p, vd) = (k[0], k[1], k[2], v[1]);
        let (kv, vv) = (self.file.dequantize(k_b)?, self.file.dequantize(v_b)?);
        let mut out = vec![0.0f32; n * (p + vd) * l];
        for h in 0..n {
            let block = &mut out[h * (p + vd) * l..(h + 1) * (p + vd) * l];
            for pi in 0..p {
                for li in 0..l {
                    block[pi * l + li] = kv[(h * l + li) * p + pi];
                }
            }
            block[p * l..].copy_from_slice(&vv[h * vd * l..(h + 1) * vd * l]);
        }
        Ok(out)
    }
}

fn shape_of(file: &GgufFile, g: &str) -> Vec<usize> {
    file.tensor(g)
        .map(|t| t.shape().into_iter().map(|d| d as usize).collect())
        .unwrap_or_default()
}

impl WeightSource for GgufWeights {
    fn describe(&self) -> String {
        self.file.path().display().to_string()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.shapes.get(name).cloned()
    }

    fn read_rows(&self, name: &str, start_row: usize, out: &mut [f32]) -> Result<()> {
        let shape = self.shapes.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            source_desc: self.describe(),
        })?;
        let cols: usize = shape.iter().skip(1).product();
        let start = (start_row * cols) as u64;
        if start + out.len() as u64 > shape.iter().product::<usize>() as u64 {
            return Err(Error::invalid(format!(
                "rows from {start_row} of {name} are out of range"
            )));
        }
        match &self.places[name] {
            Place::Whole(g) => self.read_elements(g, start, out),
            Place::Expert(g, e) => {
                let per_expert: usize = shape.iter().product();
                self.read_elements(g, (*e * per_expert) as u64 + start, out)
            }
            Place::SplitKvB { k_b, v_b } => {
                let merged = self.merged_kv_b(k_b, v_b)?;
                out.copy_from_slice(&merged[start as usize..start as usize + out.len()]);
                Ok(())
            }
        }
    }

    fn quantized(&self, name: &str) -> Option<Result<QuantTensor>> {
        let Place::Whole(g) = self.places.get(name)? else {
            return None;
        };
        let t = self.file.tensor(g).ok()?;
        let shape = self.shapes.get(name)?;
        let plain = matches!(t.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        if plain || shape.len() != 2 {
            return None;
        }
        Some(
            self.file
                .tensor_bytes(g)
                .and_then(|b| QuantTensor::new(t.ty, shape[0], shape[1], b.to_vec().into())),
        )
    }
}

/// The GGUF tensor behind an HF name of the catalog.
fn place_of(file: &GgufFile, hf: &str, layout: &Layout) -> Option<Place> {
    let has = |g: &str| file.has_tensor(g);
    let whole = |g: String| has(&g).then_some(Place::Whole(g));
    match hf {
        "model.embed_tokens.weight" => return whole("token_embd.weight".into()),
        "model.norm.weight" => return whole("output_norm.weight".into()),
        "lm_head.weight" => {
            return whole("output.weight".into()).or_else(|| whole("token_embd.weight".into()))
        }
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (l, rest) = rest.split_once('.')?;
    let l: usize = l.parse().ok()?;
    if l >= layout.num_layers {
        return None;
    }
    let blk = |s: &str| format!("blk.{l}.{s}");
    if let Some(e_rest) = rest.strip_prefix("mlp.experts.") {
        let (e, proj) = e_rest.split_once('.')?;
        let e: usize = e.parse().ok()?;
        let kind = proj.strip_suffix("_proj.weight")?;
        let g = blk(&format!("ffn_{kind}_exps.weight"));
        return has(&g).then_some(Place::Expert(g, e));
    }
    if rest == "self_attn.kv_b_proj.weight" {
        let merged = blk("attn_kv_b.weight");
        if has(&merged) {
            return Some(Place::Whole(merged));
        }
        let (k_b, v_b) = (blk("attn_k_b.weight"), blk("attn_v_b.weight"));
        return (has(&k_b) && has(&v_b)).then_some(Place::SplitKvB { k_b, v_b });
    }
    let (stem, suffix) = match rest.rsplit_once('.') {
        Some((s, "weight")) => (s, "weight"),
        Some((s, "bias")) => (s, "bias"),
        Some((s, "e_score_correction_bias")) => (s, "e_score_correction_bias"),
        _ => return None,
    };
    let g = match (stem, suffix) {
        ("mlp.gate", "e_score_correction_bias") => return whole(blk("exp_probs_b.bias")),
        ("input_layernorm", _) => "attn_norm",
        ("post_attention_layernorm", _) => "ffn_norm",
        ("self_attn.q_a_proj", _) => "attn_q_a",
        ("self_attn.q_a_layernorm", _) => "attn_q_a_norm",
        ("self_attn.q_b_proj", _) => "attn_q_b",
        ("self_attn.q_proj", _) => "attn_q",
        ("self_attn.kv_a_proj_with_mqa", _) => "attn_kv_a_mqa",
        ("self_attn.kv_a_layernorm", _) => "attn_kv_a_norm",
        ("self_attn.o_proj", _) => "attn_output",
        ("self_attn.indexer.wq_b", _) => "indexer.attn_q_b",
        ("self_attn.indexer.wk", _) => "indexer.attn_k",
        ("self_attn.indexer.k_norm", _) => "indexer.k_norm",
        ("self_attn.indexer.weights_proj", _) => "indexer.proj",
        ("mlp.gate", _) => "ffn_gate_inp",
        ("mlp.gate_proj", _) => "ffn_gate",
        ("mlp.up_proj", _) => "ffn_up",
        ("mlp.down_proj", _) => "ffn_down",
        ("mlp.shared_experts.gate_proj", _) => "ffn_gate_shexp",
        ("mlp.shared_experts.up_proj", _) => "ffn_up_shexp",
        ("mlp.shared_experts.down_proj", _) => "ffn_down_shexp",
        _ => return None,
    };
    whole(blk(&format!("{g}.{suffix}")))
}

/// The HF `config.json` values the file's metadata stands for.
fn config_from_metadata(file: &GgufFile) -> Result<serde_json::Value> {
    let arch = file.get_str("general.architecture")?.to_string();
    let model_type = match arch.as_str() {
        "glm-dsa" => "glm_moe_dsa",
        "deepseek2" => "deepseek_v3",
        other => {
            return Err(Error::parse(
                file.path(),
                format!("architecture '{other}': mladb runs glm-dsa and deepseek2 files"),
            ))
        }
    };
    let key = |k: &str| format!("{arch}.{k}");
    let u = |k: &str| file.get_u64(&key(k));
    let opt_u = |k: &str| file.get(&key(k)).map(|_| u(k)).transpose();
    // An f32 value is read as the shortest decimal that round-trips (1e-5, not
    // 9.99999974e-6), which is what the converter wrote from config.json.
    // A non-finite value (rope.freq_base inf, an epsilon NaN) is an error: JSON cannot hold it,
    // and a default in its place would run another model than the file describes.
    let opt_f = |k: &str| -> Result<Option<f64>> {
        let v = match file.get(&key(k)) {
            None => return Ok(None),
            Some(Value::F32(x)) => format!("{x}").parse().unwrap_or(*x as f64),
            Some(_) => file.get_f64(&key(k))?,
        };
        if !v.is_finite() {
            return Err(Error::parse(
                file.path(),
                format!("{}: {v} is not a finite number", key(k)),
            ));
        }
        Ok(Some(v))
    };
    // A key present with another type than the one it must have is an error, not a default.
    let typed = |k: &str, want: &str, ok: bool| -> Result<()> {
        if ok {
            Ok(())
        } else {
            Err(Error::parse(file.path(), format!("{k}: expected {want}")))
        }
    };
    let mut c = Map::new();
    c.insert("model_type".into(), json!(model_type));
    let heads = u("attention.head_count")?;
    let rope_dim = u("rope.dimension_count")?;
    let embd_rows = file.tensor("token_embd.weight").map(|t| t.shape()[0]).ok();
    let vocab = opt_u("vocab_size")?.or(embd_rows).ok_or_else(|| {
        Error::parse(
            file.path(),
            "neither {arch}.vocab_size nor token_embd.weight is present",
        )
    })?;
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("hidden_size".into(), json!(u("embedding_length")?));
    c.insert("num_hidden_layers".into(), json!(u("block_count")?));
    c.insert("num_attention_heads".into(), json!(heads));
    c.insert("num_key_value_heads".into(), json!(heads));
    c.insert("intermediate_size".into(), json!(u("feed_forward_length")?));
    c.insert("kv_lora_rank".into(), json!(u("attention.kv_lora_rank")?));
    let q_lora = opt_u("attention.q_lora_rank")?.unwrap_or(0);
    c.insert(
        "q_lora_rank".into(),
        if q_lora == 0 {
            serde_json::Value::Null
        } else {
            json!(q_lora)
        },
    );
    c.insert("qk_rope_head_dim".into(), json!(rope_dim));
    // The split-kv_b form stores the MLA head sizes under *_mla (key_length is then L + R).
    let key_len =
        opt_u("attention.key_length_mla")?.map_or_else(|| u("attention.key_length"), Ok)?;
    let value_len =
        opt_u("attention.value_length_mla")?.map_or_else(|| u("attention.value_length"), Ok)?;
    let nope = key_len.checked_sub(rope_dim).ok_or_else(|| {
        Error::parse(
            file.path(),
            format!("key length {key_len} is shorter than the RoPE dims {rope_dim}"),
        )
    })?;
    c.insert("qk_nope_head_dim".into(), json!(nope));
    c.insert("v_head_dim".into(), json!(value_len));
    if let Some(eps) = opt_f("attention.layer_norm_rms_epsilon")? {
        c.insert("rms_norm_eps".into(), json!(eps));
    }
    if let Some(ctx) = opt_u("context_length")? {
        c.insert("max_position_embeddings".into(), json!(ctx));
    }
    for (k, hf) in [
        ("expert_count", "n_routed_experts"),
        ("expert_used_count", "num_experts_per_tok"),
        ("expert_shared_count", "n_shared_experts"),
        ("leading_dense_block_count", "first_k_dense_replace"),
        ("expert_feed_forward_length", "moe_intermediate_size"),
        ("expert_group_count", "n_group"),
        ("expert_group_used_count", "topk_group"),
        ("attention.indexer.head_count", "index_n_heads"),
        ("attention.indexer.key_length", "index_head_dim"),
        ("attention.indexer.top_k", "index_topk"),
    ] {
        if let Some(v) = opt_u(k)? {
            c.insert(hf.into(), json!(v));
        }
    }
    if let Some(scale) = opt_f("expert_weights_scale")? {
        c.insert("routed_scaling_factor".into(), json!(scale));
    }
    match file.get(&key("expert_weights_norm")) {
        Some(Value::Bool(b)) => {
            c.insert("norm_topk_prob".into(), json!(*b));
        }
        Some(_) => typed(&key("expert_weights_norm"), "a bool", false)?,
        None => {}
    }
    if let Some(g) = opt_u("expert_gating_func")? {
        // llama.cpp: 1 = softmax, 2 = sigmoid.
        c.insert(
            "scoring_func".into(),
            json!(if g == 2 { "sigmoid" } else { "softmax" }),
        );
    }
    let theta = opt_f("rope.freq_base")?.unwrap_or(10000.0);
    let mut rope = Map::new();
    rope.insert("rope_theta".into(), json!(theta));
    if let Some(v) = file.get(&key("rope.scaling.type")) {
        typed(&key("rope.scaling.type"), "a string", v.as_str().is_some())?;
    }
    match file.get(&key("rope.scaling.type")).and_then(Value::as_str) {
        Some("yarn") => {
            rope.insert("rope_type".into(), json!("yarn"));
            rope.insert(
                "factor".into(),
                json!(opt_f("rope.scaling.factor")?.unwrap_or(1.0)),
            );
            if let Some(orig) = opt_u("rope.scaling.original_context_length")? {
                rope.insert("original_max_position_embeddings".into(), json!(orig));
            }
            // llama.cpp stores 0.1·mscale_all_dim and uses it for both mscales.
            if let Some(m) = opt_f("rope.scaling.yarn_log_multiplier")? {
                rope.insert("mscale_all_dim".into(), json!(m / 0.1));
                rope.insert("mscale".into(), json!(m / 0.1));
            }
        }
        Some("none") | None => {
            rope.insert("rope_type".into(), json!("default"));
        }
        Some(other) => {
            return Err(Error::parse(
                file.path(),
                format!("RoPE scaling '{other}' is not supported (yarn or none)"),
            ))
        }
    }
    c.insert("rope_parameters".into(), serde_json::Value::Object(rope));
    let interleave = match file.get("mladb.rope_interleave") {
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            typed("mladb.rope_interleave", "a bool", false)?;
            true
        }
        None => true,
    };
    c.insert("rope_interleave".into(), json!(interleave));
    match file.get("mladb.indexer_types") {
        Some(Value::Array(crate::gguf::Array::String(types))) => {
            c.insert("indexer_types".into(), json!(types));
        }
        Some(_) => typed("mladb.indexer_types", "an array of strings", false)?,
        None => {}
    }
    c.insert(
        "tie_word_embeddings".into(),
        json!(!file.has_tensor("output.weight")),
    );
    c.insert(
        "attention_bias".into(),
        json!(file.has_tensor("blk.0.attn_kv_a_mqa.bias")),
    );
    Ok(serde_json::Value::Object(c))
}
