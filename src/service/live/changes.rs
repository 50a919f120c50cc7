//! What `:set` changes (a flag, the injected faults, the schedule), `:goto`, and the report of
//! flags that had nothing to act on.

use super::Host;
use crate::debug::controller::FlagChange;
use crate::engine::faults::{parse_spec, Fault, Faults};
use crate::error::{Error, Result};
use crate::service::{DebugService, Update};
use crate::setup::parse_tokens_for;

/// The schedule's keys `:set` takes besides the flags.
pub const SCHEDULE_KEYS: &[&str] = &["tokens", "prefill", "decode"];

/// The faults after the debugger's `:set inject VALUE`: `NAME[@SCOPE]` replaces the faults
/// injected so far, `+NAME[@SCOPE]` adds one (or changes its scope), `-NAME` removes one, `none`
/// clears them all. Also returns what was replaced, when anything was.
pub fn inject(faults: Faults, value: &str) -> Result<(Faults, Option<Faults>)> {
    if value == "none" {
        return Ok((Faults::none(), None));
    }
    if let Some(name) = value.strip_prefix('-') {
        let name = name.split('@').next().unwrap_or_default();
        return Ok((faults.without(name.parse::<Fault>()?), None));
    }
    if let Some(spec) = value.strip_prefix('+') {
        let (fault, scope) = parse_spec(spec)?;
        return Ok((faults.with_scope(fault, scope), None));
    }
    let (fault, scope) = parse_spec(value)?;
    let new = Faults::none().with(fault, scope);
    let replaced = (!faults.is_empty() && faults != new).then_some(faults);
    Ok((new, replaced))
}

impl Host {
    /// `:set KEY VALUE`: a flag, the faults or the schedule; re-executes and says how.
    pub(super) fn set(&mut self, key: &str, value: &str) -> Result<()> {
        if SCHEDULE_KEYS.contains(&key) {
            return self.set_schedule(key, value);
        }
        let change = if key == "inject" {
            let mut flags = self.controller.flags();
            let (faults, replaced) = inject(flags.faults, value)?;
            flags.faults = faults;
            let change = self.controller.set_flags(flags)?;
            if let Some(old) = replaced {
                self.log(format!(
                    "inject {value} replaces {old} (`:set inject +{value}` adds it instead)"
                ));
            }
            change
        } else {
            self.controller.set_flag(key, value)?
        };
        self.changed(&format!("{key} {value}"), &change);
        Ok(())
    }

    /// `:set tokens 3,141,59`, `:set prefill K`, `:set decode N`.
    fn set_schedule(&mut self, key: &str, value: &str) -> Result<()> {
        let c = &self.controller;
        let mut schedule = c.schedule().clone();
        let number = || {
            value
                .trim()
                .parse::<usize>()
                .map_err(|_| Error::invalid(format!("set {key}: '{value}' is not a whole number")))
        };
        match key {
            "tokens" => {
                schedule.prompt = parse_tokens_for(value, &c.model().layout)?;
                if schedule.prefill_len > schedule.prompt.len() {
                    self.log(format!(
                        "prefill {} → {}: the prompt has {} tokens",
                        schedule.prefill_len,
                        schedule.prompt.len(),
                        schedule.prompt.len()
                    ));
                    schedule.prefill_len = schedule.prompt.len();
                }
            }
            "prefill" => schedule.prefill_len = number()?,
            _ => schedule.decode_steps = number()?,
        }
        if schedule == *c.schedule() {
            self.log(format!("{key} {value}: the schedule is unchanged"));
            return Ok(());
        }
        // A prompt too long for memory (beside the reference dump's values, if one is held) is
        // refused before the worker allocates for it.
        crate::memory::check_beside(
            self.controller.model(),
            schedule.prompt.len().saturating_add(schedule.decode_steps),
            self.controller.layers(),
            self.max_memory_gb,
            self.reference.as_ref().map_or(0, |r| r.value_bytes()),
        )?;
        let change = self.controller.set_schedule(schedule.clone())?;
        (self.send)(Update::Schedule(schedule));
        self.changed(&format!("{key} {value}"), &change);
        Ok(())
    }

    /// Reports a re-execution: the new run, its flags, what was computed and reused.
    fn changed(&mut self, what: &str, change: &FlagChange) {
        self.note_run_start(change.first_affected.as_ref().map(|f| f.0));
        let c = &self.controller;
        (self.send)(Update::Flags(c.flags()));
        (self.send)(Update::Comparison(c.history().len().checked_sub(1)));
        let (executed, replayed) = (change.executed, change.replayed);
        match &change.first_affected {
            Some((0, ..)) => self.log(format!(
                "{what}: re-executed from the start: {executed} ops computed"
            )),
            Some((i, phase, op)) => self.log(format!(
                "{what}: re-executed from op #{i} ({phase} {op}): {executed} ops computed, {replayed} reused"
            )),
            None if executed > 0 => self.log(format!(
                "{what}: no op so far is affected; {replayed} ops reused, {executed} computed"
            )),
            None if replayed > 0 => self.log(format!(
                "{what}: no op so far is affected; {replayed} ops reused"
            )),
            None => {}
        }
        self.finish_if_done();
    }

    /// `:goto N` (op index).
    pub(super) fn goto(&mut self, index: usize) -> Result<()> {
        let c = &self.controller;
        if index >= c.current().len() {
            if c.finished() {
                return Err(Error::invalid(format!(
                    "goto {index}: the run has ops #0..#{}",
                    c.current().len().saturating_sub(1)
                )));
            }
            self.stopped(|c| c.run_to(index));
        }
        if let Some(e) = self.controller.current().events.get(index) {
            self.log(format!("goto #{index}: {} {}", e.phase, e.name));
            (self.send)(Update::Select(index));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::faults::Scope;

    #[test]
    fn set_inject_replaces_adds_rescopes_and_removes() {
        let one = inject(Faults::none(), "softmax-scale-latent").unwrap();
        assert_eq!(
            (one.0.to_string().as_str(), one.1),
            ("softmax-scale-latent", None)
        );
        let (two, replaced) = inject(one.0, "skip-padded-rows").unwrap();
        assert_eq!(two.to_string(), "skip-padded-rows");
        assert_eq!(replaced.unwrap().to_string(), "softmax-scale-latent");
        let (both, _) = inject(two, "+softmax-scale-latent@decode").unwrap();
        assert_eq!(
            both.to_string(),
            "softmax-scale-latent@decode,skip-padded-rows"
        );
        let (rescoped, _) = inject(both, "+skip-padded-rows@both").unwrap();
        assert_eq!(rescoped.scope(Fault::SkipPaddedRows), Some(Scope::All));
        let (fewer, _) = inject(rescoped, "-softmax-scale-latent").unwrap();
        assert_eq!(fewer.to_string(), "skip-padded-rows@both");
        assert!(inject(fewer, "none").unwrap().0.is_empty());
        assert!(inject(fewer, "gremlins").is_err());
        assert!(inject(fewer, "+skip-padded-rows@later").is_err());
    }
}
