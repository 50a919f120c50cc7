//! How far two runs of a correct model may differ at an op, and the noise a discrete choice's
//! margin is held against.
//!
//! Two correct runs (absorbed vs naive, prefill vs decode, two devices, mladb vs another engine)
//! differ by rounding, and each op passes on the difference of its inputs, amplified or damped
//! by what it computes: a softmax amplifies its scores' error by their magnitude, a sum of
//! large terms that nearly cancel (the DSA indexer's scores) loses relative precision, a norm
//! damps. So an op's tolerance is its own rounding noise plus what its inputs' error explains:
//!
//! ```text
//! tolerance(op) = floor(kind, dtype) + gain(kind, dtype) · input_error(op)
//! ```
//!
//! where `input_error` is the largest relative L2 error, in the same comparison, of what the op
//! read (activations and caches, weights excluded; an op that was not compared passes on its
//! inputs' error; a discrete choice, once both runs agree on it, passes on none), times the
//! op's conditioning where its own values say it amplifies more than its kind's gain allows
//! (`super::conditioning`: the indexer's scores, a projection's small output). An op is a
//! finding when its error exceeds that: the first op whose error its inputs do not explain. At
//! the first layer, where both runs read identical inputs, a fault is held against the floor
//! alone; deep in a bf16 run the noise grows, and so does the tolerance.
//!
//! The table comes from measured clean runs (`tools/noise_sweep.py`: every built-in layout over
//! seeds and schedules, quantized kv_b_proj, random HF checkpoints; CPU and GPU): the floor is
//! about twice the largest error seen at an op whose inputs agreed, the gain about twice the
//! largest ratio of an op's error above its floor to its input error. README, *Verdicts*, holds
//! the measurements.

use super::compare::OpComparison;
use super::conditioning::OutputScales;
use super::record::RunRecord;
use super::selection::is_selection;
use crate::engine::trace::{BufferRole, OpEvent, OpKind};
use crate::engine::StorageDtype;
use crate::tensor::BufferId;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// The tolerances a comparison uses.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tolerances {
    /// The table's rows for the runs' storage dtype, with input errors propagated.
    Table(StorageDtype),
    /// One tolerance for every op, whatever its inputs (`--tolerance`).
    Uniform(f64),
}

/// One row of the table: an op kind's floor and gain in f32 and in bf16.
struct Row {
    kind: OpKind,
    f32: (f64, f64),
    bf16: (f64, f64),
}

/// f32 runs agree to about 1e-6 per op; 1e-4 leaves room and still sees every fault.
const F32: (f64, f64) = (1e-4, 10.0);
/// Ops the table does not list.
const BF16_DEFAULT: (f64, f64) = (1.5e-2, 4.0);

/// Measured bf16 rows (floor, gain); see the module doc and the README.
#[rustfmt::skip]
const TABLE: &[Row] = &[
    Row { kind: OpKind::AttentionProbs,  f32: F32, bf16: (1.5e-2, 12.0) },
    Row { kind: OpKind::Attention,       f32: F32, bf16: (1.5e-2, 12.0) },
    Row { kind: OpKind::AttentionLatent, f32: F32, bf16: (1.5e-2, 12.0) },
    Row { kind: OpKind::AttentionLse,    f32: F32, bf16: (1.5e-2, 12.0) },
    Row { kind: OpKind::AttentionPartials, f32: F32, bf16: (1.5e-2, 12.0) },
    Row { kind: OpKind::AttentionPadding, f32: F32, bf16: (1.5e-2, 12.0) },
    Row { kind: OpKind::AttentionMerge,  f32: F32, bf16: (1.5e-2, 12.0) },
    Row { kind: OpKind::IndexScores,     f32: F32, bf16: (2e-2, 16.0) },
    Row { kind: OpKind::Linear,          f32: F32, bf16: (1.5e-2, 24.0) },
    Row { kind: OpKind::Rope,            f32: F32, bf16: (1.5e-2, 24.0) },
    Row { kind: OpKind::Expert,          f32: F32, bf16: (1.5e-2, 24.0) },
    Row { kind: OpKind::Experts,         f32: F32, bf16: (1.5e-2, 8.0) },
    Row { kind: OpKind::Router,          f32: F32, bf16: (1.5e-2, 8.0) },
    Row { kind: OpKind::Activation,      f32: F32, bf16: (1.5e-2, 8.0) },
    Row { kind: OpKind::Sum,             f32: F32, bf16: (1.5e-2, 8.0) },
    Row { kind: OpKind::AllReduce,       f32: F32, bf16: (1.5e-2, 8.0) },
    Row { kind: OpKind::AllGather,       f32: F32, bf16: (1.5e-2, 8.0) },
];

impl Tolerances {
    /// The table for values stored as `a` compared with values stored as `b`: bf16's when
    /// either side is bf16 (its noise is in both), f32's otherwise.
    pub fn table_for(a: StorageDtype, b: StorageDtype) -> Tolerances {
        if a == StorageDtype::Bf16 || b == StorageDtype::Bf16 {
            Tolerances::Table(StorageDtype::Bf16)
        } else {
            Tolerances::Table(StorageDtype::F32)
        }
    }

    /// (floor, gain) of ops of `kind`.
    pub fn row(&self, kind: OpKind) -> (f64, f64) {
        match *self {
            Tolerances::Uniform(t) => (t, 0.0),
            Tolerances::Table(dtype) => {
                let row = TABLE.iter().find(|r| r.kind == kind);
                match dtype {
                    StorageDtype::F32 => row.map_or(F32, |r| r.f32),
                    StorageDtype::Bf16 => row.map_or(BF16_DEFAULT, |r| r.bf16),
                }
            }
        }
    }

    /// The tolerance of an op of `kind` whose inputs differ by `input_error`.
    pub fn of(&self, kind: OpKind, input_error: f64) -> f64 {
        let (floor, gain) = self.row(kind);
        floor + gain * input_error
    }

    /// Sets every comparison's tolerance from the table and the errors of what its op read in
    /// `run` (the run the comparisons were made of, in its order).
    pub fn judge(&self, run: &RunRecord, comparisons: &mut [OpComparison]) {
        let mut by_index: HashMap<usize, &mut OpComparison> =
            comparisons.iter_mut().map(|c| (c.index, c)).collect();
        let mut judge = Judge::new(*self).with_kv_cache(run.flags.kv_cache);
        for i in 0..run.events.len() {
            judge.next_of(run, i, by_index.remove(&i));
        }
    }

    /// `floor + gain × input error by op kind (bf16 table)` or `tolerance 1e-3 (every op)`.
    pub fn describe(&self) -> String {
        match *self {
            Tolerances::Uniform(t) => format!("tolerance {t:.0e} (every op)"),
            Tolerances::Table(dtype) => format!(
                "tolerances: floor + gain × input error, by op kind ({} table)",
                match dtype {
                    StorageDtype::F32 => "f32",
                    StorageDtype::Bf16 => "bf16",
                }
            ),
        }
    }

    /// The floor of the tightest op kind and the largest floor: what `describe` cannot say.
    pub fn floor_range(&self) -> (f64, f64) {
        ALL_KINDS
            .iter()
            .map(|&k| self.row(k).0)
            .fold((f64::INFINITY, 0f64), |(lo, hi), t| (lo.min(t), hi.max(t)))
    }
}

/// What two fp8_ds_mla round trips of inputs that differ at all may differ by, relative: each
/// is within half an E4M3 step (2^-4 relative) of its input, so an element whose inputs straddle
/// a rounding boundary lands a whole step away however close the inputs are. Allowed on top of
/// the table at an FP8 cache write whose inputs differ; inputs that agree must still agree.
pub const FP8_REQUANT: f64 = 0.125;

/// Judges one comparison's ops in execution order, carrying the error each buffer holds so far
/// (caches: the largest of any write into them), so that a view that sees ops one at a time
/// (the TUI's marks) judges them as a whole-run comparison would.
pub struct Judge {
    tolerances: Tolerances,
    carried: HashMap<BufferId, f64>,
    /// The runs write an fp8_ds_mla latent cache (see [`FP8_REQUANT`]).
    fp8_cache: bool,
    /// What the ops' own values say of their conditioning.
    scales: OutputScales,
}

impl Judge {
    pub fn new(tolerances: Tolerances) -> Judge {
        Judge {
            tolerances,
            carried: HashMap::new(),
            fp8_cache: false,
            scales: OutputScales::default(),
        }
    }

    /// The judge of runs whose latent cache is stored as `kv_cache`.
    pub fn with_kv_cache(mut self, kv_cache: crate::ops::KvCacheDtype) -> Judge {
        self.fp8_cache = kv_cache == crate::ops::KvCacheDtype::Fp8DsMla;
        self
    }

    /// [`Judge::next`] for op `i` of `run`, whose own values may say that its error outgrows
    /// its inputs' more than its kind's gain allows (see [`super::conditioning`]).
    pub fn next_of(&mut self, run: &RunRecord, i: usize, comparison: Option<&mut OpComparison>) {
        let mut comparison = comparison;
        if let Some(c) = comparison.as_deref_mut() {
            c.conditioning = self.scales.next(run, i);
        }
        self.next(&run.events[i], comparison);
    }

    /// Takes the run's next op and, when it was compared, its comparison, whose input error and
    /// tolerance are set.
    pub fn next(&mut self, e: &OpEvent, comparison: Option<&mut OpComparison>) {
        let input_error = self.input_error(e);
        let error = match comparison {
            Some(c) => {
                c.input_error = input_error;
                c.tolerance = self.tolerances.of(c.kind, input_error * c.conditioning);
                // A rank's partial sum is held to no tolerance of its own: its error is carried
                // to the all-reduce after it, which is judged.
                if e.rank.is_some() && crate::model::shard::partial_sum(&e.name) {
                    c.tolerance = f64::INFINITY;
                }
                let requant = self.fp8_cache && super::flags::latent_write(e) && input_error > 0.0;
                if requant && matches!(self.tolerances, Tolerances::Table(_)) {
                    c.tolerance += FP8_REQUANT;
                }
                // NaN / ±Inf alike on both sides carry only the error of the elements finite on
                // both: carrying infinity would pass every later op of the run, whatever it did.
                match &c.diff {
                    Ok(d) => d.severity(),
                    Err(_) => input_error,
                }
            }
            // Once both runs agree on a choice, it carries no error.
            None if is_selection(e) => 0.0,
            None => input_error,
        };
        let slot = self.carried.entry(e.output.id).or_insert(0.0);
        *slot = if e.output.role == BufferRole::Cache {
            slot.max(error)
        } else {
            error
        };
    }
}

impl Judge {
    /// The largest error carried by what `e` read (weights aside).
    fn input_error(&self, e: &OpEvent) -> f64 {
        e.inputs
            .iter()
            .filter(|b| b.role != BufferRole::Weight)
            .filter_map(|b| self.carried.get(&b.id))
            .fold(0.0, |a: f64, &b| a.max(b))
    }

    /// Follows a re-run of the ops judged so far (the same ops, new buffers): the error each
    /// old buffer carried moves to the buffer that stands in its place.
    pub fn rename(&mut self, ids: &HashMap<BufferId, BufferId>) {
        let carried = std::mem::take(&mut self.carried);
        self.carried = carried
            .into_iter()
            .map(|(id, e)| (ids.get(&id).copied().unwrap_or(id), e))
            .collect();
    }

    /// Judges a comparison of op `i` of `run`, which the judge has passed already (a tensor
    /// that came late): by the errors carried now, without carrying its own.
    pub fn late_of(&self, run: &RunRecord, i: usize, comparison: &mut OpComparison) {
        let (input_error, conditioning) =
            (self.input_error(&run.events[i]), self.scales.peek(run, i));
        comparison.input_error = input_error;
        comparison.conditioning = conditioning;
        comparison.tolerance = self
            .tolerances
            .of(comparison.kind, input_error * conditioning);
    }

    /// The tolerance op `i` of `run` would be judged by now, from the errors its inputs carry
    /// and its conditioning.
    pub fn tolerance_of(&self, run: &RunRecord, i: usize) -> f64 {
        let e = &run.events[i];
        self.tolerances
            .of(e.kind, self.input_error(e) * self.scales.peek(run, i))
    }
}

/// Every op kind, for listing the table.
pub const ALL_KINDS: &[OpKind] = &[
    OpKind::Embedding,
    OpKind::RmsNorm,
    OpKind::LayerNorm,
    OpKind::Linear,
    OpKind::Rope,
    OpKind::CacheWrite,
    OpKind::IndexScores,
    OpKind::IndexTopK,
    OpKind::AbsorbQuery,
    OpKind::Decompress,
    OpKind::Dequantize,
    OpKind::AttentionProbs,
    OpKind::Attention,
    OpKind::AttentionLatent,
    OpKind::AttentionLse,
    OpKind::AttentionPartials,
    OpKind::AttentionPadding,
    OpKind::AttentionMerge,
    OpKind::Residual,
    OpKind::Activation,
    OpKind::Router,
    OpKind::Expert,
    OpKind::Experts,
    OpKind::Sum,
    OpKind::Logits,
    OpKind::AllReduce,
    OpKind::AllGather,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_and_overrides() {
        let t = Tolerances::Table(StorageDtype::F32);
        assert!(ALL_KINDS.iter().all(|&k| t.of(k, 0.0) == F32.0));
        let b = Tolerances::Table(StorageDtype::Bf16);
        assert!(b.of(OpKind::IndexScores, 0.0) > b.of(OpKind::RmsNorm, 0.0));
        assert!(b.of(OpKind::AttentionProbs, 1e-2) > b.of(OpKind::AttentionProbs, 0.0));
        assert_eq!(Tolerances::Uniform(1e-3).of(OpKind::Logits, 0.5), 1e-3);
        assert!(b.describe().contains("bf16"));
    }
}
