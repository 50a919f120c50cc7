//! The live comparison behind `mladb attach --layout/--model`: for each forward pass an engine
//! announces (a `step` frame: its token ids and positions), mladb runs its own reference on the
//! same tokens, then compares every tensor the engine sends, as it arrives, with mladb's op of
//! the same meaning: the engine's module name through the name map, tensor-parallel shards put
//! back together by the map's shard rule, each comparison judged by the tolerances `check`
//! uses (input errors carried op to op). It reports what it finds on the engine's process:
//! `reference-mismatch` at the first op of a step beyond its tolerance, naming the rank whose
//! shard holds the difference, and `buffer-disconnect` where an attention wrapper handed on a
//! buffer other than the one its kernel wrote.
//!
//! One sequence at a time: a step at position 0 starts a new one; a step whose positions do not
//! continue the sequence (several sequences batched, a chunked prefill) is reported and not
//! compared.

use super::sequence::{run_step, Sequence};
use super::shards::{assemble, columns, rank_part, Pending, Piece};
use super::wire::Dtype;

use crate::backend::Backend;
use crate::debug::compare::{compare_outputs, OpComparison};
use crate::debug::detect::{Finding, FindingKind};
use crate::debug::diff::diff;
use crate::debug::flags::Flags;
use crate::debug::name_map::{NameMap, Shard, Target};
use crate::debug::tolerance::{Judge, Tolerances};
use crate::engine::trace::{OpKind, Phase};
use crate::engine::StorageDtype;
use crate::model::Model;
use std::collections::HashMap;
use std::ops::Range;

pub(super) use super::events::Verdict;
pub use super::events::{Input, Live, Totals};

pub(super) struct Conn {
    engine: String,
    rank: u32,
    world: u32,
    map: NameMap,
    pub(super) step: Option<u64>,
    /// Times each module has sent a tensor in the current step.
    seen: HashMap<String, u32>,
}

pub(super) struct StepRun {
    pub(super) tokens: Vec<u32>,
    /// The position of the step's first token.
    pub(super) start: usize,
    /// mladb's events of this step, or why it was not run.
    pub(super) events: std::result::Result<Range<usize>, String>,
    pub(super) phase: Phase,
    /// The op of the step's finding: the earliest divergent op in mladb's order so far.
    pub(super) reported: Option<usize>,
    /// The sequence (the comparator's count) whose record `events` index.
    pub(super) sequence: usize,
    /// Layers whose choice (experts, kept keys) the engine made otherwise than mladb from
    /// numbers that agree within their tolerance, where mladb could not follow the engine's
    /// choice ([`Comparator::force_choice`]): (the layer, the index of mladb's choice op; 0 for
    /// a later layer that shares the choice).
    pub(super) flips: Vec<(usize, usize)>,
}

/// The comparison of one attachment (every rank of one engine).
pub struct Comparator<'m> {
    pub(super) model: &'m Model,
    pub(super) backend: &'m dyn Backend,
    pub(super) flags: Flags,
    pub(super) layers: Range<usize>,
    map: Option<NameMap>,
    tolerance: Option<f64>,
    pub(super) conns: HashMap<u64, Conn>,
    pub(super) seq: Option<Sequence<'m>>,
    /// The sequence before the current one, while a rank still sends tensors of its steps.
    pub(super) retired: Option<Sequence<'m>>,
    pub(super) steps: HashMap<u64, StepRun>,
    pending: Pending,
    pub totals: Totals,
    /// Sequences begun so far (each a run in the debugger's view).
    pub sequences: usize,
    /// Keep the engine's values beside mladb's run ([`Comparator::runs`]).
    pub keep_engine: bool,
    /// The memory a sequence's reference may need, in GB (`--max-memory-gb`; default: the
    /// memory available): a longer prefill is refused before anything is allocated for it.
    pub max_memory_gb: Option<f64>,
    /// The ranks that said hello, and the largest world size they gave.
    pub(super) ranks: std::collections::HashSet<u32>,
    pub(super) world: u32,
}

impl<'m> Comparator<'m> {
    /// `map`: the name map for every engine (default: the map of each connection's engine).
    pub fn new(
        model: &'m Model,
        backend: &'m dyn Backend,
        flags: Flags,
        layers: Range<usize>,
        map: Option<NameMap>,
        tolerance: Option<f64>,
    ) -> Comparator<'m> {
        Comparator {
            model,
            backend,
            flags,
            layers,
            map,
            tolerance,
            conns: HashMap::new(),
            seq: None,
            retired: None,
            steps: HashMap::new(),
            pending: Pending::default(),
            totals: Totals::default(),
            sequences: 0,
            keep_engine: false,
            max_memory_gb: None,
            ranks: Default::default(),
            world: 1,
        }
    }

    pub fn take(&mut self, input: Input) -> Vec<Live> {
        match input {
            Input::Hello {
                conn,
                engine,
                rank,
                world_size,
            } => {
                let map = self
                    .map
                    .clone()
                    .unwrap_or_else(|| NameMap::for_engine(&engine));
                self.ranks.insert(rank);
                self.world = self.world.max(world_size);
                self.conns.insert(
                    conn,
                    Conn {
                        engine,
                        rank,
                        world: world_size.max(1),
                        map,
                        step: None,
                        seen: HashMap::new(),
                    },
                );
                Vec::new()
            }
            Input::Step {
                conn,
                step,
                tokens,
                positions,
            } => self.step(conn, step, tokens, positions),
            Input::Tensor {
                conn,
                module,
                dtype,
                data,
                ptr,
                kernel_out_ptr,
                budget: _held,
            } => self.tensor(conn, &module, dtype, data, ptr, kernel_out_ptr),
            Input::Closed { conn } => {
                self.conns.remove(&conn);
                Vec::new()
            }
        }
    }

    /// Shards still waiting for ranks that never sent theirs.
    pub fn finish(&mut self) -> Vec<Live> {
        self.pending
            .drain()
            .into_iter()
            .map(|((step, module, op), ranks)| Live::Note {
                step: Some(step),
                rank: None,
                text: format!(
                    "{module} as {op}: only ranks {ranks:?} sent their shards; not compared"
                ),
            })
            .collect()
    }

    fn step(&mut self, conn: u64, step: u64, tokens: Vec<u32>, positions: Vec<u32>) -> Vec<Live> {
        let Some(c) = self.conns.get_mut(&conn) else {
            return Vec::new();
        };
        c.step = Some(step);
        c.seen.clear();
        let rank = c.rank;
        if let Some(run) = self.steps.get(&step) {
            // Another rank of a step mladb has run: it must have been fed the same tokens.
            if run.tokens != tokens {
                return vec![Live::Note {
                    step: Some(step),
                    rank: Some(rank),
                    text: format!(
                        "rank {rank} ran step {step} on other tokens than the rank before it ({} vs {} tokens)",
                        tokens.len(),
                        run.tokens.len()
                    ),
                }];
            }
            return Vec::new();
        }
        self.totals.steps += 1;
        self.release_done_steps();
        let (events, phase) = match self.run_reference(&tokens, &positions) {
            Ok((range, phase)) => (Ok(range), phase),
            Err(why) => (Err(why), Phase::Prefill),
        };
        let mut out = Vec::new();
        match &events {
            Ok(range) => out.push(Live::Reference {
                step,
                phase: phase.to_string(),
                tokens: tokens.len(),
                ops: range.len(),
            }),
            Err(why) => out.push(Live::Note {
                step: Some(step),
                rank: Some(rank),
                text: format!("step {step} is not compared: {why}"),
            }),
        }
        self.steps.insert(
            step,
            StepRun {
                start: positions.first().map_or(0, |&p| p as usize),
                tokens,
                events,
                phase,
                reported: None,
                flips: Vec::new(),
                sequence: self.sequences,
            },
        );
        out
    }

    /// Runs mladb's reference for one engine step; returns its events and phase.
    fn run_reference(
        &mut self,
        tokens: &[u32],
        positions: &[u32],
    ) -> std::result::Result<(Range<usize>, Phase), String> {
        let Some(&p0) = positions.first() else {
            return Err("the step holds no tokens".into());
        };
        if positions.len() != tokens.len()
            || positions
                .iter()
                .enumerate()
                .any(|(i, &p)| p as usize != p0 as usize + i)
        {
            return Err(format!(
                "its positions {} do not run on from {p0} (several sequences in one batch?); mladb compares one sequence at a time",
                crate::debug::external::token_list(positions)
            ));
        }
        let vocab = self.model.layout.vocab_size;
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(format!(
                "token {t} is outside the model's vocabulary of {vocab}"
            ));
        }
        if p0 == 0 {
            // A prompt of any length comes from the socket: one too long for memory is refused.
            crate::memory::check(self.model, tokens.len(), &self.layers, self.max_memory_gb)
                .map_err(|e| e.to_string())?;
            let engine = self.new_engine(Default::default())?;
            self.sequences += 1;
            let new = Sequence::new(engine, self.flags, self.sequences);
            let old = self.seq.replace(new);
            // A rank behind the others may still send the old sequence's tensors.
            self.retired = old.filter(|s| self.steps.values().any(|r| r.sequence == s.number));
        }
        let Some(seq) = self.seq.as_mut() else {
            return Err(format!(
                "it starts at position {p0}, and mladb saw no step at position 0"
            ));
        };
        if seq.engine.position() != p0 as usize {
            return Err(format!(
                "it starts at position {p0}; mladb's sequence is at {}",
                seq.engine.position()
            ));
        }
        let start = seq.record.len();
        if tokens.len() > 1 && p0 != 0 {
            return Err(format!(
                "{} tokens after position 0 (a chunked prefill) are not compared yet",
                tokens.len()
            ));
        }
        if let Err(e) = run_step(&mut seq.engine, tokens, &mut seq.record) {
            self.seq = None;
            return Err(format!("mladb's reference failed: {e}"));
        }
        seq.history.push(tokens.to_vec());
        let range = start..seq.record.len();
        let phase = seq
            .record
            .events
            .get(start)
            .map_or(Phase::Prefill, |e| e.phase);
        Ok((range, phase))
    }

    fn tensor(
        &mut self,
        conn: u64,
        module: &str,
        dtype: Dtype,
        data: Vec<f32>,
        ptr: Option<u64>,
        kernel_out_ptr: Option<u64>,
    ) -> Vec<Live> {
        let Some(c) = self.conns.get_mut(&conn) else {
            return Vec::new();
        };
        let (rank, world) = (c.rank, c.world);
        let Some(step) = c.step else {
            return vec![Live::Note {
                step: None,
                rank: Some(rank),
                text: format!("{module} came before any step; not compared"),
            }];
        };
        let occurrence = {
            let n = c.seen.entry(module.to_string()).or_insert(0);
            *n += 1;
            *n - 1
        };
        let targets = match c.map.targets(module, &self.model.layout) {
            Ok(t) => t,
            Err(e) => {
                return vec![Live::Note {
                    step: Some(step),
                    rank: Some(rank),
                    text: format!("{module}: {e}"),
                }]
            }
        };
        let mut out = Vec::new();
        if targets.is_empty() {
            self.totals.left_out += 1;
        }
        let Some(run) = self.steps.get(&step) else {
            return out;
        };
        let phase = run.phase;
        let rows = run.tokens.len();
        let comparable = run.events.is_ok();
        if let (Some(k), Some(p)) = (kernel_out_ptr, ptr) {
            if k != p {
                let engine = &self.conns[&conn].engine;
                let detail = format!(
                    "{engine} rank {rank}, {module}: the kernel wrote buffer @{k:#x}, the wrapper handed on @{p:#x}"
                );
                let op = targets.first().map_or(module.to_string(), |t| t.op.clone());
                let index = self.op_index(step, &op).unwrap_or(0);
                self.totals.findings += 1;
                out.push(Live::Finding {
                    step,
                    rank: Some(rank),
                    finding: Finding {
                        rank: None,
                        kind: FindingKind::BufferDisconnect,
                        phase,
                        op,
                        index,
                        detail,
                    },
                });
            }
        }
        if !comparable || occurrence > 0 {
            return out;
        }
        // The tensor moves into its last target's piece; the others take copies.
        let mut data = Some(data);
        let count = targets.len();
        for (i, target) in targets.into_iter().enumerate() {
            let data = if i + 1 == count {
                data.take().expect("moved once")
            } else {
                data.clone().expect("not moved yet")
            };
            let (target, data) = match rank_part(&target, world, rows, data) {
                Ok(p) => p,
                Err(e) => {
                    out.push(Live::Note {
                        step: Some(step),
                        rank: Some(rank),
                        text: format!("{module}: {e}"),
                    });
                    continue;
                }
            };
            let piece = Piece { rank, rows, data };
            if world == 1 || target.shard == Shard::Replicated {
                out.extend(self.compare(step, module, &target, vec![piece], Some(rank), dtype));
            } else {
                let key = (step, module.to_string(), target.op.clone());
                if let Some(pieces) = self.pending.add(key, piece, world) {
                    out.extend(self.compare(step, module, &target, pieces, None, dtype));
                }
            }
        }
        out
    }

    fn compare(
        &mut self,
        step: u64,
        module: &str,
        target: &Target,
        pieces: Vec<Piece>,
        rank: Option<u32>,
        dtype: Dtype,
    ) -> Vec<Live> {
        let note = |text: String| {
            vec![Live::Note {
                step: Some(step),
                rank,
                text,
            }]
        };
        let Some(index) = self.op_index(step, &target.op) else {
            self.totals.not_in_run.insert(target.op.clone());
            return Vec::new();
        };
        let whole = match assemble(target.shard, pieces) {
            Ok(w) => w,
            Err(e) => return note(format!("{module}: {e}")),
        };
        let (data, rank_columns) = match &target.columns {
            None => (whole.data, whole.rank_columns),
            Some(r) => match columns(&whole.data, whole.rows, r.clone()) {
                Ok(d) => {
                    let within = whole
                        .rank_columns
                        .iter()
                        .filter_map(|(k, c)| {
                            let (s, e) = (c.start.max(r.start), c.end.min(r.end));
                            (s < e).then(|| (*k, s - r.start..e - r.start))
                        })
                        .collect();
                    (d, within)
                }
                Err(e) => return note(format!("{module} as {}: {e}", target.op)),
            },
        };
        let tolerance = self.tolerance;
        let flags_dtype = self.flags.dtype;
        let (num_heads, keep_engine) = (self.model.layout.num_heads, self.keep_engine);
        let seq = self
            .seq_of_mut(step)
            .expect("a compared step has a sequence");
        let e = &seq.record.events[index];
        let reference = seq.record.outputs[index].data();
        if data.len() != reference.len() && e.kind != OpKind::IndexTopK {
            // The map says this is the op, and it has another size: nothing to pass.
            let detail = format!(
                "{} values where mladb's {:?} has {}",
                data.len(),
                e.shape,
                reference.len()
            );
            let phase = e.phase;
            return self.report(
                Verdict::at(step, phase, module, &target.op, index, rank).says(detail, true),
            );
        }
        if e.kind == OpKind::IndexTopK {
            return self.compare_choice(step, module, &target.op, index, &data, rank);
        }
        let mut c: OpComparison = compare_outputs(e, index, &data, &e.shape, reference, num_heads);
        if keep_engine && seq.seen.find(e.phase, &e.name).is_none() {
            let t = crate::tensor::Tensor::from_vec(&e.shape, data.clone());
            seq.seen.push(e.clone(), std::sync::Arc::new(t));
        }
        let judge = seq.judge.get_or_insert_with(|| {
            let engine = match dtype {
                Dtype::Bf16 | Dtype::F16 => StorageDtype::Bf16,
                _ => StorageDtype::F32,
            };
            Judge::new(match tolerance {
                Some(t) => Tolerances::Uniform(t),
                None => Tolerances::table_for(flags_dtype, engine),
            })
            .with_kv_cache(seq.record.flags.kv_cache)
        });
        if index >= seq.judged {
            for i in seq.judged..index {
                judge.next(&seq.record.events[i], None);
            }
            judge.next_of(&seq.record, index, Some(&mut c));
            seq.judged = index + 1;
        } else {
            judge.late_of(&seq.record, index, &mut c);
        }
        let diverges = c.diverges();
        let error = c.diff.as_ref().map_or(f64::NAN, |d| d.error());
        let worst_rank = rank_columns
            .iter()
            .map(|(k, cols)| {
                let a = columns(&data, whole.rows, cols.clone()).unwrap_or_default();
                let b = columns(reference, whole.rows, cols.clone()).unwrap_or_default();
                (*k, diff(&a, &b, &[a.len()], None).rel_l2)
            })
            .max_by(|x, y| x.1.total_cmp(&y.1));
        let detail = match &c.diff {
            Ok(d) => d.summary(),
            Err(e) => e.clone(),
        };
        let phase = e.phase;
        let mut notes = Vec::new();
        if target.op.ends_with(".mlp.gate") && !diverges {
            let at = (step, e.phase, module);
            notes.extend(self.selection_flip(at, &target.op, &data, whole.rows, c.tolerance));
        }
        if diverges {
            if let Some(layer) = self.explained_by_flip(step, index) {
                self.totals.compared += 1;
                self.totals.after_selection_flip += 1;
                notes.push(Live::Note {
                    step: Some(step),
                    rank,
                    text: format!(
                        "{} differs by {error:.3e} (tolerance {:.1e}) after the choice of layer {}, where the engine chose otherwise than mladb (a selection flip, not a finding)",
                        target.op,
                        c.tolerance,
                        crate::model::catalog::layer_prefix(layer)
                    ),
                });
                return notes;
            }
        }
        let who = match (rank, worst_rank) {
            (Some(r), _) => format!("rank {r}'s"),
            (None, Some((r, _))) if rank_columns.len() > 1 => {
                format!("the ranks' shards put together; rank {r}'s columns differ most")
            }
            _ => "the ranks' partial sums added".to_string(),
        };
        let blamed = rank.or(worst_rank.map(|w| w.0).filter(|_| rank_columns.len() > 1));
        let mut out = self.report(Verdict {
            step,
            phase,
            module,
            op: &target.op,
            index,
            rank,
            worst_rank,
            error,
            tolerance: c.tolerance,
            detail,
            diverges,
            who,
            blamed,
            tolerance_text: c.tolerance_text(),
        });
        out.extend(notes);
        out
    }

    /// The `compared` event of one comparison, and the step's finding when it is the first of
    /// the step to diverge.
    pub(super) fn report(&mut self, v: Verdict) -> Vec<Live> {
        let Verdict {
            step,
            phase,
            module,
            op,
            index,
            rank,
            worst_rank,
            error,
            tolerance,
            detail,
            diverges,
            who,
            blamed,
            tolerance_text,
        } = v;
        self.totals.compared += 1;
        let mut out = vec![Live::Compared {
            step,
            phase: phase.to_string(),
            module: module.to_string(),
            op: op.to_string(),
            rank,
            error,
            tolerance,
            diverges,
            worst_rank,
            detail: detail.clone(),
        }];
        if !diverges {
            return out;
        }
        self.totals.divergent += 1;
        let run = self.steps.get_mut(&step).expect("the step was run");
        // One finding per step, at its earliest divergent op: tensors that arrive out of
        // mladb's order (a dump replayed by name) may move it earlier, with a finding each time.
        if run.reported.is_none_or(|first| index < first) {
            run.reported = Some(index);
            self.totals.findings += 1;
            let wrap = |s: String| if s.is_empty() { s } else { format!(" ({s})") };
            out.push(Live::Finding {
                step,
                rank: blamed,
                finding: Finding {
                    rank: None,
                    kind: FindingKind::ReferenceMismatch,
                    phase,
                    op: op.to_string(),
                    index,
                    detail: format!(
                        "{module}{} against mladb: {detail}{}",
                        wrap(who),
                        wrap(tolerance_text)
                    ),
                },
            });
        }
        out
    }
}
