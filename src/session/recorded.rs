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

/// A note typed at a point of the timeline: main run `run`, after its first `op` ops. A tour
/// (`replay --tour`, `}` / `{`) stops at each, moving the selection to the op it is about and
/// switching to the pane it is about; files written before these two existed load without them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Annotation {
    pub run: usize,
    pub op: usize,
    pub text: String,
    /// The op the note is about (the selection when it was typed), in run `run`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub about: Option<super::Cursor>,
    /// The pane the note is about (the one shown when it was typed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pane: Option<Pane>,
}

/// Where a note looks: one of the right-hand tabs, or the Learn view over them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pane {
    Tensor,
    Buffers,
    Compare,
    Learn,
}

impl Pane {
    pub const ALL: [Pane; 4] = [Pane::Tensor, Pane::Buffers, Pane::Compare, Pane::Learn];

    /// The name files and the notes pane use.
    pub fn name(self) -> &'static str {
        match self {
            Pane::Tensor => "tensor",
            Pane::Buffers => "buffers",
            Pane::Compare => "compare",
            Pane::Learn => "learn",
        }
    }
}

/// The notes' places, checked against the runs recorded: a note in a run the timeline does not
/// hold could never be reached (a hand-edited file), so it is named rather than skipped.
pub fn check_annotations(annotations: &[Annotation], runs: &[RecordedRun]) -> Result<(), String> {
    if runs.is_empty() {
        return Ok(());
    }
    let timeline = runs
        .iter()
        .filter(|r| matches!(r.role, RunRole::Main | RunRole::Check))
        .count();
    for (i, a) in annotations.iter().enumerate() {
        if a.run >= timeline {
            return Err(format!(
                "annotations[{i}].run: {} is not a run of this session's timeline (runs 0..{timeline})",
                a.run
            ));
        }
    }
    Ok(())
}

/// What `mladb check` found (the checked run is the session's `Check` run).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedCheck {
    pub findings: Vec<Finding>,
    pub notes: Vec<String>,
    pub tolerance: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::Session;

    /// A version 2 session as written before notes held their op and pane.
    const OLD: &str = r#"// mladb session
(
    version: 2,
    model: Layout(layout: "glm5-tiny", seed: 0),
    prompt: [1, 2, 3],
    prefill: 2,
    decode: 1,
    layers: (0, 1),
    flags: (mla_disable: false, prefill_path: naive, decode_path: absorbed, force_dequant: false, device: cpu, dtype: f32, faults: []),
    annotations: [
        (run: 0, op: 4, text: "an old note"),
    ],
    runs: [],
)
"#;

    #[test]
    fn notes_from_before_op_and_pane_load_without_them() {
        let s = Session::parse(OLD).unwrap();
        assert_eq!(s.annotations.len(), 1);
        let a = &s.annotations[0];
        assert_eq!((a.run, a.op, a.text.as_str()), (0, 4, "an old note"));
        assert_eq!((a.about.clone(), a.pane), (None, None));
    }

    #[test]
    fn op_and_pane_round_trip_and_a_bad_pane_is_named() {
        let mut s = Session::parse(OLD).unwrap();
        s.annotations[0].about = Some(crate::session::Cursor {
            phase: crate::engine::trace::Phase::Decode(0),
            op: "model.layers.0.self_attn.attn_latent".into(),
        });
        s.annotations[0].pane = Some(Pane::Buffers);
        let text = s.to_ron().unwrap();
        assert!(text.contains("pane: Some(buffers)"), "{text}");
        assert_eq!(Session::parse(&text).unwrap(), s);
        for pane in Pane::ALL {
            s.annotations[0].pane = Some(pane);
            let text = s.to_ron().unwrap();
            assert!(text.contains(&format!("pane: Some({})", pane.name())));
            assert_eq!(
                Session::parse(&text).unwrap().annotations[0].pane,
                Some(pane)
            );
        }
        // The loop left the last pane, learn, in place.
        let text = s.to_ron().unwrap();
        assert!(text.contains("pane: Some(learn)"), "{text}");
        let bad = text.replace("pane: Some(learn)", "pane: Some(heatmap)");
        let err = Session::parse(&bad).unwrap_err();
        assert!(err.contains("heatmap") && err.contains("line "), "{err}");
        assert!(err.contains("annotations[0].pane"), "{err}");
    }

    #[test]
    fn a_note_in_a_run_never_recorded_is_refused() {
        let run = RecordedRun {
            role: RunRole::Main,
            flags: crate::debug::Flags::default(),
            poison: true,
            schedule: None,
            first_affected: None,
            started_at: 0,
            compared_with: None,
            outcome: None,
            error: None,
            forced: Vec::new(),
            ops: Vec::new(),
        };
        let note = |run| Annotation {
            run,
            op: 0,
            text: "x".into(),
            about: None,
            pane: None,
        };
        assert!(check_annotations(&[note(0)], std::slice::from_ref(&run)).is_ok());
        let err = check_annotations(&[note(0), note(1)], &[run]).unwrap_err();
        assert!(err.contains("annotations[1].run: 1"), "{err}");
        assert!(
            check_annotations(&[note(5)], &[]).is_ok(),
            "nothing recorded: nothing to check"
        );
    }
}
