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
    /// Seconds a connection may stay silent before it is closed.
    #[arg(long, default_value_t = 300)]
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
    if args.idle_secs == 0 || args.max_connections == 0 {
        return Err(Error::invalid(
            "--idle-secs and --max-connections must be at least 1",
        ));
    }
    let config = ServerConfig {
        limits: Limits {
            max_payload: mib(args.max_frame_mb, "--max-frame-mb")?,
            ..Limits::default()
        },
        memory_budget: mib(args.memory_mb, "--memory-mb")?,
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
                        let stats = Stats::of(*dtype, &frame.payload);
                        let hex = |p: &Option<u64>| p.map(|p| format!("{p:#x}"));
                        let mut line =
                            format!(
                            "tensor {module} {} {shape:?}: mean {:.6e} max|x| {:.6e} nan {} inf {}",
                            dtype.name(),
                            stats.mean, stats.max_abs, stats.nan, stats.inf
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
                                   "stats": {"mean": stats.mean, "max_abs": stats.max_abs,
                                             "nan": stats.nan, "inf": stats.inf}}),
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

/// Statistics of a received tensor (its payload already checked to be its shape's size).
pub(crate) struct Stats {
    pub(crate) mean: f64,
    pub(crate) max_abs: f64,
    pub(crate) nan: u64,
    pub(crate) inf: u64,
}

impl Stats {
    pub(crate) fn of(dtype: Dtype, payload: &[u8]) -> Stats {
        match dtype {
            Dtype::F32 => Stats::over(payload, |c: [u8; 4]| f32::from_le_bytes(c) as f64),
            Dtype::Bf16 => Stats::over(payload, |c: [u8; 2]| bf16::from_le_bytes(c).to_f64()),
            Dtype::F16 => Stats::over(payload, |c: [u8; 2]| f16::from_le_bytes(c).to_f64()),
            Dtype::I32 => Stats::over(payload, |c: [u8; 4]| i32::from_le_bytes(c) as f64),
            Dtype::I64 => Stats::over(payload, |c: [u8; 8]| i64::from_le_bytes(c) as f64),
        }
    }

    /// One pass over the elements of `N` bytes each (monomorphised per dtype: this runs on
    /// every tensor an engine sends).
    fn over<const N: usize>(payload: &[u8], value: impl Fn([u8; N]) -> f64) -> Stats {
        let (mut sum, mut finite, mut max_abs, mut nan, mut inf) = (0.0, 0u64, 0.0f64, 0, 0);
        for chunk in payload.chunks_exact(N) {
            let v = value(chunk.try_into().expect("N bytes"));
            if v.is_nan() {
                nan += 1;
            } else if v.is_infinite() {
                inf += 1;
            } else {
                sum += v;
                finite += 1;
                max_abs = max_abs.max(v.abs());
            }
        }
        Stats {
            mean: if finite > 0 { sum / finite as f64 } else { 0.0 },
            max_abs,
            nan,
            inf,
        }
    }
}
