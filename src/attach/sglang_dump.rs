//! SGLang's dumper directories as import records. SGLang (0.5.23, `sglang/srt/debug_utils/
//! dumper.py`) run with `DUMPER_ENABLE=1 DUMPER_NON_INTRUSIVE_MODE=all` writes one `torch.save`
//! file per tensor, `DIR/EXP_NAME/step=S___rank=R___dump_index=I___name=NAME___....pt`, each a
//! dict `{"value": tensor, "meta": {...}}`. Its forward hooks name a module's output
//! `non_intrusive__MODULE.output` (`.output.0` for the first of several), and the forward
//! batch's `input_ids` and `positions` are dumped under those names at each step's start;
//! `step` counts forward passes.

use super::import::Record;
use super::pickle::Value;
use super::torch_file::TorchFile;
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One dump file, by its name's tags.
#[derive(Debug, Clone, PartialEq)]
pub struct DumpFile {
    step: u64,
    rank: u32,
    index: u64,
    name: String,
    path: PathBuf,
}

/// The prefix SGLang's non-intrusive dumper gives module tensors.
const MODULE_PREFIX: &str = "non_intrusive__";

/// The dump files of `dir` and its subdirectories (one per experiment), unordered; names
/// without the tags are skipped. Empty: `dir` is not a dumper directory.
pub fn dumper_files(dir: &Path) -> Result<Vec<DumpFile>> {
    let mut out = Vec::new();
    let mut dirs = vec![(dir.to_path_buf(), 0)];
    while let Some((d, depth)) = dirs.pop() {
        for entry in std::fs::read_dir(&d).map_err(|e| Error::io(&d, e))? {
            let path = entry.map_err(|e| Error::io(&d, e))?.path();
            if path.is_dir() && depth == 0 {
                dirs.push((path, depth + 1));
            } else if let Some(f) = parse_name(&path) {
                out.push(f);
            }
        }
    }
    Ok(out)
}

/// `step=0___rank=1___dump_index=7___name=...___layer_id=3.pt` → its tags.
fn parse_name(path: &Path) -> Option<DumpFile> {
    let stem = path.file_name()?.to_str()?.strip_suffix(".pt")?;
    let mut tags = BTreeMap::new();
    for part in stem.split("___") {
        let (k, v) = part.split_once('=')?;
        tags.insert(k, v);
    }
    Some(DumpFile {
        step: tags.get("step")?.parse().ok()?,
        rank: tags.get("rank")?.parse().ok()?,
        index: tags.get("dump_index")?.parse().ok()?,
        name: tags.get("name")?.to_string(),
        path: path.to_path_buf(),
    })
}

/// Each rank's number and records, in rank order.
pub type RankRecords = Vec<(u32, Vec<Record>)>;

/// Every rank's records, rank by rank: a hello, then per step its tokens and its module
/// outputs in dump order. Tensors of other names (inputs, hand-placed dumps) are counted in
/// `skipped`.
pub fn records(dir: &Path, mut files: Vec<DumpFile>) -> Result<(RankRecords, usize)> {
    if files.is_empty() {
        return Err(Error::invalid(format!(
            "{}: no SGLang dumper files (step=S___rank=R___dump_index=I___name=N.pt)",
            dir.display()
        )));
    }
    files.sort_by_key(|f| (f.rank, f.step, f.index));
    let mut by_rank: BTreeMap<u32, Vec<DumpFile>> = BTreeMap::new();
    for f in files {
        by_rank.entry(f.rank).or_default().push(f);
    }
    let mut skipped = 0;
    let mut out = Vec::new();
    for (rank, files) in by_rank {
        let mut records = Vec::new();
        let mut hello = None;
        let mut steps: BTreeMap<u64, Vec<DumpFile>> = BTreeMap::new();
        for f in files {
            steps.entry(f.step).or_default().push(f);
        }
        for (step, files) in steps {
            let find = |name: &str| files.iter().find(|f| f.name == name);
            let (Some(ids), Some(pos)) = (find("input_ids"), find("positions")) else {
                return Err(Error::invalid(format!(
                    "{}: step {step} of rank {rank} has no input_ids and positions dumps: run SGLang with DUMPER_NON_INTRUSIVE_MODE=all",
                    dir.display()
                )));
            };
            let (tokens, meta) = read(&ids.path)?;
            let (positions, _) = read(&pos.path)?;
            if hello.is_none() {
                let (r, world) = rank_of(&meta).unwrap_or((rank, 1));
                hello = Some(Record::Hello {
                    engine: "sglang".into(),
                    model: String::new(),
                    rank: r,
                    world,
                });
                records.push(hello.clone().expect("just set"));
            }
            let ids = |t: &super::torch_file::TorchTensor| -> Vec<u32> {
                t.data.iter().map(|&v| v.max(0.0) as u32).collect()
            };
            records.push(Record::Step {
                step,
                tokens: ids(&tokens),
                positions: ids(&positions),
            });
            for f in &files {
                let Some(module) = module_of(&f.name) else {
                    if f.name != "input_ids" && f.name != "positions" {
                        skipped += 1;
                    }
                    continue;
                };
                let (t, _) = read(&f.path)?;
                records.push(Record::Tensor {
                    module: module.to_string(),
                    low_precision: matches!(t.storage.as_str(), "BFloat16Storage" | "HalfStorage"),
                    shape: t.shape,
                    data: t.data,
                    ptr: None,
                    kernel_out_ptr: None,
                });
            }
        }
        out.push((rank, records));
    }
    Ok((out, skipped))
}

/// `non_intrusive__model.layers.0.mlp.output` → `model.layers.0.mlp` (`.output.0` too: the
/// first tensor, as the hook takes it); other names are not module outputs.
fn module_of(name: &str) -> Option<&str> {
    let rest = name.strip_prefix(MODULE_PREFIX)?;
    rest.strip_suffix(".output")
        .or_else(|| rest.strip_suffix(".output.0"))
}

/// A dump file's tensor and its meta dict.
fn read(path: &Path) -> Result<(super::torch_file::TorchTensor, Value)> {
    let mut file = TorchFile::open(path)?;
    let root = std::mem::replace(&mut file.root, Value::None);
    let value = root.get("value").ok_or_else(|| {
        Error::parse(path, "no \"value\" in the dump (not an SGLang dumper file)")
    })?;
    let tensor = file.tensor(value)?;
    Ok((tensor, root.get("meta").cloned().unwrap_or(Value::None)))
}

/// The tensor-parallel rank and size a dump's meta names (SGLang's parallel info), else its
/// world rank and size.
fn rank_of(meta: &Value) -> Option<(u32, u32)> {
    let int = |v: Option<&Value>| {
        v.and_then(Value::as_int)
            .and_then(|i| u32::try_from(i).ok())
    };
    if let Some(info) = meta.get("sglang_parallel_info") {
        if let (Some(r), Some(n)) = (int(info.get("tp_rank")), int(info.get("tp_size"))) {
            return Some((r, n));
        }
    }
    Some((int(meta.get("world_rank"))?, int(meta.get("world_size"))?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_give_their_tags() {
        let f = parse_name(Path::new(
            "/d/exp/step=2___rank=1___dump_index=17___name=non_intrusive__model.layers.0.self_attn.output___recompute_status=disabled___layer_id=0.pt",
        ))
        .unwrap();
        assert_eq!((f.step, f.rank, f.index), (2, 1, 17));
        assert_eq!(module_of(&f.name), Some("model.layers.0.self_attn"));
        assert_eq!(
            module_of("non_intrusive__model.layers.0.mlp.output.0"),
            Some("model.layers.0.mlp")
        );
        assert_eq!(
            module_of("non_intrusive__model.layers.0.mlp.inputs.0"),
            None
        );
        assert_eq!(module_of("layer_start__hidden_states"), None);
        assert!(parse_name(Path::new("notes.txt")).is_none());
        assert!(parse_name(Path::new("step=x___rank=0___dump_index=1___name=a.pt")).is_none());
    }
}
