//! `mladb bench --op-times`: where a layer's time goes, op by op. The device is synchronised
//! after every op, so each op is charged its own kernels (and its host work) and nothing of the
//! next; that serialises what a normal run overlaps, so the sum exceeds the plain timing a
//! little. A profile for finding what to make faster, not a figure to report.

use super::Out;
use crate::backend::{Backend, DriverCall, DriverCalls};
use crate::engine::trace::{Observer, OpEvent, Phase};
use crate::error::Result;
use crate::tensor::Tensor;
use std::collections::HashMap;
use std::time::Instant;

/// Wall time per op name (the layer's prefix taken off, so layers add up), per phase kind, and
/// the host's part of it: the time until the op was handed to the observer, before the wait
/// (the device was idle at its start, so that is what the host spent issuing the op, plus any
/// wait of its own, such as the router's ids coming back); and of that, the calls into the
/// driver and their time, where the backend has a device.
pub struct OpTimer<'b> {
    backend: &'b dyn Backend,
    last: Instant,
    /// The driver's calls until `last` (before the wait that closed the op).
    calls: Option<DriverCalls>,
    /// (decode?, op name) → its times.
    times: HashMap<(bool, String), OpTime>,
}

/// What an op took over its calls.
#[derive(Default, Clone)]
pub struct OpTime {
    pub calls: usize,
    pub seconds: f64,
    pub host_seconds: f64,
    /// The driver's calls issuing it (the wait that closes it left out).
    pub driver: DriverCalls,
}

impl<'b> OpTimer<'b> {
    pub fn new(backend: &'b dyn Backend) -> OpTimer<'b> {
        OpTimer {
            backend,
            last: Instant::now(),
            calls: backend.driver_calls(),
            times: HashMap::new(),
        }
    }

    /// Starts the clock afresh (before a run, after the set-up that is not an op).
    pub fn restart(&mut self) -> Result<()> {
        self.backend.synchronize()?;
        self.last = Instant::now();
        self.calls = self.backend.driver_calls();
        Ok(())
    }

    /// The ops of one phase kind, slowest first.
    pub fn slowest(&self, decode: bool) -> Vec<(String, OpTime)> {
        let mut rows: Vec<(String, OpTime)> = self
            .times
            .iter()
            .filter(|((d, _), _)| *d == decode)
            .map(|((_, name), t)| (name.clone(), t.clone()))
            .collect();
        rows.sort_by(|a, b| {
            (b.1.seconds)
                .total_cmp(&a.1.seconds)
                .then_with(|| a.0.cmp(&b.0))
        });
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

/// The row that takes the host's time between passes (sampling the last step's token, setting
/// up the next pass), which belongs to no op.
const BETWEEN_PASSES: &str = "(between passes: sampling, set-up)";

impl OpTimer<'_> {
    /// Charges row `name` of the phase kind with the time since the last charge: in all until
    /// `done`, on the host until `issued`, and the driver's calls made until `calls` was read.
    fn charge(
        &mut self,
        decode: bool,
        name: &str,
        issued: Instant,
        calls: Option<DriverCalls>,
        done: Instant,
    ) {
        let slot = self.times.entry((decode, name.to_string())).or_default();
        slot.calls += 1;
        slot.seconds += (done - self.last).as_secs_f64();
        slot.host_seconds += (issued - self.last).as_secs_f64();
        if let (Some(before), Some(after)) = (&self.calls, &calls) {
            slot.driver.add(&after.since(before));
        }
        self.last = done;
        self.calls = self.backend.driver_calls();
    }
}

impl Observer for OpTimer<'_> {
    fn on_pass_start(&mut self, phase: Phase) {
        // The device is idle since the last op's wait: all of this is host time.
        let now = Instant::now();
        let calls = self.backend.driver_calls();
        let decode = matches!(phase, Phase::Decode(_));
        self.charge(decode, BETWEEN_PASSES, now, calls, now);
    }

    fn on_op(&mut self, event: &OpEvent, _: &Tensor) -> Result<()> {
        let issued = Instant::now();
        let calls = self.backend.driver_calls();
        self.backend.synchronize()?;
        let done = Instant::now();
        let decode = matches!(event.phase, Phase::Decode(_));
        self.charge(decode, without_layer(&event.name), issued, calls, done);
        Ok(())
    }

    fn wants_stats(&self) -> bool {
        false
    }
}

/// Prints the ops of the prefill and of a decode step, slowest first (`steps` decode steps ran;
/// ms per step, summed over the layers run), with their share of the phase. Every op is listed:
/// the names are summed over the layers, so a model has a few dozen at most, and a table cut
/// at a fixed count dropped whichever ops the run's noise ranked last (the CLI test that looks
/// for the embedding's row failed on a loaded machine).
pub fn print(timer: &OpTimer, layers: usize, steps: usize) -> Result<()> {
    for (decode, what, per) in [
        (false, "the prefill", 1),
        (true, "a decode step", steps.max(1)),
    ] {
        let rows = timer.slowest(decode);
        let total: f64 = rows.iter().map(|r| r.1.seconds).sum();
        let host: f64 = rows.iter().map(|r| r.1.host_seconds).sum();
        if rows.is_empty() {
            continue;
        }
        let ms = |secs: f64| secs / per as f64 * 1e3;
        writeln!(
            Out,
            "\nops of {what} over {layers} layer(s), the device synchronised after each op: {:.3} ms in all, {:.3} ms of it on the host before the wait",
            ms(total),
            ms(host)
        )?;
        // The driver's columns where there is a device.
        let device = timer.calls.is_some();
        let driver_head = match device {
            true => format!(" {:>13} {:>10}", "driver calls", "driver ms"),
            false => String::new(),
        };
        writeln!(
            Out,
            "{:<44} {:>6} {:>10} {:>7} {:>10}{driver_head}",
            "op", "calls", "ms", "share", "host ms"
        )?;
        let mut driver = DriverCalls::default();
        for (_, t) in &rows {
            driver.add(&t.driver);
        }
        for (name, t) in &rows {
            let (n, secs) = t.driver.total();
            let driver_cells = match device {
                true => format!(" {:>13} {:>10.3}", n / per as u64, ms(secs)),
                false => String::new(),
            };
            writeln!(
                Out,
                "{name:<44} {:>6} {:>10.3} {:>6.1}% {:>10.3}{driver_cells}",
                t.calls / per,
                ms(t.seconds),
                100.0 * t.seconds / total.max(f64::MIN_POSITIVE),
                ms(t.host_seconds),
            )?;
        }
        if driver.total().0 > 0 {
            let kinds: Vec<String> = DriverCall::ALL
                .iter()
                .filter(|&&k| driver.calls[k as usize] > 0)
                .map(|&k| {
                    format!(
                        "{} {} ({:.3} ms)",
                        driver.calls[k as usize] / per as u64,
                        k.word(),
                        ms(driver.nanos[k as usize] as f64 * 1e-9)
                    )
                })
                .collect();
            writeln!(
                Out,
                "calls into the driver issuing {what}: {}",
                kinds.join(", ")
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_calls_between_two_readings_are_their_difference() {
        let mut earlier = DriverCalls::default();
        earlier.calls[DriverCall::Launch as usize] = 3;
        earlier.nanos[DriverCall::Launch as usize] = 9_000;
        let mut later = earlier;
        later.calls[DriverCall::Launch as usize] = 5;
        later.nanos[DriverCall::Launch as usize] = 17_000;
        later.calls[DriverCall::Wait as usize] = 1;
        later.nanos[DriverCall::Wait as usize] = 2_000;
        let d = later.since(&earlier);
        assert_eq!(d.total(), (3, 10e-6));
        let mut sum = d;
        sum.add(&d);
        assert_eq!(sum.calls[DriverCall::Launch as usize], 4);
        assert_eq!(sum.total().0, 6);
    }

    #[test]
    fn issuing_leaves_out_the_calls_that_wait_for_the_device() {
        let mut d = DriverCalls::default();
        for (kind, calls, nanos) in [
            (DriverCall::Launch, 4, 16_000),
            (DriverCall::Alloc, 1, 1_000),
            (DriverCall::Wait, 1, 150_000),
            (DriverCall::Download, 1, 40_000),
        ] {
            d.calls[kind as usize] = calls;
            d.nanos[kind as usize] = nanos;
        }
        let (calls, secs) = d.issuing();
        assert_eq!(calls, 7);
        assert!((secs - 17e-6).abs() < 1e-12, "{secs}");
    }

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
