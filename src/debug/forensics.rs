//! Buffer forensics: which buffer each op wrote and which it read, elements left unwritten in a
//! poisoned output, and disconnects, where the buffer a kernel wrote is not the one handed on.
//! Everything here reads the trace, so it works the same for host and device buffers.

use super::record::RunRecord;
use crate::engine::trace::{BufferRef, BufferRole, Phase};
use serde::Serialize;
use std::collections::HashSet;

/// An op whose kernel wrote one buffer while the op handed another to its consumers.
#[derive(Debug, Clone, Serialize)]
pub struct Disconnect {
    pub index: usize,
    pub phase: Phase,
    pub op: String,
    pub kernel_wrote: BufferRef,
    pub returned: BufferRef,
    /// Later ops that read the returned buffer.
    pub consumers: Vec<String>,
}

/// Ops that read the output of op `index`.
pub fn consumers(run: &RunRecord, index: usize) -> Vec<usize> {
    let id = run.events[index].output.id;
    (index + 1..run.len())
        .filter(|&j| run.events[j].inputs.iter().any(|r| r.id == id))
        .collect()
}

pub fn disconnects(run: &RunRecord) -> Vec<Disconnect> {
    run.events
        .iter()
        .enumerate()
        .filter_map(|(i, e)| {
            let k = e.kernel_wrote?;
            (k.id != e.output.id).then(|| Disconnect {
                index: i,
                phase: e.phase,
                op: e.name.clone(),
                kernel_wrote: k,
                returned: e.output,
                consumers: consumers(run, i)
                    .into_iter()
                    .map(|j| run.events[j].name.clone())
                    .collect(),
            })
        })
        .collect()
}

/// Activation reads of buffers no earlier op produced: (reading op index, the buffer).
pub fn orphan_reads(run: &RunRecord) -> Vec<(usize, BufferRef)> {
    let mut produced = HashSet::new();
    let mut orphans = Vec::new();
    for (i, e) in run.events.iter().enumerate() {
        for r in &e.inputs {
            if r.role == BufferRole::Activation && !produced.contains(&r.id) {
                orphans.push((i, *r));
            }
        }
        produced.insert(e.output.id);
    }
    orphans
}

/// The attention chain of one layer in one phase: the buffer the attention kernel wrote, the
/// buffer its wrapper returned, and the buffer the next op read.
#[derive(Debug, Clone, Serialize)]
pub struct AttentionChain {
    pub kernel_op: String,
    pub kernel_wrote: BufferRef,
    pub returned: BufferRef,
    pub consumer_op: Option<String>,
    pub consumer_read: Option<BufferRef>,
    /// The kernel's buffer is the one handed on, and the consumer read it.
    pub connected: bool,
    /// Elements of the returned buffer no op wrote.
    pub unwritten: usize,
}

/// The attention kernel's buffer chain of `layer` in `phase` (rank 0's under tensor
/// parallelism).
pub fn attention_chain(run: &RunRecord, phase: Phase, layer: usize) -> Option<AttentionChain> {
    let first_rank = run.events.iter().find_map(|e| e.rank);
    attention_chain_of_rank(run, phase, layer, first_rank)
}

/// [`attention_chain`] of one tensor-parallel rank (`None`: a run without ranks).
pub fn attention_chain_of_rank(
    run: &RunRecord,
    phase: Phase,
    layer: usize,
    rank: Option<usize>,
) -> Option<AttentionChain> {
    let i = run.events.iter().position(|e| {
        e.phase == phase && e.layer == Some(layer) && e.rank == rank && e.kernel_wrote.is_some()
    })?;
    let e = &run.events[i];
    let kernel_wrote = e.kernel_wrote?;
    let consumer = consumers(run, i).first().copied();
    let consumer_read = consumer.and_then(|j| {
        run.events[j]
            .inputs
            .iter()
            .find(|r| r.id == e.output.id)
            .copied()
    });
    Some(AttentionChain {
        kernel_op: e.name.clone(),
        kernel_wrote,
        returned: e.output,
        consumer_op: consumer.map(|j| run.events[j].name.clone()),
        consumer_read,
        connected: kernel_wrote.id == e.output.id && consumer_read.is_some(),
        unwritten: e.stats.unwritten,
    })
}

impl AttentionChain {
    /// One line per link: kernel → wrapper → consumer.
    pub fn describe(&self) -> String {
        let buf = |b: &BufferRef| format!("buffer #{} @{:#x}", b.id.0, b.address);
        let consumer = match (&self.consumer_op, &self.consumer_read) {
            (Some(op), Some(b)) => format!("{op} read {}", buf(b)),
            _ => "no op read it".to_string(),
        };
        format!(
            "attention kernel ({}) wrote {}; the wrapper returned {}{}; {}",
            self.kernel_op,
            buf(&self.kernel_wrote),
            buf(&self.returned),
            if self.unwritten > 0 {
                format!(" ({} elements unwritten)", self.unwritten)
            } else {
                String::new()
            },
            consumer
        )
    }
}
