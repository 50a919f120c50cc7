//! The op trace: one event per op of the forward pass, in execution order.
//!
//! This is the engine's only output channel to the rest of mladb (debugger, TUI, sessions, `run`):
//! the engine knows nothing of who listens. An [`Observer`] sees each event together with the
//! output tensor itself, and may stop the run by returning an error.

use crate::error::Result;
use crate::stats::TensorStats;
use crate::tensor::{BufferId, DType, Tensor};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Which forward pass an op belongs to. Serialised as its display form, `prefill` or `decode.K`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    Prefill,
    /// The K-th decode step, counted from 0.
    Decode(usize),
}

impl fmt::Display for Phase {
    /// `prefill` or `decode.K`: the PHASE part of dump names.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Phase::Prefill => write!(f, "prefill"),
            Phase::Decode(k) => write!(f, "decode.{k}"),
        }
    }
}

impl std::str::FromStr for Phase {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Phase, String> {
        if s == "prefill" {
            return Ok(Phase::Prefill);
        }
        s.strip_prefix("decode.")
            .and_then(|k| k.parse().ok())
            .map(Phase::Decode)
            .ok_or_else(|| format!("'{s}' is not a phase (prefill or decode.K)"))
    }
}

impl Serialize for Phase {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Phase {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Phase, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// What an op computes; lets consumers treat families of ops alike (e.g. per-head figures for
/// attention ops).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    Embedding,
    RmsNorm,
    LayerNorm,
    Linear,
    Rope,
    /// Rows written to a KV cache.
    CacheWrite,
    /// DSA indexer scores [tokens, context].
    IndexScores,
    /// DSA top-k selection (indices).
    IndexTopK,
    /// W_UK folded into the query (absorbed path).
    AbsorbQuery,
    /// Decompressed per-head keys/values (naive path).
    Decompress,
    /// A quantized weight turned into a plain one (kv_b_proj: through the identity matrix, or
    /// force-dequantized).
    Dequantize,
    /// Softmax probabilities [heads, tokens, context].
    AttentionProbs,
    /// Attention output per head, before o_proj.
    Attention,
    /// Latent attention output (absorbed path), before W_UV.
    AttentionLatent,
    /// A fast attention kernel's log-sum-exp (natural log) per query and head, [tokens, heads]:
    /// what production kernels keep of the softmax instead of the probabilities.
    AttentionLse,
    /// A split-KV decode's partial results before the merge: each split's normalised latent
    /// output [tokens, splits, heads, L] (`attn_partials`, bf16 on the GPU, as the kernels write
    /// it), or its log-sum-exp [tokens, splits, heads] (`attn_partials_lse`).
    AttentionPartials,
    /// The rows past the real ones of a fast decode batch padded to a CUDA-graph capture size
    /// (sequences of no keys), [pad, heads, L]: zeros when written (`attn_padding`).
    AttentionPadding,
    /// A split-KV decode's merge: what the merge kernel wrote, [tokens, heads, L], in the buffer
    /// it was handed (`attn_merge`; the wrapper's output unless the two are disconnected).
    AttentionMerge,
    Residual,
    Activation,
    /// MoE router: chosen experts' weights and ids.
    Router,
    /// One routed expert's output: the down projection of the tokens routed to it [its tokens,
    /// hidden], before their routing weights.
    Expert,
    /// The routed experts' outputs weighted and summed per token.
    Experts,
    Sum,
    Logits,
    /// A tensor-parallel all-reduce: the ranks' partial sums summed, on every rank.
    AllReduce,
    /// A tensor-parallel all-gather: the ranks' parts side by side, on every rank.
    AllGather,
}

impl OpKind {
    /// The kind's name as the trace serialises it (`attention_probs`).
    pub fn name(self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default()
    }
}

/// Where an op's output lives, or what it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferRef {
    pub id: BufferId,
    /// Host address, or the device pointer for device buffers.
    pub address: u64,
    pub bytes: usize,
    pub device: Device,
    /// The CUDA device's ordinal (0 on the host, and in sessions recorded before ranks had
    /// devices of their own).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub device_index: usize,
    pub role: BufferRole,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// What a buffer holds. An activation read by an op must have been written by an earlier op
/// (or the same buffer would be a disconnect); weights and caches live across ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BufferRole {
    Activation,
    Weight,
    Cache,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    Cpu,
    Cuda,
}

impl BufferRef {
    /// An activation tensor: its device copy when it has one (the buffer the kernels used),
    /// else its host buffer.
    pub fn of(t: &Tensor) -> BufferRef {
        match t.device() {
            Some(d) => BufferRef {
                id: t.id(),
                address: d.address(),
                bytes: d.bytes(),
                device: Device::Cuda,
                device_index: d.device_index(),
                role: BufferRole::Activation,
            },
            None => BufferRef {
                id: t.id(),
                address: t.address(),
                bytes: t.size_bytes(),
                device: Device::Cpu,
                device_index: 0,
                role: BufferRole::Activation,
            },
        }
    }

    /// A weight tensor.
    pub fn weight(t: &Tensor) -> BufferRef {
        BufferRef {
            role: BufferRole::Weight,
            ..BufferRef::of(t)
        }
    }

    /// A KV cache's copy on device `device_index` (or what a kernel reads with it: the block
    /// table).
    pub fn device_cache(
        id: BufferId,
        address: u64,
        bytes: usize,
        device_index: usize,
    ) -> BufferRef {
        BufferRef {
            device: Device::Cuda,
            device_index,
            ..BufferRef::cache(id, address, bytes)
        }
    }

    /// A KV cache buffer.
    pub fn cache(id: BufferId, address: u64, bytes: usize) -> BufferRef {
        BufferRef {
            id,
            address,
            bytes,
            device: Device::Cpu,
            device_index: 0,
            role: BufferRole::Cache,
        }
    }
}

/// One op of the forward pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpEvent {
    /// Position in the run's trace, from 0.
    pub index: usize,
    pub phase: Phase,
    /// Decoder layer, or `None` for ops outside the layers (embedding, final norm, logits).
    pub layer: Option<usize>,
    /// The tensor-parallel rank that ran the op; `None` in a run without tensor parallelism.
    /// An op's identity in a run is its phase, rank and name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<usize>,
    /// HF module name where a module exists (`model.layers.3.self_attn.kv_a_proj_with_mqa`),
    /// else a sub-op name under it (`model.layers.3.self_attn.q_absorbed`).
    pub name: String,
    pub kind: OpKind,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub stats: TensorStats,
    /// The buffer the op handed on to its consumers.
    pub output: BufferRef,
    /// For an op that hands a kernel an output buffer: the buffer the kernel really wrote. It
    /// differs from `output` exactly when the two are disconnected.
    pub kernel_wrote: Option<BufferRef>,
    pub inputs: Vec<BufferRef>,
    /// Token positions this op covers: start..end.
    pub positions: (usize, usize),
    /// The output was taken from an earlier run instead of being computed (re-execution after a
    /// flag change starts at the first op the change affects).
    #[serde(default)]
    pub replayed: bool,
    /// For an attention op on the GPU: which kernels ran it and how they were launched, or why
    /// the fast kernel declined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<crate::ops::KernelInfo>,
}

impl OpEvent {
    /// Whether a fast (production) attention kernel ran this op.
    pub fn ran_fast_kernel(&self) -> bool {
        self.kernel.as_ref().is_some_and(|k| !k.launches.is_empty())
    }

    /// Why the reference attention kernel ran this op on a device backend, where it did.
    pub fn reference_reason(&self) -> Option<&str> {
        self.kernel.as_ref()?.reference.as_deref()
    }

    /// `PHASE/OPNAME`, the public name of this op's output in dumps; `PHASE/OPNAME@rankR` for
    /// a tensor-parallel rank's op (every rank runs an op of the same name).
    pub fn dump_name(&self) -> String {
        match self.rank {
            Some(r) => format!("{}/{}@rank{r}", self.phase, self.name),
            None => format!("{}/{}", self.phase, self.name),
        }
    }
}

/// Outputs of an earlier run that a new run may take instead of computing them: the ops before
/// the first op a flag change affects.
pub trait Replay: Sync {
    /// The earlier event and output at `index`, if it may be reused for op `name` of `phase`.
    fn lookup(&self, index: usize, phase: Phase, name: &str) -> Option<(&OpEvent, &Tensor)>;
}

/// Receives every op event with the op's output. Returning an error stops the run.
pub trait Observer {
    fn on_op(&mut self, event: &OpEvent, output: &Tensor) -> Result<()>;

    /// A forward pass of `phase` begins (before its first op): what the host did since the last
    /// op, such as sampling the previous step's token, belongs to no op.
    fn on_pass_start(&mut self, _phase: Phase) {}

    /// Whether events need their statistics (one pass over every output). An observer that
    /// never reads them says no, and the run skips that pass.
    fn wants_stats(&self) -> bool {
        true
    }

    /// Whether events may reach the observer late: in order, at most [`LATE_EVENTS`] ops or the
    /// end of the forward pass after their op ran, with statistics computed on the device as
    /// the op ran and brought back many at a time (one wait for many ops instead of one each).
    /// The output then passed is the op's buffer as it is at delivery, so an observer that
    /// reads or keeps outputs says no (the default).
    fn takes_late_events(&self) -> bool {
        false
    }
}

/// Events that an observer taking late events may wait for at most.
pub const LATE_EVENTS: usize = 256;

/// Ignores everything (events come without statistics).
pub struct NullObserver;

impl Observer for NullObserver {
    fn on_op(&mut self, _: &OpEvent, _: &Tensor) -> Result<()> {
        Ok(())
    }

    fn wants_stats(&self) -> bool {
        false
    }
}

/// Takes every event with its statistics and keeps nothing: what capturing the trace costs.
pub struct StatsObserver {
    pub events: usize,
}

impl Observer for StatsObserver {
    fn on_op(&mut self, event: &OpEvent, _: &Tensor) -> Result<()> {
        self.events += 1;
        std::hint::black_box(&event.stats);
        Ok(())
    }

    fn takes_late_events(&self) -> bool {
        true
    }
}

/// Keeps every event and a copy of every output: for tests and dumps of small models.
#[derive(Default)]
pub struct Recorder {
    pub events: Vec<OpEvent>,
    pub outputs: Vec<Tensor>,
}

impl Observer for Recorder {
    fn on_op(&mut self, event: &OpEvent, output: &Tensor) -> Result<()> {
        self.events.push(event.clone());
        self.outputs.push(output.clone());
        Ok(())
    }
}

impl Recorder {
    /// The output of the op named `name` in `phase`.
    pub fn output(&self, phase: Phase, name: &str) -> Option<&Tensor> {
        self.events
            .iter()
            .position(|e| e.phase == phase && e.name == name)
            .map(|i| &self.outputs[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer on device 0 is written as before ranks had devices (sessions stay readable both
    /// ways); one on another device says which.
    #[test]
    fn a_buffer_names_its_device_only_past_the_first() {
        let first = BufferRef::device_cache(BufferId(7), 0xA000, 64, 0);
        let text = serde_json::to_string(&first).unwrap();
        assert!(!text.contains("device_index"), "{text}");
        assert_eq!(serde_json::from_str::<BufferRef>(&text).unwrap(), first);
        let second = BufferRef::device_cache(BufferId(7), 0xA000, 64, 1);
        let text = serde_json::to_string(&second).unwrap();
        assert!(text.contains("\"device_index\":1"), "{text}");
        assert_eq!(serde_json::from_str::<BufferRef>(&text).unwrap(), second);
    }
}
