//! `mladb bench --op-times`: where a layer's time goes, op by op. The device is synchronised
//! after every op, so each op is charged its own kernels (and its host work) and nothing of the
//! next; that serialises what a normal run overlaps, so the sum exceeds the plain timing a
//! little. A profile for finding what to make faster, not a figure to report.

use super::Out;
use crate::backend::Backend;
use crate::engine::trace::{Observer, OpEvent, Phase};
use crate::error::Result;
use crate::tensor::Tensor;
use std::collections::HashMap;
use std::time::Instant;

/// Wall time per op name (the layer's prefix taken off, so layers add up), per phase kind, and
/// the host's part of it: the time until the op was handed to the observer, before the wait
/// (the device was idle at its start, so that is what the host spent issuing the op, plus any
/// wait of its own, such as the router's ids coming back).
pub struct OpTimer<'b> {
    backend: &'b dyn Backend,
    last: Instant,
    /// (decode?, op name) → (calls, seconds, host seconds).
    times: HashMap<(bool, String), (usize, f64, f64)>,
}

impl<'b> OpTimer<'b> {
    pub fn new(backend: &'b dyn Backend) -> OpTimer<'b> {
        OpTimer {
            backend,
            last: Instant::now(),
            times: HashMap::new(),
        }
    }

    /// Starts the clock afresh (before a run, after the set-up that is not an op).
    pub fn restart(&mut self) -> Result<()> {
        self.backend.synchronize()?;
        self.last = Instant::now();
        Ok(())
    }

    /// The ops of one phase kind, slowest first: (name, calls, seconds, host seconds).
    pub fn slowest(&self, decode: bool) -> Vec<(String, usize, f64, f64)> {
        let mut rows: Vec<(String, usize, f64, f64)> = self
            .times
            .iter()
            .filter(|((d, _), _)| *d == decode)
            .map(|((_, name), &(calls, secs, host))| (name.clone(), calls, secs, host))
            .collect();
        rows.sort_by(|a, b| b.2.total_cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
        rows
    }
}

/// `model.layers.3.self_attn.q_a_proj` → `self_attn.q_a_proj`.
fn without_layer(name: &str) -> &str {
    let Some(rest) = name.strip_prefix("model.layers.") else {
        return name;
    };
    rest.split_once('.').map_or(name, |(_, op)| op)
}

impl Observer for OpTimer<'_> {
    fn on_op(&mut self, event: &OpEvent, _: &Tensor) -> Result<()> {
        let issued = Instant::now();
        self.backend.synchronize()?;
        let now = Instant::now();
        let decode = matches!(event.phase, Phase::Decode(_));
        let slot = self
            .times
            .entry((decode, without_layer(&event.name).to_string()))
            .or_default();
        slot.0 += 1;
        slot.1 += (now - self.last).as_secs_f64();
        slot.2 += (issued - self.last).as_secs_f64();
        self.last = now;
        Ok(())
    }

    fn wants_stats(&self) -> bool {
        false
    }
}

/// Prints the slowest ops of the prefill and of a decode step (`steps` decode steps ran; ms per
/// step, summed over the layers run), with their share of the phase.
pub fn print(timer: &OpTimer, layers: usize, steps: usize) -> Result<()> {
    for (decode, what, per) in [
        (false, "the prefill", 1),
        (true, "a decode step", steps.max(1)),
    ] {
        let rows = timer.slowest(decode);
        let total: f64 = rows.iter().map(|r| r.2).sum();
        let host: f64 = rows.iter().map(|r| r.3).sum();
        if rows.is_empty() {
            continue;
        }
        writeln!(
            Out,
            "\nops of {what} over {layers} layer(s), the device synchronised after each op: {:.3} ms in all, {:.3} ms of it on the host before the wait",
            total / per as f64 * 1e3,
            host / per as f64 * 1e3
        )?;
        writeln!(
            Out,
            "{:<44} {:>6} {:>10} {:>7} {:>10}",
            "op", "calls", "ms", "share", "host ms"
        )?;
        for (name, calls, secs, host) in rows.iter().take(32) {
            writeln!(
                Out,
                "{name:<44} {:>6} {:>10.3} {:>6.1}% {:>10.3}",
                calls / per,
                secs / per as f64 * 1e3,
                100.0 * secs / total.max(f64::MIN_POSITIVE),
                host / per as f64 * 1e3
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_prefixes_are_taken_off_and_other_names_kept() {
        assert_eq!(
            without_layer("model.layers.12.self_attn.q_a_proj"),
            "self_attn.q_a_proj"
        );
        assert_eq!(without_layer("model.layers.3.mlp"), "mlp");
        assert_eq!(without_layer("model.embed_tokens"), "model.embed_tokens");
        assert_eq!(without_layer("model.layers.7"), "model.layers.7");
    }
}
