//! Recorded results (session format v2): every run of a session with its flags, where its flag
//! set took effect, its outcome, and per op the trace event (statistics, buffers) with a bounded
//! sample of the output's values, so a session replays without recomputation. Full tensors
//! optionally go to a companion safetensors file.

use crate::debug::detect::Finding;
use crate::debug::{Flags, RunRecord};
use crate::engine::generate::{Outcome, Schedule};
use crate::engine::trace::OpEvent;
use crate::tensor::Tensor;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

pub use crate::debug::sample::{is_sampled, sample_indices, sample_of, SAMPLE_EDGE, SAMPLE_SPREAD};

/// Why a run is in the session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RunRole {
    /// A run of the debugging timeline (run N of the controller's history, or the current one).
    Main,
    /// A comparison run computed for main run `of`: `other-path` (every phase on the other MLA
    /// path) or `whole-prefill` (the whole sequence prefilled at once).
    Aux { of: usize, kind: String },
    /// A run `mladb check` made; its findings are the session's.
    Check,
}

/// The schedule of a run whose tokens differ from the session's (comparison runs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedSchedule {
    pub prompt: Vec<u32>,
    pub prefill: usize,
    pub decode: usize,
}

impl RecordedSchedule {
    pub fn of(s: &Schedule) -> RecordedSchedule {
        RecordedSchedule {
            prompt: s.prompt.clone(),
            prefill: s.prefill_len,
            decode: s.decode_steps,
        }
    }

    pub fn schedule(&self) -> Schedule {
        Schedule {
            prompt: self.prompt.clone(),
            prefill_len: self.prefill,
            decode_steps: self.decode,
        }
    }
}

/// What a finished run produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedOutcome {
    pub tokens: Vec<u32>,
    pub generated: Vec<u32>,
    /// Indices into `generated` of tokens taken from non-finite logits (not real tokens).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub non_finite: Vec<usize>,
    pub next_token: u32,
    pub next_logit: f32,
    /// `next_token` was taken from non-finite logits.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub next_non_finite: bool,
    /// The prompt and the generated tokens as text, when the run had a tokenizer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TokenText>,
}

/// A run's tokens as text: the prompt whole, each generated token on its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenText {
    pub prompt: String,
    pub generated: Vec<String>,
}

impl TokenText {
    pub fn of(
        codec: &crate::model::tokenizer::TextCodec,
        prompt: &[u32],
        generated: &[u32],
    ) -> TokenText {
        TokenText {
            prompt: codec.decode(prompt),
            generated: codec.pieces(generated),
        }
    }
}

impl From<&Outcome> for RecordedOutcome {
    fn from(o: &Outcome) -> RecordedOutcome {
        RecordedOutcome {
            tokens: o.tokens.clone(),
            generated: o.generated.clone(),
            non_finite: o.non_finite.clone(),
            next_token: o.next_token,
            next_logit: o.next_logit,
            next_non_finite: o.next_non_finite,
            text: None,
        }
    }
}

impl From<&RecordedOutcome> for Outcome {
    fn from(o: &RecordedOutcome) -> Outcome {
        Outcome {
            tokens: o.tokens.clone(),
            generated: o.generated.clone(),
            non_finite: o.non_finite.clone(),
            next_token: o.next_token,
            next_logit: o.next_logit,
            next_non_finite: o.next_non_finite,
        }
    }
}

/// One op: its trace event (phase, layer, name, kind, shape, dtype, statistics, buffers with ids
/// and pointers, positions) and a sample of its output (see [`sample_indices`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedOp {
    pub event: OpEvent,
    pub sample: Vec<f32>,
}

/// One run: one execution under one flag set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedRun {
    pub role: RunRole,
    pub flags: Flags,
    /// Buffers were poisoned (unwritten elements show); the debugger and `check` poison, `run`
    /// does not.
    pub poison: bool,
    /// `None`: the session's schedule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<RecordedSchedule>,
    /// The op index from which this run's flag set took effect: ops before it were taken from
    /// the previous run (a live flag change re-executes from the first op it affects).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_affected: Option<usize>,
    /// How many ops the run held when it became the current run (after the flag change or
    /// restart that made it): where replay starts it.
    #[serde(default)]
    pub started_at: usize,
    /// The earlier main run it was compared with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compared_with: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<RecordedOutcome>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Choices the run was made to take (a comparison run forced to the examined run's choice
    /// where the two flipped within noise); a recomputation makes them again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forced: Vec<crate::engine::ForcedChoice>,
    pub ops: Vec<RecordedOp>,
}

impl RecordedRun {
    /// Records a run (samples of every output).
    pub fn of(record: &RunRecord, role: RunRole, poison: bool) -> RecordedRun {
        RecordedRun {
            role,
            flags: record.flags,
            poison,
            schedule: None,
            first_affected: None,
            started_at: record.len(),
            compared_with: None,
            outcome: record.outcome.as_ref().map(RecordedOutcome::from),
            error: record.error.clone(),
            forced: record.forced.entries(),
            ops: record
                .events
                .iter()
                .zip(&record.outputs)
                .map(|(e, o)| RecordedOp {
                    event: e.clone(),
                    sample: sample_of(o.data()),
                })
                .collect(),
        }
    }

    pub fn is_main(&self) -> bool {
        self.role == RunRole::Main
    }

    /// The run as the debugger keeps it, with outputs from `tensors` where given (full tensors
    /// from the companion file), else built from the samples: whole when the sample holds every
    /// value, else a 1-D tensor of the sampled values (the UI shows what it can of those).
    pub fn to_record(&self, tensors: Option<&[Arc<Tensor>]>) -> RunRecord {
        let mut r = RunRecord::new(self.flags);
        for (i, op) in self.ops.iter().enumerate() {
            let out = match tensors.and_then(|t| t.get(i)) {
                Some(t) => t.clone(),
                None => Arc::new(sampled_tensor(op)),
            };
            r.push(op.event.clone(), out);
        }
        r.outcome = self.outcome.as_ref().map(Outcome::from);
        r.error = self.error.clone();
        r
    }
}

/// The output of a recorded op rebuilt from its sample: the real shape when the sample is whole.
pub fn sampled_tensor(op: &RecordedOp) -> Tensor {
    let numel: usize = op.event.shape.iter().product();
    if op.sample.len() == numel {
        Tensor::from_vec(&op.event.shape, op.sample.clone())
    } else {
        Tensor::from_vec(&[op.sample.len()], op.sample.clone())
    }
}

/// A note typed at a point of the timeline: main run `run`, after its first `op` ops.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Annotation {
    pub run: usize,
    pub op: usize,
    pub text: String,
}

/// What `mladb check` found (the checked run is the session's `Check` run).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedCheck {
    pub findings: Vec<Finding>,
    pub notes: Vec<String>,
    pub tolerance: f64,
}
