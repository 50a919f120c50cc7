//! `mladb layout verify`: reads an exported checkpoint back through the loader and checks that
//! every tensor holds, bit for bit, what the export writes for that layout and seed. A shard
//! copied short, a scale rewritten, a tensor missing from the index or one too many: each is a
//! clear error naming the tensor, where a run would simply compute on the wrong weights.

use super::{entries, scale_name, stored_values, ExportDtype, Stored, BAND_VALUES};
use crate::error::{Error, Result};
use crate::model::hf_config::layout_from_config_file;
use crate::model::weights::safetensors::CheckpointWeights;
use crate::model::weights::synthetic::SyntheticWeights;
use crate::model::weights::WeightSource;
use rayon::prelude::*;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::Path;
use std::time::Instant;

/// What [`verify`] checked.
#[derive(Debug, Clone)]
pub struct Verified {
    pub layout: String,
    pub seed: u64,
    pub dtype: ExportDtype,
    pub tensors: usize,
    pub values: u64,
    pub seconds: f64,
}

/// The first difference in a band, and how many values differ there.
#[derive(Debug, Clone, Copy)]
struct Mismatch {
    row: usize,
    col: usize,
    got: f32,
    want: f32,
    count: u64,
}

/// Checks the checkpoint in `dir` against the synthetic weights of its own layout
/// (`config.json`) and `seed` (default: the seed the export recorded in the index).
pub fn verify(dir: &Path, seed: Option<u64>) -> Result<Verified> {
    let begin = Instant::now();
    let config_path = dir.join("config.json");
    let layout = layout_from_config_file(&config_path)?;
    let config = read_json(&config_path, crate::input::MAX_CONFIG_BYTES)?;
    let dtype = match config.pointer("/quantization_config/quant_method") {
        None => ExportDtype::Bf16,
        Some(m) if m == "fp8" => {
            let block = config
                .pointer("/quantization_config/weight_block_size")
                .and_then(|b| serde_json::from_value::<[usize; 2]>(b.clone()).ok())
                .unwrap_or([128, 128]);
            ExportDtype::Fp8 { block }
        }
        Some(m) => {
            return Err(Error::parse(
                &config_path,
                format!("quant_method {m}: an export is bf16 or fp8"),
            ))
        }
    };
    let index_path = dir.join("model.safetensors.index.json");
    let index = read_json(&index_path, crate::input::MAX_INDEX_BYTES)?;
    let seed = match seed {
        Some(s) => s,
        None => index
            .pointer("/metadata/mladb_export/seed")
            .and_then(Value::as_u64)
            .ok_or_else(|| {
                Error::parse(
                    &index_path,
                    "records no export seed (metadata.mladb_export.seed): give --seed",
                )
            })?,
    };
    let listed: BTreeSet<&str> = index
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| Error::parse(&index_path, "no `weight_map` object"))?
        .keys()
        .map(String::as_str)
        .collect();
    let expected = entries(&layout, dtype);
    let mut names: BTreeSet<String> = BTreeSet::new();
    for e in &expected {
        names.insert(e.name.clone());
        if e.stored == Stored::Fp8 {
            names.insert(scale_name(&e.name));
        }
    }
    if let Some(missing) = names.iter().find(|n| !listed.contains(n.as_str())) {
        return Err(Error::parse(
            &index_path,
            format!(
                "lacks {missing}, which a {} export of this layout holds",
                dtype.name()
            ),
        ));
    }
    if let Some(extra) = listed.iter().find(|n| !names.contains(**n)) {
        return Err(Error::parse(
            &index_path,
            format!(
                "lists {extra}, which a {} export of this layout does not hold",
                dtype.name()
            ),
        ));
    }
    let weights = CheckpointWeights::open(dir)?;
    let source = SyntheticWeights::new(&layout, seed);
    let block = match dtype {
        ExportDtype::Fp8 { block } => block,
        ExportDtype::Bf16 => [1, 1],
    };
    let mut values = 0u64;
    for e in &expected {
        let found = weights.shape(&e.name);
        if found.as_deref() != Some(&e.shape[..]) {
            return Err(Error::ShapeMismatch {
                name: e.name.clone(),
                source_desc: weights.describe(),
                expected: e.shape.clone(),
                found: found.unwrap_or_default(),
            });
        }
        weights.readable(&e.name)?;
        let (rows, cols) = e.matrix();
        let band = match e.stored {
            Stored::Fp8 => block[0],
            _ => (BAND_VALUES / cols).max(1),
        };
        let starts: Vec<usize> = (0..rows).step_by(band).collect();
        let found = starts
            .par_iter()
            .map(|&start| -> Result<Option<Mismatch>> {
                let n = band.min(rows - start);
                let mut made = vec![0f32; n * cols];
                source.read_rows(&e.name, start, &mut made)?;
                let want = stored_values(&made, cols, e.stored, block[1]);
                let mut got = vec![0f32; n * cols];
                weights.read_rows(&e.name, start, &mut got)?;
                Ok(first_difference(&got, &want, start, cols))
            })
            .collect::<Result<Vec<_>>>()?;
        let count: u64 = found.iter().flatten().map(|m| m.count).sum();
        if let Some(m) = found.into_iter().flatten().next() {
            let how = match (e.stored, dtype) {
                (Stored::Fp8, ExportDtype::Fp8 { block }) => format!(
                    "FP8 in blocks of {}×{} (scales in {})",
                    block[0],
                    block[1],
                    scale_name(&e.name)
                ),
                (Stored::F32, _) => "f32".into(),
                _ => "bf16".into(),
            };
            return Err(Error::invalid(format!(
                "{}: {} is not the synthetic weights of seed {seed} stored as {how}: {count} of {} values differ, the first at [{}, {}]: {:e} where {:e} was expected",
                dir.display(),
                e.name,
                rows * cols,
                m.row,
                m.col,
                m.got,
                m.want
            )));
        }
        values += (rows * cols) as u64;
    }
    Ok(Verified {
        layout: layout.name,
        seed,
        dtype,
        tensors: expected.len(),
        values,
        seconds: begin.elapsed().as_secs_f64(),
    })
}

/// The first position where two bands differ in their bits (NaN equal only to the same NaN),
/// with the number of differing values.
fn first_difference(got: &[f32], want: &[f32], start: usize, cols: usize) -> Option<Mismatch> {
    let mut first: Option<Mismatch> = None;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g.to_bits() != w.to_bits() {
            match first.as_mut() {
                Some(m) => m.count += 1,
                None => {
                    first = Some(Mismatch {
                        row: start + i / cols,
                        col: i % cols,
                        got: *g,
                        want: *w,
                        count: 1,
                    })
                }
            }
        }
    }
    first
}

fn read_json(path: &Path, cap: u64) -> Result<Value> {
    let text = crate::input::read_capped(path, cap)?;
    serde_json::from_slice(&text).map_err(|e| Error::parse(path, format!("not valid JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::super::{export, ExportOptions};
    use super::*;
    use crate::model::layout::Layout;

    fn exported(dtype: ExportDtype) -> (tempfile::TempDir, std::path::PathBuf) {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("ckpt");
        let layout = Layout::resolve("glm5-tiny").unwrap();
        let options = ExportOptions {
            seed: 5,
            dtype,
            shard_bytes: 1 << 20,
        };
        let done = export(&layout, options, &dir).unwrap();
        assert!(done.shards > 1, "{done:?}");
        (root, dir)
    }

    #[test]
    fn an_export_verifies_and_a_changed_byte_is_named() {
        let (_root, dir) = exported(ExportDtype::Fp8 { block: [16, 32] });
        let ok = verify(&dir, None).unwrap();
        assert_eq!(
            (ok.seed, ok.dtype),
            (5, ExportDtype::Fp8 { block: [16, 32] })
        );
        let e = verify(&dir, Some(6)).unwrap_err().to_string();
        assert!(e.contains("is not the synthetic weights of seed 6"), "{e}");
        // One scale set to 1.0, as a loader step that skipped the scales would leave it.
        let name = "model.layers.2.self_attn.kv_a_proj_with_mqa.weight";
        let index = read_json(&dir.join("model.safetensors.index.json"), 1 << 20).unwrap();
        let file = dir.join(index["weight_map"][scale_name(name)].as_str().unwrap());
        let mut bytes = std::fs::read(&file).unwrap();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
        let begin = header[scale_name(name)]["data_offsets"][0]
            .as_u64()
            .unwrap() as usize;
        bytes[8 + header_len + begin..][..4].copy_from_slice(&1f32.to_le_bytes());
        std::fs::write(&file, bytes).unwrap();
        let e = verify(&dir, None).unwrap_err().to_string();
        assert!(e.contains(name) && e.contains("the first at [0, 0]"), "{e}");
    }
}
