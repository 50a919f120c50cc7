//! External dumps: a safetensors file of named activations from another engine (HF transformers
//! through tools/hf_dump.py, vLLM, SGLang, or mladb's own `--dump`), keyed `PHASE/NAME`, with a
//! name map from the other engine's names to mladb's op names, and metadata saying which run
//! made it (tokens, prefill, decode count), so that a run is never compared with a dump of other
//! tokens.

use super::compare::{compare_outputs, OpComparison};
use super::record::RunRecord;
use crate::engine::trace::{OpKind, Phase};
use crate::error::{Error, Result};
use safetensors::Dtype;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub use super::name_map::NameMap;

/// The metadata keys of a dump (safetensors `__metadata__`, every value a string), written by
/// `mladb run --dump`, `mladb replay --dump`, tools/hf_dump.py and tools/make_hf_fixtures.py.
pub mod meta_key {
    /// The version of this set of keys ([`super::DUMP_FORMAT`]); a dump without it predates
    /// the metadata.
    pub const FORMAT: &str = "dump_format";
    /// The prompt token ids, a JSON array: `[3,141,59]`.
    pub const TOKENS: &str = "tokens";
    /// Prompt tokens prefilled at once (the rest went through decode one by one).
    pub const PREFILL: &str = "prefill";
    /// Greedy tokens generated after the prompt.
    pub const DECODE: &str = "decode";
    /// The generated token ids, a JSON array.
    pub const GENERATED: &str = "generated";
    /// The model: a layout and seed, or a checkpoint with its fingerprint.
    pub const MODEL: &str = "model";
    /// mladb's debugging flags, or the other engine's settings.
    pub const FLAGS: &str = "flags";
    /// What wrote the dump, with its version: `mladb 0.1.0`, `tools/hf_dump.py (transformers
    /// 5.17.0, ...)`. Dumps by mladb name their tensors with mladb's op names.
    pub const PRODUCER: &str = "producer";
    /// The precision the other engine's tensors were in (`bf16`, `f16`; absent: f32). A dump
    /// of a bf16 engine is judged by the bf16 tolerances whatever the checked run's dtype.
    pub const DTYPE: &str = "dtype";
}

/// The metadata format this build writes and reads.
pub const DUMP_FORMAT: u32 = 1;

/// What a dump says about the run that made it.
#[derive(Debug, Clone, PartialEq)]
pub struct DumpMeta {
    pub tokens: Vec<u32>,
    pub prefill: usize,
    pub decode: usize,
    pub generated: Vec<u32>,
    pub model: String,
    pub flags: String,
    pub producer: String,
    /// The other engine's precision, when not f32 (`bf16`, `f16`).
    pub dtype: Option<String>,
}

impl DumpMeta {
    /// What mladb writes into a dump it makes. A bf16 run's dump says so, so that a run checked
    /// against it is judged by bf16's tolerances whatever its own dtype (its values hold bf16's
    /// rounding, which an f32 run does not have).
    pub fn of_mladb(
        schedule: &crate::engine::generate::Schedule,
        generated: &[u32],
        model: String,
        flags: &crate::debug::flags::Flags,
    ) -> DumpMeta {
        DumpMeta {
            tokens: schedule.prompt.clone(),
            prefill: schedule.prefill_len,
            decode: schedule.decode_steps,
            generated: generated.to_vec(),
            model,
            flags: flags.to_string(),
            producer: format!("mladb {}", env!("CARGO_PKG_VERSION")),
            dtype: match flags.dtype {
                crate::engine::StorageDtype::F32 => None,
                low => Some(low.to_string()),
            },
        }
    }

    /// The dump's tensors were computed in bf16 or f16.
    pub fn low_precision(&self) -> bool {
        matches!(self.dtype.as_deref(), Some("bf16" | "f16"))
    }

    /// mladb wrote the dump: its tensors carry mladb's op names, no name map applies.
    pub fn by_mladb(&self) -> bool {
        self.producer.starts_with("mladb ")
    }

    /// The safetensors metadata map.
    pub fn to_map(&self) -> HashMap<String, String> {
        let list = |v: &[u32]| serde_json::to_string(v).expect("a token list serialises");
        [
            (meta_key::FORMAT, DUMP_FORMAT.to_string()),
            (meta_key::TOKENS, list(&self.tokens)),
            (meta_key::PREFILL, self.prefill.to_string()),
            (meta_key::DECODE, self.decode.to_string()),
            (meta_key::GENERATED, list(&self.generated)),
            (meta_key::MODEL, self.model.clone()),
            (meta_key::FLAGS, self.flags.clone()),
            (meta_key::PRODUCER, self.producer.clone()),
        ]
        .into_iter()
        .chain(self.dtype.clone().map(|d| (meta_key::DTYPE, d)))
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// Reads the metadata; `None` for a dump without it (made before it existed).
    pub fn from_map(
        map: &HashMap<String, String>,
    ) -> std::result::Result<Option<DumpMeta>, String> {
        let Some(format) = map.get(meta_key::FORMAT) else {
            return Ok(None);
        };
        match format.parse::<u32>() {
            Ok(DUMP_FORMAT) => {}
            _ => {
                return Err(format!(
                    "metadata {} is '{format}'; this mladb reads format {DUMP_FORMAT}",
                    meta_key::FORMAT
                ))
            }
        }
        let get = |key: &str| {
            map.get(key)
                .ok_or_else(|| format!("metadata {key} is missing"))
        };
        let number = |key: &str| {
            get(key)?
                .parse::<usize>()
                .map_err(|_| format!("metadata {key} is not a count: '{}'", map[key]))
        };
        let tokens = |key: &str| {
            serde_json::from_str::<Vec<u32>>(get(key)?)
                .map_err(|_| format!("metadata {key} is not a list of token ids: '{}'", map[key]))
        };
        let text = |key: &str| map.get(key).cloned().unwrap_or_default();
        let meta = DumpMeta {
            tokens: tokens(meta_key::TOKENS)?,
            prefill: number(meta_key::PREFILL)?,
            decode: number(meta_key::DECODE)?,
            generated: match map.get(meta_key::GENERATED) {
                Some(_) => tokens(meta_key::GENERATED)?,
                None => Vec::new(),
            },
            model: text(meta_key::MODEL),
            flags: text(meta_key::FLAGS),
            producer: text(meta_key::PRODUCER),
            dtype: map.get(meta_key::DTYPE).cloned(),
        };
        if let Some(d) = meta
            .dtype
            .as_deref()
            .filter(|d| !["f32", "bf16", "f16"].contains(d))
        {
            return Err(format!(
                "metadata {} is '{d}'; it is f32, bf16 or f16",
                meta_key::DTYPE
            ));
        }
        if meta.tokens.is_empty() || meta.prefill > meta.tokens.len() {
            return Err(format!(
                "metadata prefill {} does not fit its {} tokens",
                meta.prefill,
                meta.tokens.len()
            ));
        }
        Ok(Some(meta))
    }
}

/// The schedule a run compared with a dump has: what was given, the rest from the dump.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleArgs {
    pub tokens: Option<Vec<u32>>,
    pub prefill: Option<usize>,
    pub decode: Option<usize>,
}

/// `3,141,59`, the first 16 of a long list.
pub(crate) fn token_list(tokens: &[u32]) -> String {
    number_list(tokens, "tokens")
}

/// The first 16 of `values`, then how many there are, as `noun`.
pub(crate) fn number_list(values: &[u32], noun: &str) -> String {
    let shown: Vec<String> = values.iter().take(16).map(u32::to_string).collect();
    let more = if values.len() > 16 { ",…" } else { "" };
    format!("{}{more} ({} {noun})", shown.join(","), values.len())
}

/// A loaded dump: tensors by (phase, mladb op name), in f32.
pub struct ExternalDump {
    pub tensors: HashMap<(Phase, String), (Vec<usize>, Vec<f32>)>,
    /// Keys the map left out or that did not parse as PHASE/NAME.
    pub skipped: usize,
    /// Its values hold bf16 or f16 rounding, whatever its metadata says: some were stored in
    /// bf16 or f16, or they are a bf16 run's.
    pub low_precision_values: bool,
    /// What the dump says about its run; `None` for a dump without metadata.
    pub meta: Option<DumpMeta>,
    /// Where it was loaded from (none for a run's own outputs).
    pub path: Option<PathBuf>,
}

/// A run compared with a dump: the ops compared, and those the dump lacks.
#[derive(Debug, Clone)]
pub struct ReferenceComparison {
    /// Every op of the run the dump holds, in execution order.
    pub comparisons: Vec<OpComparison>,
    /// `PHASE/NAME` of the ops of the run the dump lacks, in execution order.
    pub not_compared: Vec<String>,
    /// Ops in the run.
    pub ops: usize,
    /// What the reader should know: a dump whose tokens could not be checked, other generated
    /// tokens.
    pub notes: Vec<String>,
}

impl ReferenceComparison {
    /// `compared 540 of 968 ops; 428 not compared (not in the dump): a, b, c, …`
    pub fn summary(&self) -> String {
        let mut s = format!("compared {} of {} ops", self.comparisons.len(), self.ops);
        if !self.not_compared.is_empty() {
            let first: Vec<&str> = self
                .not_compared
                .iter()
                .take(4)
                .map(String::as_str)
                .collect();
            s.push_str(&format!(
                "; {} not compared (not in the dump): {}{}",
                self.not_compared.len(),
                first.join(", "),
                if self.not_compared.len() > first.len() {
                    ", …"
                } else {
                    ""
                }
            ));
        }
        s
    }
}

/// A dump key `PHASE/NAME` as its phase and name.
fn phase_key(key: &str) -> Option<(Phase, &str)> {
    let (phase, name) = key.split_once('/')?;
    Some((phase.parse().ok()?, name))
}

/// Why a dump holds nothing to compare, said before any of its values is read: its keys are not
/// `PHASE/NAME`, are a session's `runN/PHASE/NAME` (what `replay --dump` writes), or name ops
/// the name map does not know.
fn nothing_to_compare(all: &[(String, &safetensors::tensor::TensorInfo)]) -> String {
    let first = all.first().map_or("none", |(k, _)| k.as_str());
    if let Some((k, _)) = all.iter().find(|(k, _)| phase_key(k).is_some()) {
        return format!(
            "the name map turns none of its PHASE/NAME tensors into an op (first: {k}); give \
             --name-map for another engine's names"
        );
    }
    let in_a_run = |k: &str| {
        k.strip_prefix("run")
            .and_then(|rest| rest.split_once('/'))
            .is_some_and(|(n, rest)| n.parse::<usize>().is_ok() && phase_key(rest).is_some())
    };
    if all.iter().any(|(k, _)| in_a_run(k)) {
        return format!(
            "its keys are a session's runN/PHASE/NAME (first: {first}), as `mladb replay --dump` \
             writes them; a reference is one run's ops as PHASE/NAME, as `mladb run --dump` \
             writes them"
        );
    }
    format!("no PHASE/NAME tensors (expected keys like prefill/logits; first: {first})")
}

impl ExternalDump {
    /// A `--reference` dump as the front ends take it: `map_name` is `--name-map` (a built-in
    /// map's name or a map file; by default the map the dump's metadata implies), `limit_gb`
    /// `--max-memory-gb` (see [`ExternalDump::load`]).
    pub fn load_reference(
        path: &Path,
        map_name: Option<&str>,
        limit_gb: Option<f64>,
    ) -> Result<ExternalDump> {
        let map = map_name.map(NameMap::resolve).transpose()?;
        ExternalDump::load(path, map.as_ref(), limit_gb)
    }

    /// Loads a dump. `map` turns its names into mladb's; `None` takes none for mladb's own dumps
    /// (their metadata says so) and the HF map for others. The values kept, as f32, must fit in
    /// `limit_gb` (`--max-memory-gb`; by default the memory available), or nothing is read.
    pub fn load(path: &Path, map: Option<&NameMap>, limit_gb: Option<f64>) -> Result<ExternalDump> {
        let reader = crate::tensor_file::TensorReader::open(path, u64::MAX)?;
        let meta = match reader.metadata() {
            Some(m) => DumpMeta::from_map(m).map_err(|e| Error::parse(path, e))?,
            None => None,
        };
        let default_map = match &meta {
            Some(m) if m.by_mladb() => NameMap::identity(),
            _ => NameMap::hf(),
        };
        let map = map.unwrap_or(&default_map);
        // The `PHASE/NAME` keys whose name the map knows, as mladb's ops; the rest are skipped.
        let all = reader.tensors();
        let mut keys: HashMap<String, (Phase, String)> = all
            .iter()
            .filter_map(|(k, _)| {
                let (phase, name) = phase_key(k)?;
                Some((k.clone(), (phase, map.map(name)?)))
            })
            .collect();
        if keys.is_empty() {
            return Err(Error::parse(path, nothing_to_compare(&all)));
        }
        // Refused before any value is read: the kept tensors' values, as f32, must fit.
        let need = all
            .iter()
            .filter(|(k, _)| keys.contains_key(k))
            .map(|(_, info)| {
                4 * crate::debug::sample::numel(&info.shape).unwrap_or(usize::MAX) as u128
            })
            .sum::<u128>();
        if let Some((limit, source)) = crate::memory::limit(limit_gb)? {
            if need > limit {
                return Err(Error::Allocation {
                    what: crate::memory::size_text(need),
                    detail: format!(
                        "the values of {} as f32 need more than the limit of {} ({source})",
                        path.display(),
                        crate::memory::size_text(limit)
                    ),
                });
            }
        }
        let skipped = all.len() - keys.len();
        let (read, _) = reader.read_f32(|k, _| keys.contains_key(k))?;
        // Values stored in bf16 or f16 carry that rounding, whatever the metadata says.
        let low_precision_values = read
            .iter()
            .any(|t| matches!(t.stored, Dtype::BF16 | Dtype::F16));
        let mut tensors = HashMap::new();
        for t in read {
            if let Some(k) = keys.remove(&t.name) {
                tensors.insert(k, (t.shape, t.values));
            }
        }
        Ok(ExternalDump {
            tensors,
            skipped,
            meta,
            low_precision_values,
            path: Some(path.to_path_buf()),
        })
    }

    /// The bytes its values hold (f32), which a run against it holds beside its own.
    pub fn value_bytes(&self) -> u128 {
        self.tensors
            .values()
            .map(|(_, v)| 4 * v.len() as u128)
            .sum()
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
            meta: None,
            low_precision_values: run.flags.dtype != crate::engine::StorageDtype::F32,
            path: None,
        }
    }

    /// The dump as a run beside `run`: each op of `run` the dump holds with as many values, in
    /// `run`'s order and shapes, with the dump's values (the Compare pane's and the tree's
    /// other side). Its dtype is bf16 when the dump's engine computed in bf16 or f16, so that
    /// it is judged by those tolerances.
    pub fn aligned(&self, run: &RunRecord) -> RunRecord {
        let mut flags = run.flags;
        flags.dtype = self.dtype();
        let mut out = RunRecord::new(flags);
        for e in &run.events {
            let Some((_, data)) = self.tensors.get(&(e.phase, e.name.clone())) else {
                continue;
            };
            if data.len() != e.shape.iter().product::<usize>() {
                continue;
            }
            out.push(
                e.clone(),
                std::sync::Arc::new(crate::tensor::Tensor::from_vec(&e.shape, data.clone())),
            );
        }
        out
    }

    /// How the dump's engine stored its values: bf16 for a bf16 or f16 engine (or values stored
    /// so), else f32.
    fn dtype(&self) -> crate::engine::StorageDtype {
        use crate::engine::StorageDtype;
        if self.low_precision_values || self.meta.as_ref().is_some_and(DumpMeta::low_precision) {
            StorageDtype::Bf16
        } else {
            StorageDtype::F32
        }
    }

    /// `mladb import` made the dump from another engine's recordings.
    fn imported(&self) -> bool {
        self.meta
            .as_ref()
            .is_some_and(|m| m.by_mladb() && m.producer.contains(" import "))
    }

    /// The tolerances to judge this dump by: the run's, or the bf16 table when the dump's
    /// engine computed in bf16 or f16 and the run's table is f32's (its noise is bf16's).
    pub fn tolerances(&self, run: super::tolerance::Tolerances) -> super::tolerance::Tolerances {
        use super::tolerance::Tolerances;
        match run {
            Tolerances::Table(dtype) => Tolerances::table_for(dtype, self.dtype()),
            t => t,
        }
    }

    /// The schedule to run against this dump: the given values, and the dump's where none is
    /// given. A given value other than the dump's is an error naming both (a run of other tokens
    /// compares nothing that means anything). Without metadata the given values pass unchecked.
    pub fn schedule_for(&self, given: ScheduleArgs) -> Result<ScheduleArgs> {
        let Some(m) = &self.meta else {
            return Ok(given);
        };
        if let Some(t) = &given.tokens {
            if *t != m.tokens {
                return Err(Error::invalid(format!(
                    "--tokens {} differ from the tokens of the reference dump: {} (leave --tokens out to use the dump's)",
                    token_list(t),
                    token_list(&m.tokens)
                )));
            }
        }
        if let Some(p) = given.prefill.filter(|&p| p != m.prefill) {
            return Err(Error::invalid(format!(
                "--prefill {p} differs from the reference dump's prefill {} (leave --prefill out to use the dump's)",
                m.prefill
            )));
        }
        if let Some(d) = given.decode.filter(|&d| d != m.decode) {
            return Err(Error::invalid(format!(
                "--decode {d} differs from the reference dump's decode count {} (leave --decode out to use the dump's)",
                m.decode
            )));
        }
        // The reference's own generated tokens are fed as they are (teacher forcing), so that
        // one greedy choice made differently does not feed every later step other tokens.
        if m.generated.len() == m.decode && m.decode > 0 {
            let mut tokens = m.tokens.clone();
            tokens.extend(&m.generated);
            return Ok(ScheduleArgs {
                tokens: Some(tokens),
                prefill: Some(m.prefill),
                decode: Some(0),
            });
        }
        Ok(ScheduleArgs {
            tokens: Some(m.tokens.clone()),
            prefill: Some(given.prefill.unwrap_or(m.prefill)),
            decode: Some(given.decode.unwrap_or(m.decode)),
        })
    }

    /// Compares every op of `run` the dump holds, in execution order. Errors: the run's tokens
    /// are not the dump's (when the dump says which), an op's shape differs from the dump's
    /// (size-1 axes aside: engines drop batch axes differently), or no op is in the dump.
    pub fn compare(&self, run: &RunRecord, num_heads: usize) -> Result<ReferenceComparison> {
        if run.flags.tp > 1 {
            return Err(Error::invalid(format!(
                "a reference dump holds the whole model's tensors and a --tp {} run each rank's \
                 part: check --tp compares the ranks with one rank (tp-mismatch); compare the \
                 one-rank run (no --tp) with the dump",
                run.flags.tp
            )));
        }
        let mut notes = Vec::new();
        match (&self.meta, &run.outcome) {
            (Some(m), Some(o)) => {
                let fed = &o.tokens[..o.tokens.len() - o.generated.len()];
                let forced: Vec<u32> = m.tokens.iter().chain(&m.generated).copied().collect();
                let fed_generated = o.generated.is_empty()
                    && m.decode > 0
                    && m.generated.len() == m.decode
                    && fed == forced;
                if fed_generated {
                    notes.push(format!(
                        "reference: the run was fed the dump's {} generated tokens {:?}",
                        m.generated.len(),
                        m.generated
                    ));
                } else if fed != m.tokens || o.generated.len() != m.decode {
                    return Err(Error::invalid(format!(
                        "the run's tokens {} (decode {}) are not the reference dump's {} (decode {})",
                        token_list(fed),
                        o.generated.len(),
                        token_list(&m.tokens),
                        m.decode
                    )));
                }
                if !fed_generated && !m.generated.is_empty() && m.generated != o.generated {
                    notes.push(format!(
                        "reference: the run generated {:?}, the dump's run {:?}: decode steps after the first difference were fed other tokens",
                        o.generated, m.generated
                    ));
                }
            }
            (None, _) if self.path.is_some() => notes.push(
                "reference: the dump has no metadata (an older tool made it): its tokens could not be checked, only its shapes".to_string(),
            ),
            _ => {}
        }
        let mut comparisons = Vec::new();
        let mut not_compared = Vec::new();
        for (i, e) in run.events.iter().enumerate() {
            let Some((shape, data)) = self.tensors.get(&(e.phase, e.name.clone())) else {
                not_compared.push(e.dump_name());
                continue;
            };
            // An import keeps the engine's shapes, which may split the same values otherwise
            // ([T, H·D] for mladb's [T, H, D]): there the values in order are what compare.
            let numel = |s: &[usize]| s.iter().product::<usize>();
            let reshaped = self.imported() && numel(shape) == numel(&e.shape);
            // An expert's rows are the tokens routed to it: a dump whose run routed otherwise
            // holds other rows, and the router's choice (compared as a choice) says so.
            if e.kind == OpKind::Expert && shape != &e.shape {
                not_compared.push(e.dump_name());
                continue;
            }
            if squeezed(shape) != squeezed(&e.shape) && !reshaped {
                return Err(Error::invalid(format!(
                    "{} {} has shape {:?} in this run and {:?} in the reference dump{}",
                    e.phase,
                    e.name,
                    e.shape,
                    shape,
                    if self.meta.is_none() {
                        " (the dump has no metadata: give the --tokens, --prefill and --decode it was made with)"
                    } else {
                        ""
                    }
                )));
            }
            comparisons.push(compare_outputs(
                e,
                i,
                run.outputs[i].data(),
                shape,
                data,
                num_heads,
            ));
        }
        if comparisons.is_empty() {
            return Err(Error::invalid(
                "the reference dump holds no op of this run (check the phases, names and name map)",
            ));
        }
        Ok(ReferenceComparison {
            comparisons,
            not_compared,
            ops: run.len(),
            notes,
        })
    }
}

/// A shape without its size-1 axes.
fn squeezed(shape: &[usize]) -> Vec<usize> {
    shape.iter().copied().filter(|&n| n != 1).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dump_metadata_round_trips_and_bad_values_are_named() {
        let meta = DumpMeta {
            tokens: vec![3, 141, 59],
            prefill: 2,
            decode: 1,
            generated: vec![7],
            model: "layout glm5-tiny, seed 0".into(),
            flags: "inject none".into(),
            producer: "mladb 0.1.0".into(),
            dtype: Some("bf16".into()),
        };
        let map = meta.to_map();
        assert_eq!(map[meta_key::TOKENS], "[3,141,59]");
        assert_eq!(DumpMeta::from_map(&map), Ok(Some(meta)));
        assert_eq!(DumpMeta::from_map(&HashMap::new()), Ok(None));
        let broken = |key: &str, value: &str| {
            let mut m = map.clone();
            m.insert(key.to_string(), value.to_string());
            DumpMeta::from_map(&m).unwrap_err()
        };
        assert!(broken(meta_key::FORMAT, "2").contains("reads format 1"));
        assert!(broken(meta_key::TOKENS, "3,141").contains("metadata tokens"));
        assert!(broken(meta_key::PREFILL, "-1").contains("metadata prefill"));
        assert!(broken(meta_key::PREFILL, "4").contains("does not fit"));
        assert!(broken(meta_key::DTYPE, "fp8").contains("metadata dtype"));
    }
}
