//! `mladb bench --attach-ingest`: how fast `mladb attach` takes a hook's frames over loopback
//! TCP, in this process: one client thread writes tensor frames as fast as the socket takes
//! them, the server reads them and the consumer computes each tensor's statistics, as `mladb
//! attach` does. Then, at a low rate, the time from a frame's write to its statistics.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::attach_report::stats_of;
use super::Out;
use crate::attach::server::{serve, Bound, Event, Listen, ServerConfig};
use crate::attach::wire::{encode, Body, Dtype, Header, WIRE_VERSION};
use crate::error::{Error, Result};

/// One shape of the table: a tensor of `tokens × hidden` bf16 values.
struct Shape {
    what: &'static str,
    tokens: u64,
    hidden: u64,
}

const SHAPES: [Shape; 4] = [
    Shape {
        what: "glm5-tiny, decode",
        tokens: 1,
        hidden: 256,
    },
    Shape {
        what: "glm5-tiny, prefill 128",
        tokens: 128,
        hidden: 256,
    },
    Shape {
        what: "glm5, decode",
        tokens: 1,
        hidden: 6144,
    },
    Shape {
        what: "glm5, prefill 128",
        tokens: 128,
        hidden: 6144,
    },
];

pub fn run(quick: bool) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::invalid(format!("bench: cannot start the runtime: {e}")))?;
    writeln!(
        Out,
        "mladb attach ingest over loopback TCP (one connection; bf16 tensors of tokens × hidden; statistics of each computed as `mladb attach` does)"
    )?;
    writeln!(
        Out,
        "{:>24} {:>10} {:>9} {:>11} {:>9} {:>13} {:>13} {:>13}",
        "shape", "bytes", "frames", "frames/s", "GB/s", "latency µs", "p99 µs", "of it stats µs"
    )?;
    let budget = if quick { 64u64 << 20 } else { 512 << 20 };
    for shape in &SHAPES {
        let bytes = shape.tokens * shape.hidden * 2;
        let frames = (budget / bytes).clamp(200, 200_000);
        let (seconds, _, _) = runtime.block_on(ingest(bytes, frames, None))?;
        // Latency without a queue: frames twice as far apart as the throughput run took each.
        let gap = Duration::from_secs_f64((2.0 * seconds / frames as f64).max(500e-6));
        let (_, mut latencies, stats_us) =
            runtime.block_on(ingest(bytes, if quick { 50 } else { 200 }, Some(gap)))?;
        latencies.sort_by(f64::total_cmp);
        let median = latencies[latencies.len() / 2];
        let p99 = latencies[(latencies.len() * 99 / 100).min(latencies.len() - 1)];
        let total = (bytes + 200) * frames; // ~200 bytes of prefix and header per frame
        writeln!(
            Out,
            "{:>24} {:>10} {:>9} {:>11.0} {:>9.2} {:>13.1} {:>13.1} {:>13.1}",
            shape.what,
            bytes,
            frames,
            frames as f64 / seconds,
            total as f64 / seconds / 1e9,
            median,
            p99,
            stats_us
        )?;
    }
    Ok(())
}

/// Sends `frames` tensor frames of `bytes` bytes (one every `gap`, or back to back) and returns
/// the seconds from the first write to the last frame's statistics, each frame's latency from
/// its write to its statistics in µs, and the statistics' mean share of that in µs.
async fn ingest(bytes: u64, frames: u64, gap: Option<Duration>) -> Result<(f64, Vec<f64>, f64)> {
    let bound = Bound::bind(&Listen::parse("127.0.0.1:0", false)?).await?;
    let addr: SocketAddr = bound
        .address()
        .parse()
        .map_err(|_| Error::invalid("bench: no loopback address"))?;
    let (tx, mut rx) = mpsc::channel(256);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let epoch = Instant::now();
    let values: Vec<u8> = (0..bytes / 2)
        .flat_map(|i| half::bf16::from_f32((i % 97) as f32 * 0.01).to_le_bytes())
        .collect();
    let client = std::thread::spawn(move || -> std::io::Result<()> {
        let mut stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        let hello = Header {
            v: WIRE_VERSION,
            body: Body::Hello {
                engine: "bench".into(),
                model: "bench".into(),
                rank: 0,
                world_size: 1,
            },
        };
        stream.write_all(&encode(&hello, &[]).map_err(std::io::Error::other)?)?;
        for _ in 0..frames {
            if let Some(gap) = gap {
                std::thread::sleep(gap);
            }
            // The write's time, in ns since the epoch, travels as the module name.
            let header = Header {
                v: WIRE_VERSION,
                body: Body::Tensor {
                    module: epoch.elapsed().as_nanos().to_string(),
                    dtype: Dtype::Bf16,
                    shape: vec![bytes / 2],
                    ptr: None,
                    kernel_out_ptr: None,
                },
            };
            stream.write_all(&encode(&header, &values).map_err(std::io::Error::other)?)?;
        }
        Ok(())
    });
    let server = serve(&bound, ServerConfig::default(), tx, async {
        let _ = stop_rx.await;
    });
    let consume = async {
        let mut seen = 0;
        let mut latencies = Vec::new();
        let mut first = None;
        let mut checksum = 0.0;
        let mut stats_time = 0.0;
        while seen < frames {
            match rx.recv().await {
                Some(Event::Frame { frame, .. }) => {
                    if let Body::Tensor { module, dtype, .. } = &frame.header.body {
                        let started = Instant::now();
                        checksum += stats_of(*dtype, &frame.payload).mean;
                        stats_time += started.elapsed().as_secs_f64();
                        let sent: u128 = module.parse().unwrap_or(0);
                        let now = epoch.elapsed().as_nanos();
                        first.get_or_insert(sent);
                        latencies.push(now.saturating_sub(sent) as f64 / 1e3);
                        seen += 1;
                    }
                }
                Some(Event::Closed { error: Some(e), .. }) => {
                    return Err(Error::invalid(format!("bench: the connection failed: {e}")))
                }
                Some(_) => {}
                None => return Err(Error::invalid("bench: the server stopped")),
            }
        }
        let start = first.unwrap_or(0) as f64 / 1e9;
        std::hint::black_box(checksum);
        Ok((
            epoch.elapsed().as_secs_f64() - start,
            latencies,
            stats_time / frames as f64 * 1e6,
        ))
    };
    tokio::pin!(server);
    let measured = tokio::select! {
        served = &mut server => return Err(served.err().unwrap_or_else(|| Error::invalid("bench: the server stopped"))),
        measured = consume => measured,
    };
    let _ = stop_tx.send(());
    server.await?;
    client
        .join()
        .map_err(|_| Error::invalid("bench: the client thread panicked"))?
        .map_err(|e| Error::invalid(format!("bench: the client failed: {e}")))?;
    measured
}
