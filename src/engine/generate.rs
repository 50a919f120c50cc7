//! The prefill-then-decode schedule of a run: prefill the first K prompt tokens, feed the rest
//! of the prompt one token at a time through decode, then decode N greedy tokens.

use super::forward::Engine;
use super::trace::Observer;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use serde::Serialize;

/// What to run.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub prompt: Vec<u32>,
    /// Prompt tokens prefilled at once (the rest go through decode).
    pub prefill_len: usize,
    /// Greedy tokens to generate after the prompt.
    pub decode_steps: usize,
}

/// Longest sequence a run may ask for (prompt + generated).
pub const MAX_SEQUENCE: usize = 1 << 20;

/// What a run produced.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// Every token fed to the model, in order (prompt, then generated).
    pub tokens: Vec<u32>,
    /// The generated tokens.
    pub generated: Vec<u32>,
    /// argmax of the last logits: the token that would come next.
    pub next_token: u32,
    /// Top logit of the last step.
    pub next_logit: f32,
}

impl Schedule {
    pub fn validate(&self) -> Result<()> {
        if self.prompt.is_empty() {
            return Err(Error::invalid("the prompt is empty"));
        }
        if self.prefill_len > self.prompt.len() {
            return Err(Error::invalid(format!(
                "--prefill {} is longer than the {}-token prompt",
                self.prefill_len,
                self.prompt.len()
            )));
        }
        if self.prompt.len().saturating_add(self.decode_steps) > MAX_SEQUENCE {
            return Err(Error::invalid(format!(
                "a run is limited to {MAX_SEQUENCE} tokens in all"
            )));
        }
        Ok(())
    }
}

/// Index and value of the largest element (ties go to the lower index; NaN never wins).
pub fn argmax(row: &[f32]) -> (usize, f32) {
    let mut best = (0, f32::NEG_INFINITY);
    for (i, &v) in row.iter().enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best
}

/// Runs the schedule on a fresh engine.
pub fn run(
    engine: &mut Engine,
    schedule: &Schedule,
    observer: &mut dyn Observer,
) -> Result<Outcome> {
    schedule.validate()?;
    let mut tokens = Vec::new();
    let mut last: Option<Tensor> = None;
    if schedule.prefill_len > 0 {
        let prefix = &schedule.prompt[..schedule.prefill_len];
        last = Some(engine.prefill(prefix, observer)?);
        tokens.extend_from_slice(prefix);
    }
    for &t in &schedule.prompt[schedule.prefill_len..] {
        last = Some(engine.decode(t, observer)?);
        tokens.push(t);
    }
    let mut generated = Vec::new();
    for _ in 0..schedule.decode_steps {
        let logits = last.as_ref().expect("the prompt is not empty");
        let (next, _) = argmax(logits.row(logits.rows() - 1));
        last = Some(engine.decode(next as u32, observer)?);
        tokens.push(next as u32);
        generated.push(next as u32);
    }
    let logits = last.expect("the prompt is not empty");
    let (next_token, next_logit) = argmax(logits.row(logits.rows() - 1));
    Ok(Outcome {
        tokens,
        generated,
        next_token: next_token as u32,
        next_logit,
    })
}
