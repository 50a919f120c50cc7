//! Turns op outputs into trace events: computes statistics, records buffer identities, numbers
//! the events and hands them to the observer.

use super::trace::{BufferRef, Observer, OpEvent, OpKind, Phase};
use crate::backend::Backend;
use crate::error::Result;
use crate::tensor::Tensor;

pub struct Sink<'a> {
    pub backend: &'a dyn Backend,
    pub observer: &'a mut dyn Observer,
    pub phase: Phase,
    pub positions: (usize, usize),
    pub next_index: &'a mut usize,
}

impl Sink<'_> {
    /// Reports `output` of op `name`, which read the activations `inputs` (each the output of an
    /// earlier op) and the weights `weights`.
    pub fn emit(
        &mut self,
        layer: Option<usize>,
        name: &str,
        kind: OpKind,
        output: &Tensor,
        inputs: &[&Tensor],
        weights: &[&Tensor],
    ) -> Result<()> {
        let reads = inputs
            .iter()
            .map(|t| BufferRef::of(t))
            .chain(weights.iter().map(|t| BufferRef::weight(t)))
            .collect();
        self.emit_as(layer, name, kind, output, BufferRef::of(output), reads)
    }

    /// Reports an op whose output buffer is not `values` itself (a cache write: `values` holds the
    /// rows written, `buffer` the cache), with its reads given as buffer references.
    pub fn emit_as(
        &mut self,
        layer: Option<usize>,
        name: &str,
        kind: OpKind,
        values: &Tensor,
        buffer: BufferRef,
        inputs: Vec<BufferRef>,
    ) -> Result<()> {
        let event = OpEvent {
            index: *self.next_index,
            phase: self.phase,
            layer,
            name: name.to_string(),
            kind,
            shape: values.shape().to_vec(),
            dtype: values.dtype(),
            stats: self.backend.stats(values),
            output: buffer,
            inputs,
            positions: self.positions,
        };
        *self.next_index += 1;
        self.observer.on_op(&event, values)
    }
}
