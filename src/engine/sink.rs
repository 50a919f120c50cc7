//! Every op of the forward pass runs through [`Sink::op`]: it takes the output from an earlier
//! run when one may be replayed, else computes it; applies the storage dtype; computes
//! statistics; records which buffers were read and written; numbers the event and hands it to
//! the observer.

use super::trace::{BufferRef, Observer, OpEvent, OpKind, Phase, Replay};
use crate::backend::Backend;
use crate::error::Result;
use crate::model::WeightStore;
use crate::stats::TensorStats;
use crate::tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

pub use crate::ops::StorageDtype;

/// How many ops a run computed and how many it took from an earlier run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpCounts {
    pub executed: usize,
    pub replayed: usize,
}

/// What an op's computation produced.
pub struct Computed {
    pub tensor: Tensor,
    /// The buffer the kernel wrote, when the op handed it one (see `OpEvent::kernel_wrote`).
    pub kernel_wrote: Option<BufferRef>,
    /// Reads that are not activations passed in (caches).
    pub extra_reads: Vec<BufferRef>,
    /// Which kernels ran the op (attention on the GPU).
    pub kernel: Option<crate::ops::KernelInfo>,
    /// Statistics computed beforehand with the other outputs of the same kernel call (see
    /// [`Backend::stats_many`]); `None`: the sink computes them.
    pub stats: Option<TensorStats>,
}

impl From<Tensor> for Computed {
    fn from(tensor: Tensor) -> Computed {
        Computed {
            tensor,
            kernel_wrote: None,
            extra_reads: Vec::new(),
            kernel: None,
            stats: None,
        }
    }
}

/// Weights an op fetches, recorded as reads.
pub struct Reads<'w> {
    weights: &'w WeightStore,
    refs: Vec<BufferRef>,
}

impl Reads<'_> {
    /// Fetches a weight by its full name and records the read.
    pub fn weight(&mut self, name: &str) -> Result<Arc<Tensor>> {
        let w = self.weights.get(name)?;
        self.refs.push(BufferRef::weight(&w));
        Ok(w)
    }
}

pub struct Sink<'a> {
    pub backend: &'a dyn Backend,
    pub weights: &'a WeightStore,
    pub observer: &'a mut dyn Observer,
    pub replay: Option<&'a dyn Replay>,
    pub storage: StorageDtype,
    pub phase: Phase,
    pub positions: (usize, usize),
    pub next_index: &'a mut usize,
    pub counts: &'a mut OpCounts,
}

impl Sink<'_> {
    /// Whether the events carry statistics (the observer asks for them).
    pub fn wants_stats(&self) -> bool {
        self.observer.wants_stats()
    }

    /// Whether the op `offset` places ahead, named `name`, would be taken from the earlier run.
    /// An op that reports several events from one kernel call asks this first, so that it
    /// replays the earlier run's events as they were instead of calling the kernel.
    pub fn replays(&self, offset: usize, name: &str) -> bool {
        self.replay.is_some_and(|r| {
            r.lookup(*self.next_index + offset, self.phase, name)
                .is_some()
        })
    }

    /// Runs (or replays) op `name`, which reads the activations `inputs`; `compute` fetches its
    /// weights through `Reads` and returns the output.
    pub fn op(
        &mut self,
        layer: Option<usize>,
        name: &str,
        kind: OpKind,
        inputs: &[&Tensor],
        compute: impl FnOnce(&mut Reads) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.op_with(layer, name, kind, inputs, |r| {
            compute(r).map(Computed::from)
        })
    }

    /// [`Sink::op`] for ops that report more than their output (kernel buffers, cache reads).
    pub fn op_with(
        &mut self,
        layer: Option<usize>,
        name: &str,
        kind: OpKind,
        inputs: &[&Tensor],
        compute: impl FnOnce(&mut Reads) -> Result<Computed>,
    ) -> Result<Tensor> {
        let index = *self.next_index;
        let activations = inputs.iter().map(|t| BufferRef::of(t));
        let (tensor, kernel_wrote, reads, replayed, kernel, stats) =
            match self.replay.and_then(|r| r.lookup(index, self.phase, name)) {
                Some((old, old_output)) => {
                    let tensor = old_output.clone();
                    // The earlier run's weight and cache reads; its kernel buffer if it was
                    // disconnected, else the new output.
                    let kept = old
                        .inputs
                        .iter()
                        .filter(|b| b.role != super::trace::BufferRole::Activation);
                    let reads = activations.chain(kept.copied()).collect();
                    let kernel_wrote = old.kernel_wrote.map(|k| {
                        if k.id == old.output.id {
                            BufferRef::of(&tensor)
                        } else {
                            k
                        }
                    });
                    self.counts.replayed += 1;
                    (tensor, kernel_wrote, reads, true, old.kernel.clone(), None)
                }
                None => {
                    let mut r = Reads {
                        weights: self.weights,
                        refs: Vec::new(),
                    };
                    let mut c = compute(&mut r)?;
                    // Device outputs are already stored in the run's dtype (the device backend
                    // was made for it); host outputs are rounded here (and their statistics
                    // computed after).
                    if self.storage == StorageDtype::Bf16
                        && c.tensor.dtype() == DType::F32
                        && c.tensor.device().is_none()
                    {
                        round_to_bf16(&mut c.tensor);
                        c.stats = None;
                    }
                    let reads = activations.chain(c.extra_reads).chain(r.refs).collect();
                    self.counts.executed += 1;
                    (c.tensor, c.kernel_wrote, reads, false, c.kernel, c.stats)
                }
            };
        self.emit(
            layer,
            name,
            kind,
            &tensor,
            BufferRef::of(&tensor),
            kernel_wrote,
            reads,
            replayed,
            kernel,
            stats,
        )?;
        Ok(tensor)
    }

    /// Reports an op with no computation of its own, such as a cache write: `values` are what
    /// it wrote, `buffer` where.
    pub fn report(
        &mut self,
        layer: Option<usize>,
        name: &str,
        kind: OpKind,
        values: &Tensor,
        buffer: BufferRef,
        reads: Vec<BufferRef>,
    ) -> Result<()> {
        let replayed = self
            .replay
            .is_some_and(|r| r.lookup(*self.next_index, self.phase, name).is_some());
        if replayed {
            self.counts.replayed += 1;
        } else {
            self.counts.executed += 1;
        }
        self.emit(
            layer, name, kind, values, buffer, None, reads, replayed, None, None,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn emit(
        &mut self,
        layer: Option<usize>,
        name: &str,
        kind: OpKind,
        values: &Tensor,
        output: BufferRef,
        kernel_wrote: Option<BufferRef>,
        inputs: Vec<BufferRef>,
        replayed: bool,
        kernel: Option<crate::ops::KernelInfo>,
        stats: Option<TensorStats>,
    ) -> Result<()> {
        let event = OpEvent {
            index: *self.next_index,
            phase: self.phase,
            layer,
            name: name.to_string(),
            kind,
            shape: values.shape().to_vec(),
            dtype: values.dtype(),
            stats: match stats {
                _ if !self.observer.wants_stats() => TensorStats::of(&[]),
                Some(s) => s,
                None => self.backend.stats(values),
            },
            output,
            kernel_wrote,
            inputs,
            positions: self.positions,
            replayed,
            kernel,
        };
        *self.next_index += 1;
        self.observer.on_op(&event, values)
    }
}

/// Rounds every element to the nearest bf16 (ties to even), keeping NaN and the poison pattern.
fn round_to_bf16(t: &mut Tensor) {
    for v in t.data_mut() {
        if !v.is_nan() {
            *v = half::bf16::from_f32(*v).to_f32();
        }
    }
}
