//! `mladb layout export`: mladb's synthetic weights written as an HF checkpoint directory with
//! the model's real tensor names: `config.json`, shards `model-0000i-of-0000N.safetensors` and
//! `model.safetensors.index.json`, in bf16 or in block-scaled FP8 as the official FP8
//! checkpoints store it. A real-sized checkpoint can so be made on any machine without
//! downloading one, and every value in it is known ([`verify`] recomputes them).
//!
//! The layout may keep fewer layers, dense layers, routed experts or vocabulary rows
//! ([`Counts`]); every tensor keeps its full-size shape, and its values are the full model's
//! (synthetic values depend on the seed, the tensor's name and the element's index alone).
//! Tensors are generated, encoded and written one band of rows at a time, so memory stays at a
//! few band buffers whatever the model's size.

pub mod config;
pub mod fp8;
mod verify;

pub use config::{hf_config, shrink, Counts};
pub use verify::{verify, Verified};

use super::catalog::{Catalog, TensorRole};
use super::layout::Layout;
use super::weights::synthetic::SyntheticWeights;
use super::weights::WeightSource;
use crate::error::{Error, Result};
use rayon::prelude::*;
use serde_json::{json, Map, Value};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

/// How the checkpoint stores its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportDtype {
    Bf16,
    /// Projections in E4M3 with one f32 `weight_scale_inv` per block of `block` = [rows, cols].
    Fp8 {
        block: [usize; 2],
    },
}

impl ExportDtype {
    /// FP8 in the official checkpoints' 128×128 blocks.
    pub const FP8: ExportDtype = ExportDtype::Fp8 { block: [128, 128] };

    pub fn name(self) -> &'static str {
        match self {
            ExportDtype::Bf16 => "bf16",
            ExportDtype::Fp8 { .. } => "fp8",
        }
    }
}

/// How one tensor is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    Bf16,
    F32,
    /// E4M3 bytes, with a `<name>_scale_inv` F32 tensor of per-block scales beside them.
    Fp8,
}

/// Tensors of the projection role the official FP8 checkpoints of DeepSeek-V3 and GLM-5 keep in
/// bf16: the LM head, the router and the DSA indexer's head weights (their inputs feed a
/// softmax-free ranking that FP8 would perturb, and they are small).
const KEPT_OUT_OF_FP8: &[&str] = &[
    "lm_head.weight",
    ".mlp.gate.weight",
    ".indexer.weights_proj.weight",
];

/// How the export stores a tensor: the router's `e_score_correction_bias` in f32 (as the
/// official checkpoints, bf16 and FP8 alike), under FP8 the projection matrices quantized, and
/// everything else (embeddings, norms, biases, the tensors above) in bf16.
pub fn stored_as(name: &str, role: TensorRole, dtype: ExportDtype) -> Stored {
    if name.ends_with(".e_score_correction_bias") {
        return Stored::F32;
    }
    match dtype {
        ExportDtype::Fp8 { .. }
            if role == TensorRole::Projection
                && name.ends_with(".weight")
                && !KEPT_OUT_OF_FP8.iter().any(|k| name.ends_with(k)) =>
        {
            Stored::Fp8
        }
        _ => Stored::Bf16,
    }
}

/// One tensor as it will be written.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    pub shape: Vec<usize>,
    pub stored: Stored,
}

impl Entry {
    /// Rows and columns of the tensor viewed as a matrix (a vector is one column).
    pub fn matrix(&self) -> (usize, usize) {
        let rows = self.shape.first().copied().unwrap_or(1);
        (rows, self.shape.iter().skip(1).product::<usize>().max(1))
    }

    /// The shape of its scale tensor under FP8 blocks of `block`.
    pub fn scale_shape(&self, block: [usize; 2]) -> Vec<usize> {
        let (rows, cols) = self.matrix();
        vec![rows.div_ceil(block[0]), cols.div_ceil(block[1])]
    }

    fn bytes(&self, block: [usize; 2]) -> u64 {
        let n = self.shape.iter().product::<usize>() as u64;
        match self.stored {
            Stored::Bf16 => 2 * n,
            Stored::F32 => 4 * n,
            Stored::Fp8 => n + 4 * self.scale_shape(block).iter().product::<usize>() as u64,
        }
    }
}

/// The name of an FP8 weight's scale tensor.
pub fn scale_name(name: &str) -> String {
    format!("{name}_scale_inv")
}

/// Every tensor of the layout in checkpoint order: the embedding, the layers in numeric order
/// (expert 10 after expert 9), then the LM head and the final norm.
pub fn entries(layout: &Layout, dtype: ExportDtype) -> Vec<Entry> {
    let catalog = Catalog::new(layout);
    let mut entries: Vec<Entry> = catalog
        .iter()
        .map(|(name, spec)| Entry {
            name: name.clone(),
            shape: spec.shape.clone(),
            stored: stored_as(name, spec.role, dtype),
        })
        .collect();
    entries.sort_by_cached_key(|e| order_key(&e.name));
    entries
}

/// Sorts names by their dot-separated parts, numbers as numbers; the embedding first and what
/// follows the layers (`model.norm`, `lm_head`) last.
fn order_key(name: &str) -> (u8, Vec<(u64, String)>) {
    let group = if name.starts_with("model.embed_tokens.") {
        0
    } else if name.starts_with("model.layers.") {
        1
    } else {
        2
    };
    let parts = name
        .split('.')
        .map(|p| match p.parse::<u64>() {
            Ok(n) => (n, String::new()),
            Err(_) => (u64::MAX, p.to_string()),
        })
        .collect();
    (group, parts)
}

/// Splits entries into shards of about `shard_bytes` each, in order (a tensor larger than that
/// has a shard of its own); an FP8 weight shares its shard with its scales.
pub fn plan_shards(entries: &[Entry], dtype: ExportDtype, shard_bytes: u64) -> Vec<Vec<usize>> {
    let block = block_of(dtype);
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut filled = 0u64;
    for (i, e) in entries.iter().enumerate() {
        let bytes = e.bytes(block);
        match shards.last_mut() {
            Some(last) if filled + bytes <= shard_bytes => {
                last.push(i);
                filled += bytes;
            }
            _ => {
                shards.push(vec![i]);
                filled = bytes;
            }
        }
    }
    shards
}

fn block_of(dtype: ExportDtype) -> [usize; 2] {
    match dtype {
        ExportDtype::Fp8 { block } => block,
        ExportDtype::Bf16 => [128, 128],
    }
}

/// The file name of shard `i` (from 0) of `n`, as transformers names them.
pub fn shard_file(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

/// What [`export`] wrote.
#[derive(Debug, Clone)]
pub struct Exported {
    pub tensors: usize,
    /// Tensors stored as FP8 (each with a scale tensor beside it).
    pub fp8_tensors: usize,
    pub shards: usize,
    /// Bytes of tensor data (the index's `metadata.total_size`).
    pub total_bytes: u64,
    pub parameters: u64,
    pub seconds: f64,
}

/// Options of an export besides the layout.
#[derive(Debug, Clone, Copy)]
pub struct ExportOptions {
    pub seed: u64,
    pub dtype: ExportDtype,
    pub shard_bytes: u64,
}

/// Writes `layout`'s synthetic weights (seed `options.seed`) as an HF checkpoint in the new
/// directory `out` (an existing one must be empty), whole or not at all.
pub fn export(layout: &Layout, options: ExportOptions, out: &Path) -> Result<Exported> {
    let begin = Instant::now();
    let config = hf_config(layout, options.dtype)?;
    if options.shard_bytes == 0 {
        return Err(Error::invalid("the shard size must be at least 1 MiB"));
    }
    let entries = entries(layout, options.dtype);
    let shards = plan_shards(&entries, options.dtype, options.shard_bytes);
    let source = SyntheticWeights::new(layout, options.seed);
    let block = block_of(options.dtype);
    crate::fsutil::create_dir_atomic(out, |dir| {
        let text = serde_json::to_string_pretty(&config).expect("JSON values serialise");
        std::fs::write(dir.join("config.json"), text + "\n")
            .map_err(|e| Error::io(dir.join("config.json"), e))?;
        let mut weight_map = Map::new();
        let mut total = 0u64;
        for (i, members) in shards.iter().enumerate() {
            let file = shard_file(i, shards.len());
            let chosen: Vec<&Entry> = members.iter().map(|&m| &entries[m]).collect();
            total += write_shard(&dir.join(&file), &chosen, &source, block)?;
            for e in chosen {
                weight_map.insert(e.name.clone(), json!(file));
                if e.stored == Stored::Fp8 {
                    weight_map.insert(scale_name(&e.name), json!(file));
                }
            }
        }
        let index = json!({
            "metadata": {
                "total_size": total,
                "mladb_export": {
                    "layout": layout.name,
                    "seed": options.seed,
                    "dtype": options.dtype.name(),
                },
            },
            "weight_map": weight_map,
        });
        let index_path = dir.join("model.safetensors.index.json");
        let text = serde_json::to_string_pretty(&index).expect("JSON values serialise");
        std::fs::write(&index_path, text + "\n").map_err(|e| Error::io(&index_path, e))?;
        Ok(total)
    })
    .map(|total_bytes| Exported {
        tensors: entries.len(),
        fp8_tensors: entries.iter().filter(|e| e.stored == Stored::Fp8).count(),
        shards: shards.len(),
        total_bytes,
        parameters: entries
            .iter()
            .map(|e| e.shape.iter().product::<usize>() as u64)
            .sum(),
        seconds: begin.elapsed().as_secs_f64(),
    })
}

/// One stored tensor of a shard: its name, dtype, shape and where its bytes go.
struct Slot {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    begin: u64,
    end: u64,
}

/// Writes one shard: the safetensors header, then each tensor generated and encoded band by
/// band at its offset. Returns the bytes of tensor data.
fn write_shard(
    path: &Path,
    entries: &[&Entry],
    source: &SyntheticWeights,
    block: [usize; 2],
) -> Result<u64> {
    // Wider elements first, as the safetensors library lays them out, so every tensor starts
    // at a multiple of its element size.
    let mut items: Vec<(usize, &'static str, String, Vec<usize>, u64)> = Vec::new();
    for e in entries {
        let n = e.shape.iter().product::<usize>() as u64;
        match e.stored {
            Stored::Bf16 => items.push((2, "BF16", e.name.clone(), e.shape.clone(), 2 * n)),
            Stored::F32 => items.push((4, "F32", e.name.clone(), e.shape.clone(), 4 * n)),
            Stored::Fp8 => {
                let scales = e.scale_shape(block);
                let count = scales.iter().product::<usize>() as u64;
                items.push((4, "F32", scale_name(&e.name), scales, 4 * count));
                items.push((1, "F8_E4M3", e.name.clone(), e.shape.clone(), n));
            }
        }
    }
    items.sort_by_key(|item| std::cmp::Reverse(item.0));
    let mut slots = Vec::with_capacity(items.len());
    let mut offset = 0u64;
    for (_, dtype, name, shape, bytes) in items {
        slots.push(Slot {
            name,
            dtype,
            shape,
            begin: offset,
            end: offset + bytes,
        });
        offset += bytes;
    }
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    for s in &slots {
        header.insert(
            s.name.clone(),
            json!({"dtype": s.dtype, "shape": s.shape, "data_offsets": [s.begin, s.end]}),
        );
    }
    let mut header = serde_json::to_string(&Value::Object(header)).expect("JSON serialises");
    // The data starts 8-aligned, padded with spaces as the safetensors library pads.
    while !(8 + header.len()).is_multiple_of(8) {
        header.push(' ');
    }
    let data_start = 8 + header.len() as u64;
    let io = |e| Error::io(path, e);
    let file = std::fs::File::create(path).map_err(io)?;
    file.set_len(data_start + offset).map_err(io)?;
    file.write_all_at(&(header.len() as u64).to_le_bytes(), 0)
        .map_err(io)?;
    file.write_all_at(header.as_bytes(), 8).map_err(io)?;
    let at = |name: &str| {
        slots
            .iter()
            .find(|s| s.name == name)
            .map(|s| data_start + s.begin)
            .expect("every tensor has a slot")
    };
    for e in entries {
        let (rows, cols) = e.matrix();
        let write = |offset: u64, bytes: &[u8]| file.write_all_at(bytes, offset).map_err(io);
        match e.stored {
            Stored::Fp8 => {
                let base = at(&e.name);
                let mut scales =
                    Vec::with_capacity(rows.div_ceil(block[0]) * cols.div_ceil(block[1]));
                for start in (0..rows).step_by(block[0]) {
                    let n = block[0].min(rows - start);
                    let mut values = vec![0f32; n * cols];
                    source.read_rows(&e.name, start, &mut values)?;
                    let mut bytes = vec![0u8; n * cols];
                    scales.extend(fp8::quantize_band(&values, cols, block[1], &mut bytes));
                    write(base + (start * cols) as u64, &bytes)?;
                }
                let bytes: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
                write(at(&scale_name(&e.name)), &bytes)?;
            }
            Stored::Bf16 | Stored::F32 => {
                let base = at(&e.name);
                let size = if e.stored == Stored::F32 { 4 } else { 2 };
                let band = (BAND_VALUES / cols).max(1);
                for start in (0..rows).step_by(band) {
                    let n = band.min(rows - start);
                    let mut values = vec![0f32; n * cols];
                    source.read_rows(&e.name, start, &mut values)?;
                    let bytes = encode(&values, e.stored);
                    write(base + (start * cols * size) as u64, &bytes)?;
                }
            }
        }
    }
    Ok(offset)
}

/// Values generated and encoded at once outside FP8 bands (16 MiB of f32).
const BAND_VALUES: usize = 1 << 22;

/// Little-endian bytes of values stored as bf16 (rounded to nearest, ties to even) or f32.
fn encode(values: &[f32], stored: Stored) -> Vec<u8> {
    match stored {
        Stored::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        _ => {
            let mut out = vec![0u8; values.len() * 2];
            out.par_chunks_mut(2)
                .zip(values.par_iter())
                .for_each(|(o, v)| o.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes()));
            out
        }
    }
}

/// The values a tensor holds once stored and read back: what the loader must return.
pub fn stored_values(values: &[f32], cols: usize, stored: Stored, block_cols: usize) -> Vec<f32> {
    match stored {
        Stored::F32 => values.to_vec(),
        Stored::Bf16 => values
            .par_iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect(),
        Stored::Fp8 => {
            let mut bytes = vec![0u8; values.len()];
            let scales = fp8::quantize_band(values, cols, block_cols, &mut bytes);
            fp8::dequantize_band(&bytes, cols, block_cols, &scales)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_official_fp8_checkpoints_tensors_are_quantized_and_no_others() {
        let layout = Layout::resolve("glm5-tiny").unwrap();
        let fp8: Vec<String> = entries(&layout, ExportDtype::FP8)
            .into_iter()
            .filter(|e| e.stored == Stored::Fp8)
            .map(|e| e.name)
            .collect();
        let l = layout.num_layers - 1;
        for kept in [
            "model.embed_tokens.weight".to_string(),
            "lm_head.weight".into(),
            format!("model.layers.{l}.mlp.gate.weight"),
            format!("model.layers.{l}.self_attn.indexer.weights_proj.weight"),
            format!("model.layers.{l}.self_attn.kv_a_layernorm.weight"),
        ] {
            assert!(!fp8.contains(&kept), "{kept} stays bf16");
        }
        for quantized in [
            "model.layers.0.mlp.down_proj.weight".to_string(),
            format!("model.layers.{l}.self_attn.kv_a_proj_with_mqa.weight"),
            format!("model.layers.{l}.self_attn.indexer.wk.weight"),
            format!("model.layers.{l}.mlp.experts.0.up_proj.weight"),
            format!("model.layers.{l}.mlp.shared_experts.gate_proj.weight"),
        ] {
            assert!(fp8.contains(&quantized), "{quantized} is FP8");
        }
        let bias = format!("model.layers.{l}.mlp.gate.e_score_correction_bias");
        assert_eq!(
            stored_as(&bias, TensorRole::RouterBias, ExportDtype::Bf16),
            Stored::F32
        );
    }

    #[test]
    fn tensors_come_in_checkpoint_order_and_fill_shards_in_turn() {
        let layout = Layout::resolve("glm5-tiny").unwrap();
        let entries = entries(&layout, ExportDtype::Bf16);
        let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names[0], "model.embed_tokens.weight");
        assert_eq!(names[names.len() - 1], "model.norm.weight");
        assert_eq!(names[names.len() - 2], "lm_head.weight");
        let pos = |n: &str| names.iter().position(|x| *x == n).unwrap();
        assert!(
            pos("model.layers.1.mlp.experts.9.up_proj.weight")
                < pos("model.layers.1.mlp.experts.10.down_proj.weight")
        );
        let shards = plan_shards(&entries, ExportDtype::Bf16, 20_000);
        assert!(shards.len() > 2);
        let flat: Vec<usize> = shards.concat();
        assert_eq!(flat, (0..entries.len()).collect::<Vec<_>>());
        assert_eq!(shard_file(0, 3), "model-00001-of-00003.safetensors");
    }
}
