//! What `mladb attach` prints: each server event (hello, step, tensor with its statistics and
//! pointers) and each comparison event, as text lines or JSON objects.

use serde_json::json;

use super::Out;
use crate::attach::live::Live;
use crate::attach::server::Event;
use crate::attach::wire::{Body, Dtype};
use crate::error::{Error, Result};
use crate::stats::TensorStats;

/// One comparison event: a line of text, or its JSON object.
pub(super) fn print_live(live: &Live, json: bool) -> Result<()> {
    if json {
        let value = serde_json::to_value(live).map_err(|e| Error::invalid(e.to_string()))?;
        return writeln!(Out, "{value}");
    }
    let line = match live {
        Live::Reference {
            step,
            phase,
            tokens,
            ops,
        } => format!("step {step}: mladb ran its reference ({phase}, {tokens} tokens, {ops} ops)"),
        Live::Compared {
            step,
            module,
            op,
            rank,
            error,
            tolerance,
            diverges,
            worst_rank,
            ..
        } => {
            let who = rank.map_or("ranks together".to_string(), |r| format!("rank {r}"));
            let mut s = format!(
                "step {step} {who} {module} = {op}: {error:.3e} (tolerance {tolerance:.1e}){}",
                if *diverges { " DIVERGES" } else { "" }
            );
            if let (true, Some((r, e))) = (*diverges, worst_rank) {
                s += &format!("; rank {r}'s shard differs most ({e:.3e})");
            }
            s
        }
        Live::Finding {
            step,
            rank,
            finding,
        } => format!(
            "finding step {step}{}: {} {} {}: {}",
            rank.map_or(String::new(), |r| format!(" rank {r}")),
            finding.kind,
            finding.phase,
            finding.op,
            finding.detail
        ),
        Live::Note { step, rank, text } => format!(
            "note{}{}: {text}",
            step.map_or(String::new(), |s| format!(" step {s}")),
            rank.map_or(String::new(), |r| format!(" rank {r}"))
        ),
    };
    writeln!(Out, "{line}")
}

/// Prints events; remembers each connection's rank for the lines after its hello.
pub(super) struct Report {
    pub(super) json: bool,
    pub(super) ranks: std::collections::HashMap<u64, u32>,
    /// The comparison reports tensors (and disconnects) itself.
    pub(super) comparing: bool,
    /// Nothing printed (the debugger holds the screen).
    pub(super) quiet: bool,
}

impl Report {
    pub(super) fn event(&mut self, event: &Event) -> Result<()> {
        if self.quiet {
            return Ok(());
        }
        let (conn, line, value) = match event {
            Event::Connected { conn, peer } => (
                *conn,
                format!("connected from {peer}"),
                json!({"event": "connected", "conn": conn, "peer": peer}),
            ),
            Event::Refused { peer, reason } => {
                let text = format!("refused {peer}: {reason}");
                return self.print(
                    &text,
                    json!({"event": "refused", "peer": peer, "reason": reason}),
                );
            }
            Event::Closed { conn, error } => (
                *conn,
                match error {
                    None => "closed".to_string(),
                    Some(e) => format!("closed: {e}"),
                },
                json!({"event": "closed", "conn": conn, "error": error}),
            ),
            Event::Frame { conn, frame, .. } => {
                let rank = self.ranks.get(conn).copied();
                let (line, value) = match &frame.header.body {
                    Body::Hello {
                        engine,
                        model,
                        rank,
                        world_size,
                    } => {
                        self.ranks.insert(*conn, *rank);
                        (
                            format!("hello: {engine}, model {model}, rank {rank} of {world_size}"),
                            json!({"event": "hello", "conn": conn, "engine": engine, "model": model,
                                   "rank": rank, "world_size": world_size}),
                        )
                    }
                    Body::Step {
                        phase,
                        step,
                        tokens,
                        positions,
                    } => (
                        format!(
                            "step {step} {phase}: {} at positions {}",
                            crate::debug::external::token_list(tokens),
                            position_span(positions)
                        ),
                        json!({"event": "step", "conn": conn, "rank": rank, "phase": phase,
                               "step": step, "tokens": tokens, "positions": positions}),
                    ),
                    Body::Tensor { .. } if self.comparing => return Ok(()),
                    Body::Tensor {
                        module,
                        dtype,
                        shape,
                        ptr,
                        kernel_out_ptr,
                    } => {
                        let stats = stats_of(*dtype, &frame.payload);
                        let hex = |p: &Option<u64>| p.map(|p| format!("{p:#x}"));
                        let mut line = format!(
                            "tensor {module} {} {shape:?}: mean {:.6e} max|x| {:.6e} nan {} inf {}",
                            dtype.name(),
                            stats.mean,
                            stats.abs_max,
                            stats.nan,
                            stats.pos_inf + stats.neg_inf
                        );
                        if let Some(p) = ptr {
                            line += &format!(" at {p:#x}");
                        }
                        if let (Some(k), Some(p)) = (kernel_out_ptr, ptr) {
                            if k != p {
                                line +=
                                    &format!(" (its kernel wrote {k:#x}: not the buffer returned)");
                            }
                        }
                        (
                            line,
                            json!({"event": "tensor", "conn": conn, "rank": rank, "module": module,
                                   "dtype": dtype, "shape": shape, "ptr": hex(ptr),
                                   "kernel_out_ptr": hex(kernel_out_ptr),
                                   "stats": stats}),
                        )
                    }
                    Body::Bye { dropped } => (
                        format!("bye ({dropped} tensors dropped by the hook)"),
                        json!({"event": "bye", "conn": conn, "rank": rank, "dropped": dropped}),
                    ),
                };
                (*conn, line, value)
            }
        };
        let prefix = match self.ranks.get(&conn) {
            Some(rank) => format!("conn {conn} rank {rank}"),
            None => format!("conn {conn}"),
        };
        self.print(&format!("{prefix} {line}"), value)
    }

    fn print(&self, text: &str, value: serde_json::Value) -> Result<()> {
        if self.json {
            writeln!(Out, "{value}")
        } else {
            writeln!(Out, "{text}")
        }
    }
}

/// The statistics of a received tensor, as the trace has them for mladb's device ops (the
/// eight-lane pass; its payload is already checked to be its shape's size; integers are taken
/// as f32).
pub(crate) fn stats_of(dtype: Dtype, payload: &[u8]) -> TensorStats {
    TensorStats::of_unordered(&dtype.values(payload))
}

/// A step's positions for its one line: `A..=B` where they run on one by one (a sequence's
/// prefill or decode step), else the first few; a long prefill's would fill the screen.
fn position_span(positions: &[u32]) -> String {
    match positions {
        [] => "none".to_string(),
        [p] => p.to_string(),
        [first, .., last]
            if positions
                .windows(2)
                .all(|w| w[0].checked_add(1) == Some(w[1])) =>
        {
            format!("{first}..={last}")
        }
        _ => crate::debug::external::number_list(positions, "positions"),
    }
}

#[cfg(test)]
mod tests {
    use super::position_span;

    #[test]
    fn a_step_s_positions_are_one_span_or_the_first_few() {
        assert_eq!(position_span(&[]), "none");
        assert_eq!(position_span(&[7]), "7");
        assert_eq!(
            position_span(&(0..60_000).collect::<Vec<u32>>()),
            "0..=59999"
        );
        let scattered: Vec<u32> = (0..40).map(|i| i * 2).collect();
        assert_eq!(
            position_span(&scattered),
            "0,2,4,6,8,10,12,14,16,18,20,22,24,26,28,30,… (40 positions)"
        );
        assert_eq!(position_span(&[u32::MAX, 0]), "4294967295,0 (2 positions)");
    }
}
