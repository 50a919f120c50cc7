//! The listener of `mladb attach`: takes frames ([`super::wire`]) from several engine processes
//! at once (one connection per rank), one tokio task per connection, and hands them on in one
//! bounded channel, so a consumer sees every connection's frames in order and the engines wait
//! (their sockets fill) when it falls behind.
//!
//! Memory is bounded on this side whatever the clients do: every length is checked before it is
//! allocated ([`Limits`]), the payloads alive at once share one byte budget (a frame holds its
//! share until the consumer drops it), the number of connections is capped, and a connection
//! that stalls inside a frame (a half-open one, or a client that died mid-write) is closed after
//! the stall time; one silent between frames (an engine waiting for requests) only after the
//! much longer idle time.
//! A connection that breaks a rule is closed with an [`Event::Closed`] that says why; the others
//! go on.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use super::wire::{parse_header, parse_prefix, truncated, Body, Frame, Limits, PREFIX_BYTES};
use crate::{Error, Result};

/// Where to listen: a TCP address or a Unix socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl Listen {
    /// `HOST:PORT` or `unix:PATH`. An address other than loopback is refused unless
    /// `allow_remote`: tensors of a model are not for the network by default.
    pub fn parse(text: &str, allow_remote: bool) -> Result<Listen> {
        if let Some(path) = text.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(Error::invalid("--listen unix: needs a path"));
            }
            return Ok(Listen::Unix(PathBuf::from(path)));
        }
        let addr: SocketAddr = text.parse().map_err(|_| {
            Error::invalid(format!(
                "--listen: '{text}' is neither HOST:PORT (like 127.0.0.1:7777) nor unix:PATH"
            ))
        })?;
        if !addr.ip().is_loopback() && !allow_remote {
            return Err(Error::invalid(format!(
                "--listen {addr}: not a loopback address; add --allow-remote to listen there"
            )));
        }
        Ok(Listen::Tcp(addr))
    }
}

/// How the server treats its clients.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub limits: Limits,
    /// Bytes of payload alive at once, over all connections.
    pub memory_budget: u64,
    /// A connection silent this long inside a frame is closed.
    pub stall: Duration,
    /// A connection silent this long between frames is closed.
    pub idle: Duration,
    pub max_connections: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            limits: Limits::default(),
            memory_budget: 4 << 30,
            stall: Duration::from_secs(30),
            idle: Duration::from_secs(3600),
            max_connections: 64,
        }
    }
}

/// What the server hands on, in order within each connection.
#[derive(Debug)]
pub enum Event {
    /// A client connected; `conn` numbers connections from 0.
    Connected { conn: u64, peer: String },
    /// A frame arrived. The first of a connection is its `hello`.
    Frame {
        conn: u64,
        frame: Frame,
        /// The frame's share of the memory budget, given back when the event is dropped.
        budget: Budget,
    },
    /// The connection ended: cleanly (`error` None, after a `bye` or at a frame boundary) or
    /// because it broke a rule, which `error` names.
    Closed { conn: u64, error: Option<String> },
    /// A client was turned away before reading anything (too many connections).
    Refused { peer: String, reason: String },
}

/// A frame's share of the server's memory budget.
#[derive(Debug)]
pub struct Budget(#[allow(dead_code)] Option<OwnedSemaphorePermit>);

impl Budget {
    /// No share: a frame read from a file, outside any server.
    pub fn none() -> Budget {
        Budget(None)
    }
}

/// A bound listener (the port is known before serving: `127.0.0.1:0` picks one).
pub enum Bound {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener, PathBuf),
}

impl Bound {
    /// Binds `listen`. Must run inside a tokio runtime.
    pub async fn bind(listen: &Listen) -> Result<Bound> {
        match listen {
            Listen::Tcp(addr) => tokio::net::TcpListener::bind(addr)
                .await
                .map(Bound::Tcp)
                .map_err(|e| Error::invalid(format!("--listen {addr}: {e}"))),
            Listen::Unix(path) => {
                if path.exists() {
                    return Err(Error::invalid(format!(
                        "--listen unix:{}: the path exists (remove it if no mladb is listening there)",
                        path.display()
                    )));
                }
                tokio::net::UnixListener::bind(path)
                    .map(|l| Bound::Unix(l, path.clone()))
                    .map_err(|e| Error::invalid(format!("--listen unix:{}: {e}", path.display())))
            }
        }
    }

    /// The address clients connect to, in `--listen`'s form.
    pub fn address(&self) -> String {
        match self {
            Bound::Tcp(l) => l
                .local_addr()
                .map(|a| a.to_string())
                .unwrap_or_else(|_| "?".into()),
            Bound::Unix(_, path) => format!("unix:{}", path.display()),
        }
    }
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Bound::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Accepts connections until `shutdown` completes, each read by its own task into `events`.
/// Returns when shutting down; connections still open are left to end on their own (their
/// tasks stop once `events` is dropped by the consumer).
pub async fn serve(
    bound: &Bound,
    config: ServerConfig,
    events: mpsc::Sender<Event>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    if config.limits.max_payload > config.memory_budget {
        return Err(Error::invalid(format!(
            "attach: a frame's payload limit ({} bytes) exceeds the memory budget ({} bytes)",
            config.limits.max_payload, config.memory_budget
        )));
    }
    let config = Arc::new(config);
    // Permits count KiB, so that a budget of terabytes fits the semaphore's counter.
    let budget = Arc::new(Semaphore::new(
        (config.memory_budget / 1024).min(Semaphore::MAX_PERMITS as u64) as usize,
    ));
    let open = Arc::new(Semaphore::new(config.max_connections));
    let mut next_conn = 0u64;
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            accepted = accept(bound) => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(e) => {
                // A failed accept (out of descriptors, a reset) ends that client, not the server.
                if events
                    .send(Event::Refused {
                        peer: "?".into(),
                        reason: format!("accept failed: {e}"),
                    })
                    .await
                    .is_err()
                {
                    return Ok(());
                }
                continue;
            }
        };
        let Ok(slot) = open.clone().try_acquire_owned() else {
            drop(stream);
            let reason = format!("more than {} connections", config.max_connections);
            if events.send(Event::Refused { peer, reason }).await.is_err() {
                return Ok(());
            }
            continue;
        };
        let conn = next_conn;
        next_conn += 1;
        if events.send(Event::Connected { conn, peer }).await.is_err() {
            return Ok(());
        }
        let (config, budget, events) = (config.clone(), budget.clone(), events.clone());
        tokio::spawn(async move {
            let error = match stream {
                Stream::Tcp(s) => read_connection(s, conn, &config, &budget, &events).await,
                Stream::Unix(s) => read_connection(s, conn, &config, &budget, &events).await,
            }
            .err()
            .map(|e| e.to_string());
            let _ = events.send(Event::Closed { conn, error }).await;
            drop(slot);
        });
    }
}

enum Stream {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

async fn accept(bound: &Bound) -> std::io::Result<(Stream, String)> {
    match bound {
        Bound::Tcp(l) => l
            .accept()
            .await
            .map(|(s, a)| (Stream::Tcp(s), a.to_string())),
        Bound::Unix(l, path) => l
            .accept()
            .await
            .map(|(s, _)| (Stream::Unix(s), format!("unix:{}", path.display()))),
    }
}

/// Reads one connection's frames until its end, a `bye`, or a broken rule.
async fn read_connection(
    mut stream: impl AsyncRead + Unpin,
    conn: u64,
    config: &ServerConfig,
    budget: &Arc<Semaphore>,
    events: &mpsc::Sender<Event>,
) -> Result<()> {
    let mut greeted = false;
    loop {
        let Some((frame, share)) = read_frame(&mut stream, config, budget).await? else {
            return Ok(());
        };
        let first = !greeted;
        greeted = true;
        match (&frame.header.body, first) {
            (Body::Hello { .. }, true) => {}
            (Body::Hello { .. }, false) => {
                return Err(Error::invalid("wire: a second hello on one connection"))
            }
            (_, true) => return Err(Error::invalid("wire: the first frame must be a hello")),
            _ => {}
        }
        let bye = matches!(frame.header.body, Body::Bye { .. });
        let event = Event::Frame {
            conn,
            frame,
            budget: Budget(share),
        };
        if events.send(event).await.is_err() || bye {
            return Ok(());
        }
    }
}

/// The next frame with its share of the budget, `None` at a clean end; every read inside a
/// frame bounded by the stall time, and the wait for a frame by the idle time.
async fn read_frame(
    stream: &mut (impl AsyncRead + Unpin),
    config: &ServerConfig,
    budget: &Arc<Semaphore>,
) -> Result<Option<(Frame, Option<OwnedSemaphorePermit>)>> {
    let timed = |limit: Duration, what: &'static str| {
        move |_| {
            Error::invalid(format!(
                "wire: no data for {:.1} s {what}; closing",
                limit.as_secs_f64()
            ))
        }
    };
    let mut prefix = [0u8; PREFIX_BYTES];
    let mut got = 0;
    while got < PREFIX_BYTES {
        let (limit, what) = if got == 0 {
            (config.idle, "between frames")
        } else {
            (config.stall, "inside a frame")
        };
        let n = tokio::time::timeout(limit, stream.read(&mut prefix[got..]))
            .await
            .map_err(timed(limit, what))?
            .map_err(|e| Error::invalid(format!("wire: read failed: {e}")))?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(truncated("prefix", got, PREFIX_BYTES as u64));
        }
        got += n;
    }
    let (header_len, payload_len) = parse_prefix(&prefix, config.limits)?;
    let json = read_exact(stream, header_len as u64, "header", config.stall).await?;
    let header = parse_header(&json, payload_len)?;
    // Wait for room in the budget before allocating the payload: this is where a consumer that
    // falls behind slows the engines down.
    let kib = payload_len.div_ceil(1024) as u32;
    let share = if kib > 0 {
        Some(
            budget
                .clone()
                .acquire_many_owned(kib)
                .await
                .map_err(|_| Error::invalid("attach: shutting down"))?,
        )
    } else {
        None
    };
    let payload = read_exact(stream, payload_len, "payload", config.stall).await?;
    Ok(Some((Frame { header, payload }, share)))
}

/// `len` bytes (checked against the limits already), each read bounded by the stall time.
async fn read_exact(
    stream: &mut (impl AsyncRead + Unpin),
    len: u64,
    what: &str,
    stall: Duration,
) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; len as usize];
    let mut got = 0;
    while got < buf.len() {
        let n = tokio::time::timeout(stall, stream.read(&mut buf[got..]))
            .await
            .map_err(|_| {
                Error::invalid(format!(
                    "wire: no data for {:.1} s inside a frame's {what} ({got} of {len} bytes); closing",
                    stall.as_secs_f64()
                ))
            })?
            .map_err(|e| Error::invalid(format!("wire: read failed in the {what}: {e}")))?;
        if n == 0 {
            return Err(truncated(what, got, len));
        }
        got += n;
    }
    Ok(buf)
}
