//! `mladb attach --listen ADDR`: takes the tensors a hook in a running engine sends
//! ([`crate::attach`]), from every rank at once, and reports what arrives: each connection's
//! hello, each step's batch, each tensor with its statistics and device pointers (for an
//! attention wrapper, the buffer its kernel wrote beside the tensor it returned), as text or as
//! JSON lines. With `--layout` or `--model`, mladb runs its own reference on the engine's
//! tokens and compares every tensor as it arrives ([`crate::attach::live`]), in a worker thread
//! of its own fed through a bounded channel (an engine that outruns it waits).

use std::time::Duration;

use clap::Args;
use serde_json::json;
use tokio::sync::mpsc;

use super::args::{DeviceArg, FlagArgs, ModelArgs, RunSetup};
use super::attach_report::{print_live, Report};
use super::Out;
use crate::attach::live::{Comparator, Input, Live};
use crate::attach::record::{frame_files, Frames, Recorder};
use crate::attach::server::{serve, Bound, Budget, Event, Listen, ServerConfig};
use crate::attach::wire::Limits;
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
    /// The model the engine runs, for the comparison (without --layout or --model, attach only
    /// reports what arrives).
    #[command(flatten)]
    pub model: ModelArgs,
    /// mladb's reference runs only these decoder layers: A..B, A..=B or A.
    #[arg(long)]
    pub layers: Option<String>,
    /// Where mladb's reference runs: cpu, cuda or auto.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Refuse to run mladb's reference for a sequence whose prefill would need more than this
    /// many GB (weights kept, caches, attention over its tokens): that step is reported and not
    /// compared (default: the memory the machine has available).
    #[arg(long)]
    pub max_memory_gb: Option<f64>,
    #[command(flatten)]
    pub flags: FlagArgs,
    /// How the engine's module names map to mladb's: hf, vllm, sglang, llamacpp (built in) or a
    /// RON file (default: the map of the engine each hook names in its hello).
    #[arg(long)]
    pub name_map: Option<String>,
    /// One relative L2 tolerance for every comparison (default: the table `check` uses, bf16's
    /// when the engine sends bf16 or f16 tensors).
    #[arg(long)]
    pub tolerance: Option<f64>,
    /// Keep every connection's frames in DIR (rank0.frames, ...), each file whole once its
    /// connection ends or attach stops (Ctrl-C included), for --replay.
    #[arg(long)]
    pub save: Option<std::path::PathBuf>,
    /// Instead of listening, read saved frames (files, or directories of .frames files; one
    /// connection per file): what --save kept, or what the hook wrote to a file: address.
    #[arg(long, num_args = 1.., conflicts_with_all = ["save", "connections"])]
    pub replay: Vec<std::path::PathBuf>,
    /// Open the debugger on mladb's reference run as the engine drives it, the engine's values
    /// beside mladb's (the tree's ref column, the Compare pane), findings in the log (needs
    /// --layout or --model; q quits and stops the server).
    #[arg(long, conflicts_with = "json")]
    pub tui: bool,
}

/// Runs the server (and the comparison); returns whether the comparison found anything.
pub fn run(args: &AttachArgs) -> Result<bool> {
    let listen = Listen::parse(&args.listen, args.allow_remote)?;
    if let Some(t) = args.tolerance {
        if !(t.is_finite() && t >= 0.0) {
            return Err(Error::invalid(format!(
                "--tolerance {t} is not a non-negative number"
            )));
        }
    }
    let comparing = args.model.layout.is_some() || args.model.model.is_some();
    if args.tui && !comparing {
        return Err(Error::invalid(
            "attach --tui shows mladb's reference beside the engine: give --layout or --model",
        ));
    }
    let screen = args
        .tui
        .then(std::sync::mpsc::channel::<crate::service::Update>);
    let to_screen: Option<crate::service::Send> = screen.as_ref().map(|(tx, _)| {
        let tx = std::sync::Mutex::new(tx.clone());
        let send: crate::service::Send = std::sync::Arc::new(move |u| {
            let _ = tx.lock().unwrap_or_else(|p| p.into_inner()).send(u);
        });
        send
    });
    let worker = if comparing {
        Some(start_worker(args, to_screen.clone())?)
    } else {
        None
    };
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
    let sink = Sink {
        report: Report {
            json: args.json,
            ranks: Default::default(),
            comparing,
            quiet: args.tui,
        },
        to_worker: worker.as_ref().map(|w| w.inputs.clone()),
        recorder: args.save.as_deref().map(Recorder::new).transpose()?,
    };
    let saved = match (screen, to_screen) {
        (Some((_, updates)), Some(send)) => {
            // The server on a thread of its own; the debugger here until q, which stops it.
            let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
            let (a, l) = (args.clone(), listen.clone());
            let announce: Announce = Box::new(move |line| send(crate::service::Update::Log(line)));
            let server = std::thread::spawn(move || {
                serve_all(&a, &l, config, sink, Some(stop_rx), announce)
            });
            let shown = super::attach_tui::show(updates);
            let _ = stop_tx.send(());
            let saved = server
                .join()
                .unwrap_or_else(|_| Err(Error::invalid("attach: the server panicked")));
            shown?;
            saved?
        }
        _ => serve_all(
            args,
            &listen,
            config,
            sink,
            None,
            Box::new(|line| eprintln!("{line}")),
        )?,
    };
    for path in saved {
        eprintln!("mladb attach: saved {}", path.display());
    }
    match worker {
        None => Ok(false),
        Some(w) => {
            drop(w.inputs);
            w.thread
                .join()
                .unwrap_or_else(|_| Err(Error::invalid("attach: the comparison panicked")))
        }
    }
}

/// Where each event goes: printed, recorded, handed to the comparison.
struct Sink {
    report: Report,
    to_worker: Option<mpsc::Sender<Input>>,
    recorder: Option<Recorder>,
}

impl Sink {
    async fn take(&mut self, event: Event) -> Result<()> {
        self.report.event(&event)?;
        if let Some(r) = self.recorder.as_mut() {
            match &event {
                Event::Frame { conn, frame, .. } => r.frame(*conn, frame)?,
                Event::Closed { conn, .. } => r.close(*conn)?,
                _ => {}
            }
        }
        if let (Some(tx), Some(input)) = (&self.to_worker, input_of(event)) {
            // Waits when the comparison is behind: the engines wait with it.
            if tx.send(input).await.is_err() {
                return Err(Error::invalid("attach: the comparison stopped"));
            }
        }
        Ok(())
    }
}

/// Where the server's own lines go: stderr, or the debugger's log.
type Announce = Box<dyn Fn(String) + Send>;

/// Serves (or replays saved frames) into `sink` until it ends, then saves what was received
/// whatever stopped it; returns the files saved.
fn serve_all(
    args: &AttachArgs,
    listen: &Listen,
    config: ServerConfig,
    mut sink: Sink,
    stop: Option<tokio::sync::oneshot::Receiver<()>>,
    announce: Announce,
) -> Result<Vec<std::path::PathBuf>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::invalid(format!("attach: cannot start the runtime: {e}")))?;
    let served = if args.replay.is_empty() {
        runtime.block_on(serve_and_forward(
            args, listen, config, &mut sink, stop, &announce,
        ))
    } else {
        runtime.block_on(replay(&args.replay, config.limits, &mut sink))
    };
    let saved = match sink.recorder.as_mut() {
        Some(r) => r.finish().map(|_| r.saved.clone()),
        None => Ok(Vec::new()),
    };
    drop(sink);
    served?;
    saved
}

/// Serves until Ctrl-C, `stop`, or `--connections` ended, every event through `sink` (those
/// still queued when the server stops included).
async fn serve_and_forward(
    args: &AttachArgs,
    listen: &Listen,
    config: ServerConfig,
    sink: &mut Sink,
    stop: Option<tokio::sync::oneshot::Receiver<()>>,
    announce: &Announce,
) -> Result<()> {
    let bound = Bound::bind(listen).await?;
    announce(format!("mladb attach: listening on {}", bound.address()));
    let (tx, mut rx) = mpsc::channel(256);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        let external = async {
            match stop {
                Some(s) => {
                    let _ = s.await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = stop_rx => {}
            _ = external => {}
        }
    };
    let server = serve(&bound, config, tx, shutdown);
    let mut ended = 0u64;
    let consumer = async {
        while let Some(event) = rx.recv().await {
            let closed = matches!(event, Event::Closed { .. });
            sink.take(event).await?;
            ended += closed as u64;
            if args.connections.is_some_and(|n| ended >= n) {
                break;
            }
        }
        Ok::<(), Error>(())
    };
    tokio::pin!(server);
    let served = tokio::select! {
        served = &mut server => served,
        consumed = consumer => {
            let _ = stop_tx.send(());
            consumed?;
            server.await
        }
    };
    while let Ok(event) = rx.try_recv() {
        sink.take(event).await?;
    }
    served
}

/// Feeds saved frame files through `sink`, one connection per file, in order.
async fn replay(paths: &[std::path::PathBuf], limits: Limits, sink: &mut Sink) -> Result<()> {
    for (conn, path) in frame_files(paths)?.into_iter().enumerate() {
        let conn = conn as u64;
        let mut frames = Frames::open(&path, limits)?;
        while let Some(frame) = frames.next_frame()? {
            sink.take(Event::Frame {
                conn,
                frame,
                budget: Budget::none(),
            })
            .await?;
        }
        sink.take(Event::Closed { conn, error: None }).await?;
    }
    Ok(())
}

/// The comparison's thread and the channel that feeds it.
struct Worker {
    inputs: mpsc::Sender<Input>,
    thread: std::thread::JoinHandle<Result<bool>>,
}

/// Loads the model and starts the comparison in a thread of its own (the backend stays in the
/// thread that made it); returns once the model is loaded, or with the error that stopped it.
fn start_worker(args: &AttachArgs, screen: Option<crate::service::Send>) -> Result<Worker> {
    let flags = args.flags.flags(args.device)?;
    if flags.tp > 1 {
        // The engine's module outputs are whole tensors (or shards `attach` reassembles);
        // mladb's own ops, which they are held against, are those of one rank.
        return Err(crate::Error::invalid(format!(
            "--tp {}: attach compares the engine with mladb's ops on one rank; leave --tp out \
             (shards the engine sends are reassembled)",
            flags.tp
        )));
    }
    let map = args
        .name_map
        .as_deref()
        .map(crate::debug::name_map::NameMap::resolve)
        .transpose()?;
    let setup = RunSetup {
        model: args.model.clone(),
        tokens: None,
        prompt: None,
        tokenizer: None,
        prefill: None,
        decode: None,
        layers: args.layers.clone(),
        device: args.device,
        max_memory_gb: args.max_memory_gb,
    };
    let (tolerance, json) = (args.tolerance, args.json);
    let (inputs, mut rx) = mpsc::channel::<Input>(64);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
    let thread = std::thread::spawn(move || -> Result<bool> {
        let p = match setup.prepare(&flags) {
            Ok(p) => {
                let _ = ready_tx.send(Ok(()));
                p
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return Ok(false);
            }
        };
        let mut comparator = Comparator::new(
            &p.model,
            p.backend.as_ref(),
            flags,
            p.layers.clone(),
            map,
            tolerance,
        );
        comparator.max_memory_gb = setup.max_memory_gb;
        let mut feed = screen.map(|send| {
            comparator.keep_engine = true;
            super::attach_tui::Feed::new(send, &p)
        });
        let mut show = |lives: Vec<Live>, comparator: &Comparator, step_ended: bool| match &mut feed
        {
            Some(f) => {
                f.sync(comparator, &lives, step_ended);
                Ok(())
            }
            None => lives.iter().try_for_each(|l| print_live(l, json)),
        };
        while let Some(input) = rx.blocking_recv() {
            let step_ended = matches!(input, Input::Step { .. } | Input::Closed { .. });
            let lives = comparator.take(input);
            show(lives, &comparator, step_ended)?;
        }
        let lives = comparator.finish();
        show(lives, &comparator, true)?;
        let t = &comparator.totals;
        let not_in_run: Vec<&String> = t.not_in_run.iter().take(6).collect();
        let text = format!(
            "compared {} tensors over {} steps: {} beyond tolerance, {} finding(s); {} left out by the name map; {} op names not in mladb's run{}",
            t.compared,
            t.steps,
            t.divergent,
            t.findings,
            t.left_out,
            t.not_in_run.len(),
            if not_in_run.is_empty() {
                String::new()
            } else {
                format!(" ({:?}{})", not_in_run, if t.not_in_run.len() > 6 { ", …" } else { "" })
            }
        );
        // A comparison that compared nothing must not read as an all-clear.
        let nothing = t.compared == 0;
        let text = if nothing {
            format!("nothing was compared: {text} (check the name map and that the engine runs this model)")
        } else {
            text
        };
        let value = json!({"event": "summary", "totals": t, "nothing_compared": nothing});
        if json {
            writeln!(Out, "{value}")?;
        } else {
            writeln!(Out, "{text}")?;
        }
        Ok(t.findings > 0 || nothing)
    });
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(Worker { inputs, thread }),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(Error::invalid("attach: the comparison did not start")),
    }
}

/// A server event as the comparison takes it (tensor payloads in f32).
fn input_of(event: Event) -> Option<Input> {
    match event {
        Event::Closed { conn, .. } => Some(Input::Closed { conn }),
        Event::Frame {
            conn,
            frame,
            budget,
        } => Input::of_frame(conn, &frame, Some(budget)),
        _ => None,
    }
}
