//! `mladb import`'s core: another engine's recorded tensors (the hook's frame files, one per
//! rank, or an SGLang dumper directory) become one dump with mladb's op names and metadata, for
//! `check --reference` and `bisect --reference`. The same name maps and shard rules as the live
//! comparison apply: module names go through the map, tensor-parallel shards are put back
//! together, fused outputs are cut into their ops' columns. The steps are read as one sequence:
//! a prefill at position 0, then one token per decode step; a step that does not continue it
//! (another sequence, several in one batch, a chunked prefill) ends what is imported, with a
//! note.

use super::shards::{assemble, columns, Piece};
use crate::debug::external::DumpMeta;
use crate::debug::name_map::{NameMap, Shard, Target};
use crate::engine::trace::Phase;
use crate::error::{Error, Result};
use crate::model::layout::Layout;
use std::collections::{BTreeMap, HashMap, HashSet};

/// What a rank's recording says, in its order.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// Who recorded: the engine (picks the name map), its model, the rank and world size.
    Hello {
        engine: String,
        model: String,
        rank: u32,
        world: u32,
    },
    /// A forward pass begins.
    Step {
        step: u64,
        tokens: Vec<u32>,
        positions: Vec<u32>,
    },
    /// One module's output, in f32; `low_precision` when the engine held it in bf16 or f16.
    Tensor {
        module: String,
        shape: Vec<usize>,
        data: Vec<f32>,
        low_precision: bool,
        ptr: Option<u64>,
        kernel_out_ptr: Option<u64>,
    },
}

/// A tensor's shape and values.
type ShapedData = (Vec<usize>, Vec<f32>);

/// One imported tensor: `PHASE/OP`, its shape, its values.
pub struct Imported {
    pub key: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// What an import produced.
pub struct ImportOutcome {
    pub tensors: Vec<Imported>,
    pub meta: DumpMeta,
    /// What the reader should know: steps not imported, tensors left out, shards missing.
    pub notes: Vec<String>,
    /// Attention wrappers that handed on another buffer than their kernel wrote.
    pub disconnects: Vec<String>,
}

struct StepTokens {
    tokens: Vec<u32>,
    positions: Vec<u32>,
}

/// A tensor's pieces from the ranks, waiting to be put together.
struct Gathered {
    target: Target,
    shape: Vec<usize>,
    rows: usize,
    pieces: Vec<Piece>,
}

impl Gathered {
    /// A module's tensor whole: its ranks' pieces put together and its columns cut; `None`
    /// while a rank's piece is missing.
    fn whole(self, world: u32) -> std::result::Result<Option<ShapedData>, String> {
        let shard = self.target.shard;
        let single = world == 1 || shard == Shard::Replicated;
        if !single && self.pieces.len() < world as usize {
            return Ok(None);
        }
        let whole = assemble(shard, self.pieces)?;
        Ok(Some(match &self.target.columns {
            Some(range) => (
                vec![self.rows, range.len()],
                columns(&whole.data, whole.rows, range.clone())?,
            ),
            // One rank's tensor keeps the engine's shape; shards put together are rows of
            // features.
            None if single || shard == Shard::RowSum => (self.shape, whole.data),
            None => {
                let width = whole.data.len() / whole.rows.max(1);
                (vec![self.rows, width], whole.data)
            }
        }))
    }
}

/// Takes every rank's records; [`Importer::finish`] makes the dump.
pub struct Importer<'a> {
    layout: &'a Layout,
    map: Option<NameMap>,
    engine: Option<String>,
    model: String,
    world: Option<u32>,
    steps: BTreeMap<u64, StepTokens>,
    /// Per step and op, each module standing for it (a wrapper and its o_proj may both).
    gathered: BTreeMap<(u64, String), BTreeMap<String, Gathered>>,
    low_precision: bool,
    left_out: HashSet<String>,
    notes: Vec<String>,
    disconnects: Vec<String>,
    ranks: Vec<u32>,
}

/// One rank's place in its own records.
pub struct Cursor {
    rank: u32,
    map: NameMap,
    step: Option<u64>,
    seen: HashSet<String>,
    /// The rank's step numbers, to tell a recording of two ranks under one number apart.
    steps: HashMap<u64, ()>,
}

impl<'a> Importer<'a> {
    /// `map`: the name map for every rank (default: the map of the engine each hello names).
    pub fn new(layout: &'a Layout, map: Option<NameMap>) -> Importer<'a> {
        Importer {
            layout,
            map,
            engine: None,
            model: String::new(),
            world: None,
            steps: BTreeMap::new(),
            gathered: BTreeMap::new(),
            low_precision: false,
            left_out: HashSet::new(),
            notes: Vec::new(),
            disconnects: Vec::new(),
            ranks: Vec::new(),
        }
    }

    /// Takes one record of a rank's recording; `cursor` is that recording's (`None` until its
    /// hello). `source` names the recording in errors.
    pub fn take(
        &mut self,
        cursor: &mut Option<Cursor>,
        record: Record,
        source: &str,
    ) -> Result<()> {
        match record {
            Record::Hello {
                engine,
                model,
                rank,
                world,
            } => {
                let world = world.max(1);
                if *self.world.get_or_insert(world) != world {
                    return Err(Error::invalid(format!(
                        "{source}: rank {rank} says the world has {world} ranks, an earlier recording {}",
                        self.world.unwrap_or(0)
                    )));
                }
                if self.ranks.contains(&rank) {
                    return Err(Error::invalid(format!(
                        "{source}: rank {rank} was already imported from another recording"
                    )));
                }
                if rank >= world {
                    return Err(Error::invalid(format!(
                        "{source}: rank {rank} of a world of {world}"
                    )));
                }
                self.ranks.push(rank);
                let map = self
                    .map
                    .clone()
                    .unwrap_or_else(|| NameMap::for_engine(&engine));
                self.engine.get_or_insert(engine);
                if self.model.is_empty() {
                    self.model = model;
                }
                *cursor = Some(Cursor {
                    rank,
                    map,
                    step: None,
                    seen: HashSet::new(),
                    steps: HashMap::new(),
                });
            }
            Record::Step {
                step,
                tokens,
                positions,
            } => {
                let c = cursor.as_mut().ok_or_else(|| no_hello(source))?;
                if c.steps.insert(step, ()).is_some() {
                    return Err(Error::invalid(format!(
                        "{source}: step {step} comes twice in one recording"
                    )));
                }
                c.step = Some(step);
                c.seen.clear();
                match self.steps.get(&step) {
                    Some(s) if s.tokens != tokens || s.positions != positions => {
                        return Err(Error::invalid(format!(
                            "{source}: rank {} ran step {step} on other tokens than another rank",
                            c.rank
                        )))
                    }
                    Some(_) => {}
                    None => {
                        self.steps.insert(step, StepTokens { tokens, positions });
                    }
                }
            }
            Record::Tensor {
                module,
                shape,
                data,
                low_precision,
                ptr,
                kernel_out_ptr,
            } => {
                let c = cursor.as_mut().ok_or_else(|| no_hello(source))?;
                let Some(step) = c.step else {
                    self.notes
                        .push(format!("{source}: {module} came before any step; left out"));
                    return Ok(());
                };
                if let (Some(k), Some(p)) = (kernel_out_ptr, ptr) {
                    if k != p {
                        self.disconnects.push(format!(
                            "step {step}, rank {}, {module}: the kernel wrote buffer @{k:#x}, the wrapper handed on @{p:#x}",
                            c.rank
                        ));
                    }
                }
                // A module called twice in a step (a shared rotary embedding) is taken once.
                if !c.seen.insert(module.clone()) {
                    return Ok(());
                }
                self.low_precision |= low_precision;
                let targets = c
                    .map
                    .targets(&module, self.layout)
                    .map_err(|e| Error::invalid(format!("{source}: {module}: {e}")))?;
                if targets.is_empty() {
                    self.left_out.insert(module);
                    return Ok(());
                }
                let rows = self.steps.get(&step).map_or(1, |s| s.tokens.len()).max(1);
                let count = targets.len();
                let mut data = Some(data);
                for (i, target) in targets.into_iter().enumerate() {
                    let data = if i + 1 == count {
                        data.take().expect("moved once")
                    } else {
                        data.clone().expect("not moved yet")
                    };
                    let world = self.world.unwrap_or(1);
                    let (target, data) = super::shards::rank_part(&target, world, rows, data)
                        .map_err(|e| Error::invalid(format!("{source}: {module}: {e}")))?;
                    let g = self
                        .gathered
                        .entry((step, target.op.clone()))
                        .or_default()
                        .entry(module.clone())
                        .or_insert_with(|| Gathered {
                            target,
                            shape: shape.clone(),
                            rows,
                            pieces: Vec::new(),
                        });
                    g.pieces.push(Piece {
                        rank: c.rank,
                        rows,
                        data,
                    });
                }
            }
        }
        Ok(())
    }

    /// The dump: the sequence's steps with their phases, every op's shards put together.
    pub fn finish(mut self, source: &str) -> Result<ImportOutcome> {
        let world = self.world.unwrap_or(1);
        let phases = self.sequence();
        if phases.is_empty() {
            return Err(Error::invalid(format!(
                "{source}: no step at position 0 to import (the recordings hold {} steps)",
                self.steps.len()
            )));
        }
        let mut tensors = Vec::new();
        let mut incomplete = 0;
        for ((step, op), modules) in std::mem::take(&mut self.gathered) {
            let Some(phase) = phases.get(&step) else {
                continue;
            };
            let key = format!("{phase}/{op}");
            // The most specific module (the longest name: o_proj rather than the attention
            // module returning its output) goes into the dump as the op; the others must agree
            // with it, and one that does not goes in beside it as `KEY#MODULE`, so that the
            // check compares the run with both (a wrapper that handed on another tensor than
            // its last module computed is then found where it acts).
            let mut wholes = Vec::new();
            for (module, g) in modules {
                match g.whole(world) {
                    Ok(Some(t)) => wholes.push((module, t)),
                    Ok(None) => incomplete += 1,
                    Err(e) => return Err(Error::invalid(format!("{source}: {key}: {e}"))),
                }
            }
            wholes.sort_by_key(|(m, _)| std::cmp::Reverse(m.len()));
            let mut wholes = wholes.into_iter();
            let Some((kept, (shape, data))) = wholes.next() else {
                continue;
            };
            let mut differing = Vec::new();
            for (other, (other_shape, d)) in wholes {
                if d.len() != data.len() {
                    self.notes.push(format!(
                        "{key}: {other} and {kept} both stand for it and hold {} and {} values; the dump holds {kept}'s",
                        d.len(),
                        data.len()
                    ));
                } else if let Some(e) = crate::debug::diff::apart(&d, &data) {
                    self.notes.push(format!(
                        "{key}: {other} and {kept} both stand for it and differ (relative L2 {e:.2e}); the dump holds both ({kept}'s as the op, {key}#{other}), and check compares each"
                    ));
                    differing.push(Imported {
                        key: format!("{key}#{other}"),
                        shape: other_shape,
                        data: d,
                    });
                }
            }
            tensors.push(Imported { key, shape, data });
            tensors.extend(differing);
        }
        if incomplete > 0 {
            self.notes.push(format!(
                "{incomplete} sharded tensors lacked some of the {world} ranks' pieces and were left out (import every rank's recording)"
            ));
        }
        if !self.left_out.is_empty() {
            let mut names: Vec<&String> = self.left_out.iter().collect();
            names.sort();
            self.notes.push(format!(
                "{} modules have no mladb op in the name map and were left out: {}{}",
                names.len(),
                names
                    .iter()
                    .take(4)
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                if names.len() > 4 { ", …" } else { "" }
            ));
        }
        if tensors.is_empty() {
            return Err(Error::invalid(format!(
                "{source}: no tensor maps to an mladb op (check --name-map)"
            )));
        }
        let mut fed: Vec<u32> = Vec::new();
        let mut prefill = 0;
        for (step, phase) in &phases {
            let t = &self.steps[step].tokens;
            if *phase == Phase::Prefill {
                prefill = t.len();
            }
            fed.extend(t);
        }
        let engine = self.engine.clone().unwrap_or_else(|| "unknown".into());
        let meta = DumpMeta {
            tokens: fed,
            prefill,
            decode: 0,
            generated: Vec::new(),
            model: self.model.clone(),
            flags: format!(
                "{engine}, {world} rank{}",
                if world == 1 { "" } else { "s" }
            ),
            producer: format!(
                "mladb {} import ({engine} recordings)",
                env!("CARGO_PKG_VERSION")
            ),
            dtype: self.low_precision.then(|| "bf16".to_string()),
        };
        Ok(ImportOutcome {
            tensors,
            meta,
            notes: self.notes,
            disconnects: self.disconnects,
        })
    }

    /// The phase of each step of the first sequence: the step at position 0 is the prefill,
    /// each later step of one token at the next position a decode step. Notes say where the
    /// sequence ends early.
    fn sequence(&mut self) -> BTreeMap<u64, Phase> {
        let mut phases = BTreeMap::new();
        // Positions in u64: a recording's u32 positions near u32::MAX must not overflow the
        // sums below (a hostile or corrupt file).
        let mut next: Option<u64> = None;
        let mut decode = 0;
        for (&step, s) in &self.steps {
            let first = s.positions.first().map(|&p| u64::from(p));
            let runs_on = s.positions.len() == s.tokens.len()
                && s.positions
                    .iter()
                    .enumerate()
                    .all(|(i, &p)| Some(u64::from(p)) == first.map(|f| f + i as u64));
            let why = match (next, first) {
                (_, None) => Some("holds no tokens".to_string()),
                _ if !runs_on => Some(
                    "has positions that do not run on (several sequences in one batch?)".into(),
                ),
                (None, Some(0)) => None,
                (None, Some(p)) => Some(format!("starts at position {p}, not 0")),
                (Some(_), Some(0)) => Some("starts a new sequence".into()),
                (Some(n), Some(p)) if p != n => Some(format!("starts at {p}, not {n}")),
                (Some(_), Some(_)) if s.tokens.len() != 1 => Some(format!(
                    "feeds {} tokens after the prefill (a chunked prefill)",
                    s.tokens.len()
                )),
                _ => None,
            };
            if let Some(why) = why {
                if next.is_some() {
                    self.notes.push(format!(
                        "step {step} {why}; imported the steps before it, one sequence"
                    ));
                    break;
                }
                self.notes.push(format!("step {step} {why}; not imported"));
                continue;
            }
            let phase = if next.is_none() {
                Phase::Prefill
            } else {
                decode += 1;
                Phase::Decode(decode - 1)
            };
            phases.insert(step, phase);
            next = Some(first.unwrap_or(0) + s.tokens.len() as u64);
        }
        phases
    }
}

fn no_hello(source: &str) -> Error {
    Error::invalid(format!("{source}: a record before the recording's hello"))
}

#[cfg(test)]
#[path = "import_tests.rs"]
mod tests;
