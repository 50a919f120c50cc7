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

pub use super::dump_meta::{meta_key, DumpMeta, DUMP_FORMAT};
pub use super::name_map::NameMap;

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
    /// Each op's tensor: of several that stand for it, the most specific (longest) name's.
    pub tensors: HashMap<(Phase, String), (Vec<usize>, Vec<f32>)>,
    /// Ops several of the dump's tensors stand for (HF's `self_attn` and `self_attn.o_proj`, the
    /// hook's `attn_kernel` and `o_proj.input`): the key `tensors` holds, then the others. Every
    /// one is compared with the run and the farthest reported, so that a dump whose names for an
    /// op disagree (a wrapper that handed on another buffer than its kernel wrote) is never
    /// passed through the name that agrees.
    pub aliases: HashMap<(Phase, String), (String, Vec<Alias>)>,
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

/// A tensor of a dump that stands for an op another of its tensors already stands for.
pub struct Alias {
    /// Its dump key, `PHASE/NAME` as the other engine named it.
    pub key: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

/// One of the dump's tensors for an op: its key (empty for an op held once), shape, values.
type Candidate<'a> = (&'a str, &'a [usize], &'a [f32]);

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

/// A dump key `PHASE/NAME` as its phase and name. `PHASE/NAME#OTHER` is another tensor for
/// the same name (`mladb import` writes a second module that stands for an op and differs from
/// the first so): its name is NAME's.
fn phase_key(key: &str) -> Option<(Phase, &str)> {
    let (phase, name) = key.split_once('/')?;
    let name = name.split_once('#').map_or(name, |(name, _)| name);
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
        // The most specific name first (o_proj rather than the attention module returning its
        // output, as `mladb import` keeps; a `NAME#OTHER` key after NAME): it is the op's
        // tensor, the others its aliases.
        let mut read = read;
        let order = |t: &crate::tensor_file::ReadTensor| {
            (t.name.contains('#'), std::cmp::Reverse(t.name.len()))
        };
        read.sort_by(|a, b| order(a).cmp(&order(b)).then(a.name.cmp(&b.name)));
        let mut tensors = HashMap::new();
        let mut first_keys = HashMap::new();
        let mut aliases: HashMap<(Phase, String), (String, Vec<Alias>)> = HashMap::new();
        for t in read {
            let Some(op) = keys.remove(&t.name) else {
                continue;
            };
            match first_keys.get(&op) {
                None => {
                    first_keys.insert(op.clone(), t.name);
                    tensors.insert(op, (t.shape, t.values));
                }
                Some(first) => aliases
                    .entry(op)
                    .or_insert_with(|| (String::clone(first), Vec::new()))
                    .1
                    .push(Alias {
                        key: t.name,
                        shape: t.shape,
                        values: t.values,
                    }),
            }
        }
        Ok(ExternalDump {
            tensors,
            aliases,
            skipped,
            meta,
            low_precision_values,
            path: Some(path.to_path_buf()),
        })
    }

    /// The bytes its values hold (f32), which a run against it holds beside its own.
    pub fn value_bytes(&self) -> u128 {
        let aliases = self.aliases.values().flat_map(|(_, a)| a.iter());
        self.tensors
            .values()
            .map(|(_, v)| v)
            .chain(aliases.map(|a| &a.values))
            .map(|v| 4 * v.len() as u128)
            .sum()
    }

    /// The dump's tensors for an op: the one [`ExternalDump::tensors`] holds, then its aliases.
    fn candidates(&self, phase: Phase, name: &str) -> Vec<Candidate<'_>> {
        let op = (phase, name.to_string());
        let Some((shape, values)) = self.tensors.get(&op) else {
            return Vec::new();
        };
        let mut out = vec![("", shape.as_slice(), values.as_slice())];
        if let Some((first, others)) = self.aliases.get(&op) {
            out[0].0 = first;
            out.extend(
                others
                    .iter()
                    .map(|a| (a.key.as_str(), a.shape.as_slice(), a.values.as_slice())),
            );
        }
        out
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
            aliases: HashMap::new(),
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
        for (i, e) in run.events.iter().enumerate() {
            let numel = e.shape.iter().product::<usize>();
            let fits: Vec<Candidate<'_>> = self
                .candidates(e.phase, &e.name)
                .into_iter()
                .filter(|(_, _, d)| d.len() == numel)
                .collect();
            // One tensor needs no comparison to be chosen.
            let chosen = match fits.len() {
                0 | 1 => fits.first().copied(),
                _ => farthest(e, i, run.outputs[i].data(), fits, 1).map(|(c, _)| c),
            };
            let Some((_, _, data)) = chosen else {
                continue;
            };
            out.push(
                e.clone(),
                std::sync::Arc::new(crate::tensor::Tensor::from_vec(&e.shape, data.to_vec())),
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
        let mut disagreeing = Vec::new();
        for (i, e) in run.events.iter().enumerate() {
            let mut candidates = Vec::new();
            for c @ (_, shape, _) in self.candidates(e.phase, &e.name) {
                // An import keeps the engine's shapes, which may split the same values otherwise
                // ([T, H·D] for mladb's [T, H, D]): there the values in order are what compare.
                let numel = |s: &[usize]| s.iter().product::<usize>();
                let reshaped = self.imported() && numel(shape) == numel(&e.shape);
                // An expert's rows are the tokens routed to it: a dump whose run routed otherwise
                // holds other rows, and the router's choice (compared as a choice) says so.
                if e.kind == OpKind::Expert && shape != e.shape.as_slice() {
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
                candidates.push(c);
            }
            disagreeing.extend(disagreement(e, &candidates));
            match farthest(e, i, run.outputs[i].data(), candidates, num_heads) {
                Some((_, c)) => comparisons.push(c),
                None => not_compared.push(e.dump_name()),
            }
        }
        if let Some(first) = disagreeing.first() {
            notes.push(format!(
                "reference: the dump holds differing tensors under several names for {} op{} \
                 (first: {first}); each was compared with this run and the farthest is reported",
                disagreeing.len(),
                if disagreeing.len() == 1 { "" } else { "s" }
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

/// Of the dump's tensors for op `e` (index `i`, output `ours`), the one farthest from `ours`,
/// with its comparison; the first (the most specific name) of equals.
fn farthest<'a>(
    e: &crate::engine::trace::OpEvent,
    i: usize,
    ours: &[f32],
    candidates: Vec<Candidate<'a>>,
    num_heads: usize,
) -> Option<(Candidate<'a>, OpComparison)> {
    let severity = |c: &OpComparison| c.diff.as_ref().map_or(-1.0, |d| d.severity());
    candidates
        .into_iter()
        .map(|c| (c, compare_outputs(e, i, ours, c.1, c.2, num_heads)))
        .reduce(|best, next| {
            if severity(&next.1) > severity(&best.1) {
                next
            } else {
                best
            }
        })
}

/// `prefill NAME: KEY and KEY differ (relative L2 …)` when the dump's tensors for op `e` are not
/// the same values: the engine that made it handed on something other than it computed.
fn disagreement(e: &crate::engine::trace::OpEvent, candidates: &[Candidate<'_>]) -> Option<String> {
    let ((first, _, a), rest) = candidates.split_first()?;
    rest.iter().find_map(|(key, _, b)| {
        let error = match a.len() == b.len() {
            true => super::diff::apart(b, a)?,
            false => f64::INFINITY,
        };
        Some(format!(
            "{} {}: {key} and {first} differ (relative L2 {error:.1e})",
            e.phase, e.name
        ))
    })
}

/// A shape without its size-1 axes.
fn squeezed(shape: &[usize]) -> Vec<usize> {
    shape.iter().copied().filter(|&n| n != 1).collect()
}
