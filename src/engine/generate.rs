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
    /// Indices into `generated` of the tokens taken from non-finite logits (see
    /// [`real_choice`]): greedy decoding had nothing to choose from, so they are not real tokens
    /// (they were still fed, so that the schedule runs to its end).
    pub non_finite: Vec<usize>,
    /// argmax of the last logits: the token that would come next.
    pub next_token: u32,
    /// Top logit of the last step.
    pub next_logit: f32,
    /// `next_token` was taken from non-finite logits.
    pub next_non_finite: bool,
}

impl Outcome {
    /// The generated tokens for a reader: `none` where a token came from non-finite logits,
    /// then how many did: `[12, none] (1 of 2 taken from non-finite logits: not real tokens)`.
    pub fn generated_text(&self) -> String {
        let shown: Vec<String> = self
            .generated_or_none()
            .iter()
            .map(|t| t.map_or("none".to_string(), |t| t.to_string()))
            .collect();
        let mut s = format!("[{}]", shown.join(", "));
        if !self.non_finite.is_empty() {
            s.push_str(&format!(
                " ({} of {} taken from non-finite logits: not real tokens)",
                self.non_finite.len(),
                self.generated.len()
            ));
        }
        s
    }

    /// The generated tokens with `None` for those taken from non-finite logits (for JSON).
    pub fn generated_or_none(&self) -> Vec<Option<u32>> {
        self.generated
            .iter()
            .enumerate()
            .map(|(i, &t)| (!self.non_finite.contains(&i)).then_some(t))
            .collect()
    }

    /// `1728`, or `none (non-finite logits)`.
    pub fn next_text(&self) -> String {
        if self.next_non_finite {
            "none (non-finite logits)".to_string()
        } else {
            self.next_token.to_string()
        }
    }
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

/// Whether greedy decoding really chose from this row of logits, whose largest value is `top`:
/// not when any logit is NaN (the order is undefined) or the largest is not finite (all NaN or
/// −∞, or an overflow to +∞).
pub fn real_choice(row: &[f32], top: f32) -> bool {
    top.is_finite() && !row.iter().any(|v| v.is_nan())
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
    let mut non_finite = Vec::new();
    for step in 0..schedule.decode_steps {
        let logits = last.as_ref().expect("the prompt is not empty");
        let row = logits.row(logits.rows() - 1);
        let (next, top) = argmax(row);
        if !real_choice(row, top) {
            non_finite.push(step);
        }
        last = Some(engine.decode(next as u32, observer)?);
        tokens.push(next as u32);
        generated.push(next as u32);
    }
    let logits = last.expect("the prompt is not empty");
    let row = logits.row(logits.rows() - 1);
    let (next_token, next_logit) = argmax(row);
    Ok(Outcome {
        tokens,
        generated,
        non_finite,
        next_token: next_token as u32,
        next_logit,
        next_non_finite: !real_choice(row, next_logit),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_choice_from_non_finite_logits_is_not_real() {
        let nan = f32::NAN;
        for (row, real) in [
            (vec![0.5, 2.0, -1.0], true),
            // Masked entries do not spoil the choice among the rest.
            (vec![f32::NEG_INFINITY, 2.0, -1.0], true),
            (vec![0.5, nan, -1.0], false),
            (vec![nan, nan, nan], false),
            (vec![f32::NEG_INFINITY; 3], false),
            (vec![0.5, f32::INFINITY, -1.0], false),
        ] {
            let (_, top) = argmax(&row);
            assert_eq!(real_choice(&row, top), real, "{row:?}");
        }
        let o = Outcome {
            tokens: vec![1, 2, 7, 0],
            generated: vec![7, 0],
            non_finite: vec![1],
            next_token: 0,
            next_logit: f32::NEG_INFINITY,
            next_non_finite: true,
        };
        assert_eq!(
            o.generated_text(),
            "[7, none] (1 of 2 taken from non-finite logits: not real tokens)"
        );
        assert_eq!(o.generated_or_none(), vec![Some(7), None]);
        assert_eq!(o.next_text(), "none (non-finite logits)");
    }
}
