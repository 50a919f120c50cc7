//! The prefill-then-decode schedule of a run: prefill the first K prompt tokens, feed the rest
//! of the prompt one token at a time through decode, then decode N greedy tokens.

use super::forward::Engine;
use super::trace::{Observer, Phase};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use serde::Serialize;

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// Forward passes the schedule runs: the prefill (if any), then one decode step per token.
    pub fn phases(&self) -> usize {
        usize::from(self.prefill_len > 0) + self.prompt.len() - self.prefill_len + self.decode_steps
    }

    /// The token decode step `k` feeds: a prompt token, or `None` for a generated one.
    fn decode_input(&self, k: usize) -> Option<u32> {
        self.prompt.get(self.prefill_len + k).copied()
    }

    /// The first phase whose ops may differ between a run of `self` and a run of `new`, among
    /// the phases both run; `None` when all of those are the same computation (one schedule
    /// only runs more or fewer decode steps than the other). Phases before it can be taken
    /// from a run of `self`: each phase depends only on the tokens fed so far.
    pub fn first_changed_phase(&self, new: &Schedule) -> Option<Phase> {
        if self.prefill_len != new.prefill_len
            || self.prompt[..self.prefill_len] != new.prompt[..new.prefill_len]
        {
            // From the first phase, whichever it is (`Prefill` orders before every decode step).
            return Some(Phase::Prefill);
        }
        let decodes = |s: &Schedule| s.prompt.len() - s.prefill_len + s.decode_steps;
        // A generated token follows from the phases before it, so two generated inputs agree
        // when everything before them does; a prompt token against a generated one may not.
        (0..decodes(self).min(decodes(new)))
            .find(|&k| self.decode_input(k) != new.decode_input(k))
            .map(Phase::Decode)
    }

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
        let row = logits.row_values(logits.rows() - 1)?;
        let (next, top) = argmax(&row);
        if !real_choice(&row, top) {
            non_finite.push(step);
        }
        last = Some(engine.decode(next as u32, observer)?);
        tokens.push(next as u32);
        generated.push(next as u32);
    }
    let logits = last.expect("the prompt is not empty");
    let row = logits.row_values(logits.rows() - 1)?;
    let (next_token, next_logit) = argmax(&row);
    Ok(Outcome {
        tokens,
        generated,
        non_finite,
        next_token: next_token as u32,
        next_logit,
        next_non_finite: !real_choice(&row, next_logit),
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

    fn schedule(prompt: &[u32], prefill: usize, decode: usize) -> Schedule {
        Schedule {
            prompt: prompt.to_vec(),
            prefill_len: prefill,
            decode_steps: decode,
        }
    }

    #[test]
    fn the_first_phase_a_schedule_change_affects() {
        let base = schedule(&[1, 2, 3, 4], 2, 2);
        assert_eq!(base.phases(), 5);
        // More or fewer decode steps change no phase both run.
        assert_eq!(
            base.first_changed_phase(&schedule(&[1, 2, 3, 4], 2, 6)),
            None
        );
        assert_eq!(
            base.first_changed_phase(&schedule(&[1, 2, 3, 4], 2, 0)),
            None
        );
        // Another prefill changes everything.
        assert_eq!(
            base.first_changed_phase(&schedule(&[1, 2, 3, 4], 3, 2)),
            Some(Phase::Prefill)
        );
        assert_eq!(
            base.first_changed_phase(&schedule(&[1, 9, 3, 4], 2, 2)),
            Some(Phase::Prefill)
        );
        assert_eq!(
            base.first_changed_phase(&schedule(&[1, 2, 3, 4], 0, 2)),
            Some(Phase::Prefill)
        );
        // A prompt token fed through decode: from its step on.
        assert_eq!(
            base.first_changed_phase(&schedule(&[1, 2, 3, 9], 2, 2)),
            Some(Phase::Decode(1))
        );
        // A longer prompt: its extra token meets a generated one.
        assert_eq!(
            base.first_changed_phase(&schedule(&[1, 2, 3, 4, 5], 2, 2)),
            Some(Phase::Decode(2))
        );
        assert_eq!(
            schedule(&[1, 2], 0, 1).first_changed_phase(&schedule(&[1, 2], 0, 3)),
            None
        );
    }
}
