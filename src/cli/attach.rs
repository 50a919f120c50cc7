//! `mladb attach --listen ADDR`: takes the tensors a hook in a running engine sends
//! ([`crate::attach`]), from every rank at once, and reports what arrives: each connection's
//! hello, each step's batch, each tensor with its statistics and device pointers (for an
//! attention wrapper, the buffer its kernel wrote beside the tensor it returned), as text or as
//! JSON lines. Comparing them with mladb's own reference comes with the name maps.

use std::time::Duration;

use clap::Args;
use half::{bf16, f16};
use serde_json::json;
use tokio::sync::mpsc;

use super::Out;
use crate::attach::server::{serve, Bound, Event, Listen, ServerConfig};
use crate::attach::wire::{Body, Dtype, Limits};
use crate::error::{Error, Result};
use crate::stats::TensorStats;

#[derive(Args, Debug, Clone)]
pub struct AttachArgs {
    /// Where the engine's hook connects: HOST:PORT (loopback unless --allow-remote) or
    /// unix:PATH. Port 0 picks one; the address is printed on stderr.
    #[arg(long, default_value = "127.0.0.1:7777")]
    pub listen: String,
    /// Allow --listen on an address other than loopback.
    #[arg(long)]
    pub allow_remote: bool,
    /// One JSON object per line instead of text.
    #[arg(long)]
    pub json: bool,
    /// The largest tensor a frame may carry, in MiB.
    #[arg(long, default_value_t = 1024)]
    pub max_frame_mb: u64,
    /// Payload bytes held at once over all connections, in MiB (engines wait beyond it).
    #[arg(long, default_value_t = 4096)]
    pub memory_mb: u64,
    /// Seconds a connection may stall inside a frame before it is closed.
    #[arg(long, default_value_t = 30)]
    pub stall_secs: u64,
    /// Seconds a connection may stay silent between frames before it is closed.
    #[arg(long, default_value_t = 3600)]
    pub idle_secs: u64,
    /// Connections open at once; more are turned away.
    #[arg(long, default_value_t = 64)]
    pub max_connections: usize,
    /// Stop once this many connections have ended (default: run until Ctrl-C).
    #[arg(long)]
    pub connections: Option<u64>,
}

pub fn run(args: &AttachArgs) -> Result<()> {
    let listen = Listen::parse(&args.listen, args.allow_remote)?;
    let mib = |v: u64, flag: &str| {
        v.checked_mul(1 << 20)
            .filter(|&b| b > 0)
            .ok_or_else(|| Error::invalid(format!("{flag}: {v} MiB is out of range")))
    };
    if args.stall_secs == 0 || args.idle_secs == 0 || args.max_connections == 0 {
        return Err(Error::invalid(
            "--stall-secs, --idle-secs and --max-connections must be at least 1",
        ));
    }
    let config = ServerConfig {
        limits: Limits {
            max_payload: mib(args.max_frame_mb, "--max-frame-mb")?,
            ..Limits::default()
        },
        memory_budget: mib(args.memory_mb, "--memory-mb")?,
        stall: Duration::from_secs(args.stall_secs),
        idle: Duration::from_secs(args.idle_secs),
        max_connections: args.max_connections,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::invalid(format!("attach: cannot start the runtime: {e}")))?;
    runtime.block_on(async {
        let bound = Bound::bind(&listen).await?;
        eprintln!("mladb attach: listening on {}", bound.address());
        let (tx, mut rx) = mpsc::channel(256);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = stop_rx => {}
            }
        };
        let server = serve(&bound, config, tx, shutdown);
        let mut report = Report {
            json: args.json,
            ranks: Default::default(),
        };
        let consumer = async {
            let mut ended = 0u64;
            while let Some(event) = rx.recv().await {
                let closed = matches!(event, Event::Closed { .. });
                report.event(&event)?;
                ended += closed as u64;
                if args.connections.is_some_and(|n| ended >= n) {
                    break;
                }
            }
            Ok::<(), Error>(())
        };
        tokio::pin!(server);
        tokio::select! {
            served = &mut server => served,
            consumed = consumer => {
                let _ = stop_tx.send(());
                consumed?;
                server.await
            }
        }
    })
}

/// Prints events; remembers each connection's rank for the lines after its hello.
struct Report {
    json: bool,
    ranks: std::collections::HashMap<u64, u32>,
}

impl Report {
    fn event(&mut self, event: &Event) -> Result<()> {
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
                            "step {step} {phase}: {} tokens {tokens:?} at positions {positions:?}",
                            tokens.len()
                        ),
                        json!({"event": "step", "conn": conn, "rank": rank, "phase": phase,
                               "step": step, "tokens": tokens, "positions": positions}),
                    ),
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
    fn values<const N: usize>(payload: &[u8], value: impl Fn([u8; N]) -> f32) -> Vec<f32> {
        payload
            .chunks_exact(N)
            .map(|c| value(c.try_into().expect("N bytes")))
            .collect()
    }
    let values = match dtype {
        Dtype::F32 => values(payload, f32::from_le_bytes),
        Dtype::Bf16 => values(payload, |c| bf16::from_le_bytes(c).to_f32()),
        Dtype::F16 => values(payload, |c| f16::from_le_bytes(c).to_f32()),
        Dtype::I32 => values(payload, |c| i32::from_le_bytes(c) as f32),
        Dtype::I64 => values(payload, |c| i64::from_le_bytes(c) as f32),
    };
    TensorStats::of_unordered(&values)
}
