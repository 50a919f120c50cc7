//! HF checkpoint directories: `config.json` plus one or more memory-mapped `*.safetensors` files
//! (sharded through `model.safetensors.index.json` or not), with f32, f16 or bf16 weights.
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
use std::fs::File;
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
            let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
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
        })
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

/// The shard files: from the index when there is one, else every `*.safetensors` in the folder.
fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let value: serde_json::Value = serde_json::from_str(&text)
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
        _ => None,
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
                    "tensor {name} is stored as {:?}; mladb reads F32, F16 and BF16 checkpoints",
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
