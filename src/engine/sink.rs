//! Every op of the forward pass runs through [`Sink::op`]: it takes the output from an earlier
//! run when one may be replayed, else computes it; applies the storage dtype; computes
//! statistics; records which buffers were read and written; numbers the event and hands it to
//! the observer (at once, or for an observer that takes late events, with the statistics of
//! many ops brought back together: see [`Observer::takes_late_events`]).

use super::trace::{BufferRef, Observer, OpEvent, OpKind, Phase, Replay, LATE_EVENTS};
use crate::backend::{Backend, StatsBatch};
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

    /// Records the read of a weight fetched elsewhere (by a call that several ops share).
    pub fn fetched(&mut self, w: BufferRef) {
        self.refs.push(w);
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
    /// The tensor-parallel rank whose ops are being run (`None` without tensor parallelism).
    pub rank: Option<usize>,
    /// Events waiting for their statistics, for an observer that takes late events.
    late: Option<LateEvents<'a>>,
}

/// Events whose statistics were started on the device, in order, with their outputs.
struct LateEvents<'a> {
    /// One statistics batch per rank (ranks may compute on devices of their own), made from the
    /// rank's backend when its first event waits.
    stats: Vec<Option<Box<dyn StatsBatch + 'a>>>,
    /// The waiting events, their outputs and the rank whose batch has their statistics.
    events: Vec<(OpEvent, Tensor, usize)>,
    /// Inside [`Sink::together`]: the events from this one on have not started their
    /// statistics yet (they start together at its end).
    unstarted: Option<usize>,
}

impl<'a> LateEvents<'a> {
    /// Rank `slot`'s batch, made from `backend` the first time.
    fn batch(&mut self, slot: usize, backend: &'a dyn Backend) -> &mut Box<dyn StatsBatch + 'a> {
        if self.stats.len() <= slot {
            self.stats.resize_with(slot + 1, || None);
        }
        self.stats[slot].get_or_insert_with(|| backend.stats_batch())
    }

    /// Starts the statistics of the events [`Sink::together`] holds back, in one go per rank.
    fn start_unstarted(&mut self) -> Result<()> {
        let Some(from) = self.unstarted else {
            return Ok(());
        };
        self.unstarted = Some(self.events.len());
        for (slot, batch) in self.stats.iter_mut().enumerate() {
            let outputs: Vec<&Tensor> = self.events[from.min(self.events.len())..]
                .iter()
                .filter(|(_, _, s)| *s == slot)
                .map(|(_, t, _)| t)
                .collect();
            if let (Some(batch), false) = (batch, outputs.is_empty()) {
                batch.start(&outputs)?;
            }
        }
        Ok(())
    }

    /// Every batch's statistics, handed back in the order of the events.
    fn collect(&mut self) -> Result<Vec<TensorStats>> {
        let mut per_rank = Vec::with_capacity(self.stats.len());
        for batch in &mut self.stats {
            let got = match batch {
                Some(b) => b.collect()?,
                None => Vec::new(),
            };
            per_rank.push(std::collections::VecDeque::from(got));
        }
        let mut stats = Vec::with_capacity(self.events.len());
        for (_, _, slot) in &self.events {
            match per_rank.get_mut(*slot).and_then(|q| q.pop_front()) {
                Some(s) => stats.push(s),
                // Never hand an event another op's statistics.
                None => break,
            }
        }
        let left: usize = per_rank.iter().map(|q| q.len()).sum();
        if stats.len() != self.events.len() || left > 0 {
            return Err(crate::Error::invalid(format!(
                "statistics of {} outputs came back for {} waiting events",
                stats.len() + left,
                self.events.len()
            )));
        }
        Ok(stats)
    }
}

impl<'a> Sink<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        backend: &'a dyn Backend,
        weights: &'a WeightStore,
        observer: &'a mut dyn Observer,
        replay: Option<&'a dyn Replay>,
        storage: StorageDtype,
        phase: Phase,
        positions: (usize, usize),
        next_index: &'a mut usize,
        counts: &'a mut OpCounts,
    ) -> Sink<'a> {
        let late = (observer.wants_stats() && observer.takes_late_events()).then(|| LateEvents {
            stats: vec![Some(backend.stats_batch())],
            events: Vec::new(),
            unstarted: None,
        });
        Sink {
            backend,
            weights,
            observer,
            replay,
            storage,
            phase,
            positions,
            next_index,
            counts,
            rank: None,
            late,
        }
    }
}

impl<'a> Sink<'a> {
    /// Runs the next ops as rank `rank` (`None`: no tensor parallelism), reading `weights`,
    /// computing on `backend`.
    pub fn set_rank(
        &mut self,
        rank: Option<usize>,
        weights: &'a WeightStore,
        backend: &'a dyn Backend,
    ) {
        self.rank = rank;
        self.weights = weights;
        self.backend = backend;
    }
}

impl Sink<'_> {
    /// Whether the events carry statistics (the observer asks for them).
    pub fn wants_stats(&self) -> bool {
        self.observer.wants_stats()
    }

    /// Whether the statistics of device outputs are started as each op ends and brought back
    /// later, many at once (so that an op need not compute its own at once).
    pub fn defers_stats(&self) -> bool {
        self.late.is_some()
    }

    /// Runs `emit`, which reports the events of one kernel call and runs no device work of its
    /// own: the statistics of their outputs start together at its end (one launch for the
    /// call's outputs, for late events).
    pub fn together<T>(&mut self, emit: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if let Some(late) = &mut self.late {
            late.unstarted = Some(late.events.len());
        }
        let result = emit(self);
        if let Some(late) = &mut self.late {
            late.start_unstarted()?;
            late.unstarted = None;
        }
        result
    }

    /// Hands every waiting event to the observer, with its statistics (one wait for all).
    pub fn flush(&mut self) -> Result<()> {
        let Some(late) = &mut self.late else {
            return Ok(());
        };
        if late.events.is_empty() {
            return Ok(());
        }
        late.start_unstarted()?;
        let stats = late.collect()?;
        if late.unstarted.is_some() {
            late.unstarted = Some(0); // (the events are handed over below)
        }
        for ((mut event, output, _), stats) in late.events.drain(..).zip(stats) {
            event.stats = stats;
            self.observer.on_op(&event, &output)?;
        }
        Ok(())
    }

    /// Whether the op `offset` places ahead, named `name`, would be taken from the earlier run.
    /// An op that reports several events from one kernel call asks this first, so that it
    /// replays the earlier run's events as they were instead of calling the kernel.
    pub fn replays(&self, offset: usize, name: &str) -> bool {
        self.earlier(*self.next_index + offset, name).is_some()
    }

    /// The earlier run's event and output at `index`, where they may stand in for op `name` of
    /// this phase and rank.
    fn earlier(&self, index: usize, name: &str) -> Option<(&OpEvent, &Tensor)> {
        earlier(self.replay, self.phase, self.rank, index, name)
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
            match earlier(self.replay, self.phase, self.rank, index, name) {
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
        let replayed = self.earlier(*self.next_index, name).is_some();
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
        // A device output waits for its statistics with the events before it; anything else
        // is handed over now, after them.
        let deferred = self.late.is_some()
            && stats.is_none()
            && values.device().is_some()
            && !values.on_host();
        if !deferred {
            self.flush()?;
        }
        let event = OpEvent {
            index: *self.next_index,
            phase: self.phase,
            layer,
            rank: self.rank,
            name: name.to_string(),
            kind,
            shape: values.shape().to_vec(),
            dtype: values.dtype(),
            stats: match stats {
                _ if !self.observer.wants_stats() || deferred => TensorStats::of(&[]),
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
        match &mut self.late {
            Some(late) if deferred => {
                let slot = self.rank.unwrap_or(0);
                let start_now = late.unstarted.is_none();
                let batch = late.batch(slot, self.backend);
                if start_now {
                    batch.start(&[values])?;
                }
                late.events.push((event, values.alias(), slot));
                if late.events.len() >= LATE_EVENTS {
                    self.flush()?;
                }
                Ok(())
            }
            _ => self.observer.on_op(&event, values),
        }
    }
}

impl Drop for Sink<'_> {
    /// A pass that stopped on an error still hands over the events before it (an error in
    /// doing so is lost behind the first).
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

/// What `replay` holds at `index` for op `name` of `phase` run by `rank`.
fn earlier<'r>(
    replay: Option<&'r dyn Replay>,
    phase: Phase,
    rank: Option<usize>,
    index: usize,
    name: &str,
) -> Option<(&'r OpEvent, &'r Tensor)> {
    replay?
        .lookup(index, phase, name)
        .filter(|(old, _)| old.rank == rank)
}

/// Rounds every element to the nearest bf16 (ties to even), keeping NaN and the poison pattern.
fn round_to_bf16(t: &mut Tensor) {
    for v in t.data_mut() {
        if !v.is_nan() {
            *v = half::bf16::from_f32(*v).to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::model::{layout::Layout, Model};
    use crate::tensor::test_device::FakeDevice;

    /// Notes which ops it was handed, and when (after how many ops had been emitted).
    struct Late {
        seen: Vec<(usize, String, TensorStats)>,
        emitted: std::rc::Rc<std::cell::Cell<usize>>,
    }

    impl Observer for Late {
        fn on_op(&mut self, event: &OpEvent, _: &Tensor) -> Result<()> {
            self.seen
                .push((self.emitted.get(), event.name.clone(), event.stats.clone()));
            Ok(())
        }
        fn takes_late_events(&self) -> bool {
            true
        }
    }

    /// A sink for a prefill of one token of `model`, f32, no replay.
    fn prefill_sink<'a>(
        backend: &'a dyn Backend,
        model: &'a Model,
        observer: &'a mut dyn Observer,
        next: &'a mut usize,
        counts: &'a mut OpCounts,
    ) -> Sink<'a> {
        let (storage, phase) = (StorageDtype::F32, Phase::Prefill);
        Sink::new(
            backend,
            &model.weights,
            observer,
            None,
            storage,
            phase,
            (0, 1),
            next,
            counts,
        )
    }

    #[test]
    fn late_events_come_in_order_with_their_statistics_when_flushed() {
        let model = Model::synthetic(Layout::resolve("glm5-tiny").unwrap(), 1, 1 << 20).unwrap();
        let emitted = std::rc::Rc::new(std::cell::Cell::new(0));
        let mut late = Late {
            seen: Vec::new(),
            emitted: emitted.clone(),
        };
        let (mut next, mut counts) = (0, OpCounts::default());
        let device = |v: &[f32]| Tensor::from_device(&[v.len()], FakeDevice::holding(v));
        let values = [vec![1.0, 2.0], vec![f32::NAN, 4.0], vec![-3.0, 0.0]];
        {
            let mut sink = prefill_sink(&CpuBackend, &model, &mut late, &mut next, &mut counts);
            assert!(sink.defers_stats());
            let op = |sink: &mut Sink, name: &str, t: Tensor| {
                sink.op(None, name, OpKind::Residual, &[], |_| Ok(t))
                    .unwrap();
                emitted.set(emitted.get() + 1);
            };
            op(&mut sink, "a", device(&values[0]));
            op(&mut sink, "b", device(&values[1]));
            // A host output is handed over at once, after the device outputs before it.
            op(&mut sink, "c", Tensor::from_vec(&[2], values[2].clone()));
            // Outputs of one kernel call start together, at the end of `together`.
            sink.together(|sink| {
                op(sink, "d", device(&values[0]));
                op(sink, "e", device(&values[1]));
                Ok(())
            })
            .unwrap();
            sink.flush().unwrap();
            op(&mut sink, "f", device(&values[2]));
            // "f" is handed over when the sink is dropped (a pass that stopped early).
        }
        let got: Vec<(usize, &str)> = late.seen.iter().map(|(n, s, _)| (*n, s.as_str())).collect();
        assert_eq!(
            got,
            [(2, "a"), (2, "b"), (2, "c"), (5, "d"), (5, "e"), (6, "f")]
        );
        for ((_, _, stats), v) in late.seen.iter().zip(values.iter().cycle()) {
            assert_eq!(stats.count, 2);
            assert_eq!(stats.nan, v.iter().filter(|x| x.is_nan()).count());
            assert_eq!(stats.l2.to_bits(), TensorStats::of(v).l2.to_bits());
        }
    }

    #[test]
    fn late_events_of_ranks_keep_their_order_and_their_own_statistics() {
        let model = Model::synthetic(Layout::resolve("glm5-tiny").unwrap(), 1, 1 << 20).unwrap();
        let mut late = Late {
            seen: Vec::new(),
            emitted: Default::default(),
        };
        let (mut next, mut counts) = (0, OpCounts::default());
        let device = |v: Vec<f32>| Tensor::from_device(&[v.len()], FakeDevice::holding(&v));
        // Ranks 1, 0, 1, 1, 0: each event's values say its order.
        let ranks = [1, 0, 1, 1, 0];
        {
            let (rank0, rank1) = (CpuBackend, CpuBackend);
            let mut sink = prefill_sink(&rank0, &model, &mut late, &mut next, &mut counts);
            for (i, &r) in ranks.iter().enumerate() {
                let backend: &dyn Backend = if r == 0 { &rank0 } else { &rank1 };
                sink.set_rank(Some(r), &model.weights, backend);
                let values = vec![i as f32; i + 1];
                sink.op(None, &format!("op{i}"), OpKind::Residual, &[], |_| {
                    Ok(device(values))
                })
                .unwrap();
            }
            sink.flush().unwrap();
        }
        assert_eq!(late.seen.len(), ranks.len());
        for (i, (_, name, stats)) in late.seen.iter().enumerate() {
            assert_eq!(name, &format!("op{i}"));
            assert_eq!((stats.count, stats.max), (i + 1, i as f64), "{name}");
        }
    }
}
