//! HF checkpoint directories: `config.json` plus one or more memory-mapped `*.safetensors` files
//! (sharded through `model.safetensors.index.json` or not), with f32, f16 or bf16 weights.
//!
//! FP8 checkpoints (DeepSeek-V3's official format: `F8_E4M3` weights with a `weight_scale_inv`
//! per block of `quantization_config.weight_block_size`, 128×128 by default) are dequantized as
//! rows are read: w = fp8 · scale_inv[row / block_rows, col / block_cols].
//!
//! Routed experts may be stored one by one (`mlp.experts.E.gate_proj.weight`, the hub format) or
//! stacked (`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I], the
//! in-memory format of transformers 5); a per-expert name maps onto a row range of the stack.

use super::WeightSource;
use crate::error::{Error, Result};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One stored tensor: where its bytes are.
#[derive(Debug, Clone)]
struct Stored {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte range within the file.
    begin: usize,
    end: usize,
}

/// Where a canonical name's rows live: a stored tensor and a row offset into its matrix view.
#[derive(Debug, Clone)]
struct Resolved<'a> {
    stored: &'a Stored,
    first_row: usize,
    rows: usize,
    cols: usize,
}

pub struct CheckpointWeights {
    dir: PathBuf,
    files: Vec<(PathBuf, Mmap)>,
    tensors: HashMap<String, Stored>,
    /// Rows and columns sharing one FP8 scale.
    fp8_block: [usize; 2],
}

impl CheckpointWeights {
    pub fn open(dir: &Path) -> Result<CheckpointWeights> {
        if !dir.is_dir() {
            return Err(Error::invalid(format!(
                "{}: not a directory (expected an HF checkpoint with config.json and *.safetensors)",
                dir.display()
            )));
        }
        let shard_paths = shard_paths(dir)?;
        let mut files = Vec::new();
        let mut tensors = HashMap::new();
        for path in shard_paths {
            let file = crate::input::open_regular(&path)?;
            // SAFETY: the map is read-only; a file truncated while mladb runs can still fault,
            // which is the accepted cost of not copying hundreds of GB.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
            let (header_len, metadata) = SafeTensors::read_metadata(&mmap)
                .map_err(|e| Error::parse(&path, format!("not a valid safetensors file: {e}")))?;
            let data_start = 8 + header_len;
            add_tensors(&mut tensors, &metadata, files.len(), data_start, &path)?;
            files.push((path, mmap));
        }
        Ok(CheckpointWeights {
            dir: dir.to_path_buf(),
            files,
            tensors,
            fp8_block: fp8_block_size(dir)?,
        })
    }

    fn bytes_of(&self, stored: &Stored) -> (&Path, &[u8]) {
        let (path, mmap) = &self.files[stored.file];
        (path, &mmap[stored.begin..stored.end])
    }

    /// Dequantizes rows of an FP8 weight [out, in] with its block scales.
    fn read_fp8_rows(
        &self,
        name: &str,
        r: &Resolved,
        start_row: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let (path, bytes) = self.bytes_of(r.stored);
        let scale_name = format!("{}_scale_inv", name);
        let scales = self.tensors.get(&scale_name).ok_or_else(|| {
            Error::parse(
                path,
                format!("FP8 tensor {name} has no {scale_name} beside it"),
            )
        })?;
        let [bh, bw] = self.fp8_block;
        let (rows, cols) = (r.rows, r.cols);
        let expected = [rows.div_ceil(bh), cols.div_ceil(bw)];
        if r.first_row != 0 || scales.dtype != Dtype::F32 || scales.shape != expected {
            return Err(Error::parse(
                path,
                format!(
                    "{scale_name} is {:?} {:?}; an F32 tensor of shape {expected:?} was expected for blocks of {bh}×{bw}",
                    scales.dtype, scales.shape
                ),
            ));
        }
        let (_, scale_bytes) = self.bytes_of(scales);
        let scale = |i: usize| {
            let b = &scale_bytes[i * 4..i * 4 + 4];
            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        };
        for (k, row_out) in out.chunks_mut(cols).enumerate() {
            let row = start_row + k;
            let q = &bytes[row * cols..(row + 1) * cols];
            for (c, (o, &byte)) in row_out.iter_mut().zip(q).enumerate() {
                *o = fp8_e4m3_to_f32(byte) * scale((row / bh) * expected[1] + c / bw);
            }
        }
        Ok(())
    }

    /// Finds the rows of a canonical tensor name.
    fn resolve(&self, name: &str) -> Option<Resolved<'_>> {
        if let Some(stored) = self.tensors.get(name) {
            let rows = stored.shape.first().copied().unwrap_or(1);
            let cols = stored.shape.iter().skip(1).product::<usize>().max(1);
            return Some(Resolved {
                stored,
                first_row: 0,
                rows,
                cols,
            });
        }
        // model.layers.L.mlp.experts.E.PROJ.weight → a slice of the stacked tensor.
        let (prefix, rest) = name.split_once(".mlp.experts.")?;
        let (expert, proj) = rest.split_once('.')?;
        let expert: usize = expert.parse().ok()?;
        let proj = proj.strip_suffix(".weight")?;
        let (stack_name, part) = match proj {
            "gate_proj" => ("gate_up_proj", 0),
            "up_proj" => ("gate_up_proj", 1),
            "down_proj" => ("down_proj", 0),
            _ => return None,
        };
        let stored = self
            .tensors
            .get(&format!("{prefix}.mlp.experts.{stack_name}"))?;
        let [n_experts, rows, cols] = stored.shape[..] else {
            return None;
        };
        if expert >= n_experts {
            return None;
        }
        if stack_name == "gate_up_proj" {
            if rows % 2 != 0 {
                return None;
            }
            let half = rows / 2;
            Some(Resolved {
                stored,
                first_row: expert * rows + part * half,
                rows: half,
                cols,
            })
        } else {
            Some(Resolved {
                stored,
                first_row: expert * rows,
                rows,
                cols,
            })
        }
    }
}

/// The shard files: from the index when there is one, else model.safetensors, else every
/// `*.safetensors` in the folder.
fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = crate::input::read_capped(&index, crate::input::MAX_INDEX_BYTES)?;
        let value: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| Error::parse(&index, format!("not valid JSON: {e}")))?;
        let map = value
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::parse(&index, "no `weight_map` object"))?;
        let mut names: Vec<&str> = map
            .values()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| Error::parse(&index, "weight_map values must be file names"))
            })
            .collect::<Result<_>>()?;
        names.sort_unstable();
        names.dedup();
        return names
            .into_iter()
            .map(|n| {
                if n.contains('/') || n.contains('\\') || n == ".." {
                    return Err(Error::parse(
                        &index,
                        format!("shard name '{n}' must be a plain file name"),
                    ));
                }
                let p = dir.join(n);
                if p.exists() {
                    Ok(p)
                } else {
                    Err(Error::parse(
                        &index,
                        format!("lists shard {n}, which does not exist"),
                    ))
                }
            })
            .collect();
    }
    // The single-file layout: model.safetensors (other safetensors files beside it, such as
    // dumps, are not weights).
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    paths.sort();
    if paths.is_empty() {
        return Err(Error::invalid(format!(
            "{}: no *.safetensors files",
            dir.display()
        )));
    }
    Ok(paths)
}

fn add_tensors(
    tensors: &mut HashMap<String, Stored>,
    metadata: &Metadata,
    file: usize,
    data_start: usize,
    path: &Path,
) -> Result<()> {
    for (name, info) in metadata.tensors() {
        let (b, e) = info.data_offsets;
        let stored = Stored {
            file,
            dtype: info.dtype,
            shape: info.shape.clone(),
            begin: data_start + b,
            end: data_start + e,
        };
        if tensors.insert(name.clone(), stored).is_some() {
            return Err(Error::parse(
                path,
                format!("tensor {name} appears in more than one shard"),
            ));
        }
    }
    Ok(())
}

fn element_size(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::F32 => Some(4),
        Dtype::F16 | Dtype::BF16 => Some(2),
        Dtype::F8_E4M3 => Some(1),
        _ => None,
    }
}

/// The FP8 block size from `config.json`'s `quantization_config` ([128, 128] when absent).
fn fp8_block_size(dir: &Path) -> Result<[usize; 2]> {
    let path = dir.join("config.json");
    if !path.exists() {
        return Ok([128, 128]);
    }
    let text = crate::input::read_capped(&path, crate::input::MAX_CONFIG_BYTES)?;
    let value: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| Error::parse(&path, format!("not valid JSON: {e}")))?;
    let Some(block) = value.pointer("/quantization_config/weight_block_size") else {
        return Ok([128, 128]);
    };
    match block
        .as_array()
        .map(|a| a.iter().map(|v| v.as_u64()).collect::<Vec<_>>())
    {
        Some(v) if v.len() == 2 && v.iter().all(|x| matches!(x, Some(1..=65536))) => {
            Ok([v[0].unwrap() as usize, v[1].unwrap() as usize])
        }
        _ => Err(Error::parse(
            &path,
            "quantization_config.weight_block_size must be two sizes in 1..=65536",
        )),
    }
}

/// OCP FP8 E4M3 ("fn": no infinities; 0x7F and 0xFF are NaN): 1 sign, 4 exponent (bias 7),
/// 3 mantissa bits. Read through a table of all 256 values, made once: a full-size FP8 layer
/// decodes billions of them.
pub fn fp8_e4m3_to_f32(byte: u8) -> f32 {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| decode_e4m3(b as u8)))[byte as usize]
}

fn decode_e4m3(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((byte >> 3) & 0xF) as i32;
    let man = (byte & 0x7) as f32;
    if exp == 0xF && byte & 0x7 == 0x7 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

impl WeightSource for CheckpointWeights {
    fn describe(&self) -> String {
        self.dir.display().to_string()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let r = self.resolve(name)?;
        if r.first_row == 0 && self.tensors.contains_key(name) {
            return Some(r.stored.shape.clone());
        }
        Some(vec![r.rows, r.cols])
    }

    fn readable(&self, name: &str) -> Result<()> {
        match self.resolve(name) {
            Some(r) if element_size(r.stored.dtype).is_none() => Err(Error::parse(
                &self.files[r.stored.file].0,
                format!(
                    "tensor {name} is stored as {:?}; mladb reads F32, F16, BF16 and block-scaled F8_E4M3 checkpoints",
                    r.stored.dtype
                ),
            )),
            _ => Ok(()),
        }
    }

    fn read_rows(&self, name: &str, start_row: usize, out: &mut [f32]) -> Result<()> {
        let r = self.resolve(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            source_desc: self.describe(),
        })?;
        let (path, mmap) = &self.files[r.stored.file];
        let size = element_size(r.stored.dtype).ok_or_else(|| {
            Error::parse(
                path,
                format!(
                    "tensor {name} is stored as {:?}; mladb reads F32, F16, BF16 and block-scaled F8_E4M3 checkpoints",
                    r.stored.dtype
                ),
            )
        })?;
        let count_rows = out.len() / r.cols;
        if !out.len().is_multiple_of(r.cols) || start_row + count_rows > r.rows {
            return Err(Error::invalid(format!(
                "rows {start_row}..{} of {name} are out of range",
                start_row + count_rows
            )));
        }
        let begin = r.stored.begin + (r.first_row + start_row) * r.cols * size;
        let end = begin + out.len() * size;
        if end > r.stored.end {
            return Err(Error::parse(
                path,
                format!("tensor {name} is shorter than its shape"),
            ));
        }
        let bytes = &mmap[begin..end];
        if r.stored.dtype == Dtype::F8_E4M3 {
            return self.read_fp8_rows(name, &r, start_row, out);
        }
        match r.stored.dtype {
            Dtype::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Dtype::F16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            Dtype::BF16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            _ => unreachable!("element_size accepted only float types"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::fp8_e4m3_to_f32;

    #[test]
    fn fp8_decoding_matches_the_format() {
        // Values torch's float8_e4m3fn gives for these bytes.
        assert_eq!(fp8_e4m3_to_f32(0), 0.0);
        assert_eq!(fp8_e4m3_to_f32(56), 1.0);
        assert_eq!(fp8_e4m3_to_f32(194), -2.5);
        assert_eq!(fp8_e4m3_to_f32(126), 448.0);
        assert_eq!(fp8_e4m3_to_f32(1), 0.001953125);
        assert!(fp8_e4m3_to_f32(127).is_nan() && fp8_e4m3_to_f32(255).is_nan());
    }
}
