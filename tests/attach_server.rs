//! `mladb attach`'s server against good and hostile clients: a good client's frames arrive
//! intact while others send garbage, oversized frames, frames before their hello, or stop
//! mid-frame; a hundred connections at once; too many connections; bad --listen values.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use mladb::attach::server::{serve, Bound, Event, Listen, ServerConfig};
use mladb::attach::wire::{encode, Body, Dtype, Header, Limits, MAGIC, WIRE_VERSION};

fn header(body: Body) -> Header {
    Header {
        v: WIRE_VERSION,
        body,
    }
}

fn hello(rank: u32) -> Vec<u8> {
    let body = Body::Hello {
        engine: "test".into(),
        model: "glm5-tiny".into(),
        rank,
        world_size: 2,
    };
    encode(&header(body), &[]).unwrap()
}

fn tensor(module: &str, values: &[f32]) -> Vec<u8> {
    let body = Body::Tensor {
        module: module.into(),
        dtype: Dtype::F32,
        shape: vec![values.len() as u64],
        ptr: Some(0x1000),
        kernel_out_ptr: None,
    };
    let payload: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    encode(&header(body), &payload).unwrap()
}

fn bye() -> Vec<u8> {
    encode(&header(Body::Bye { dropped: 0 }), &[]).unwrap()
}

/// Serves on a loopback port while `clients` runs on its own thread, and returns the events
/// until `ends` connections have ended (closed or refused).
fn serve_and_collect(
    config: ServerConfig,
    ends: usize,
    clients: impl FnOnce(SocketAddr) + Send + 'static,
) -> Vec<Event> {
    let listen = Listen::parse("127.0.0.1:0", false).unwrap();
    serve_and_collect_on(&listen, config, ends, |address| {
        clients(address.parse().unwrap())
    })
}

/// The same on any listen address; `clients` gets the bound one, in --listen's form.
fn serve_and_collect_on(
    listen: &Listen,
    config: ServerConfig,
    ends: usize,
    clients: impl FnOnce(String) + Send + 'static,
) -> Vec<Event> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let bound = Bound::bind(listen).await.unwrap();
        assert!(Bound::bind(listen).await.is_err() || matches!(listen, Listen::Tcp(_)));
        let address = bound.address();
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let client_thread = std::thread::spawn(move || clients(address));
        let server = serve(&bound, config, tx, async {
            let _ = stop_rx.await;
        });
        let collect = async {
            let mut events = Vec::new();
            let mut ended = 0;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while ended < ends {
                match tokio::time::timeout_at(deadline, rx.recv()).await {
                    Ok(Some(event)) => {
                        ended +=
                            matches!(event, Event::Closed { .. } | Event::Refused { .. }) as usize;
                        events.push(event);
                    }
                    _ => panic!("{ended} of {ends} connections ended in 20 s: {events:#?}"),
                }
            }
            events
        };
        tokio::pin!(server);
        let events = tokio::select! {
            served = &mut server => panic!("the server stopped: {served:?}"),
            events = collect => events,
        };
        let _ = stop_tx.send(());
        server.await.unwrap();
        client_thread.join().unwrap();
        events
    })
}

/// Each connection's close reason, by the first frame or bytes it sent (its `Connected` order
/// is not the clients' order).
fn closes(events: &[Event]) -> Vec<(u64, Option<String>)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Closed { conn, error } => Some((*conn, error.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn a_good_client_is_served_while_hostile_ones_are_closed_with_the_reason() {
    let config = ServerConfig {
        stall: Duration::from_millis(500),
        limits: Limits {
            max_header: 1 << 16,
            max_payload: 1 << 20,
        },
        memory_budget: 1 << 24,
        ..ServerConfig::default()
    };
    let events = serve_and_collect(config, 6, |addr| {
        let send = |bytes: &[u8]| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(bytes).unwrap();
            s
        };
        // Garbage; a header over the limit; a tensor before any hello; a payload over the limit.
        drop(send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"));
        let mut big_header = MAGIC.to_vec();
        big_header.extend_from_slice(&(1u32 << 30).to_le_bytes());
        big_header.extend_from_slice(&0u64.to_le_bytes());
        drop(send(&big_header));
        drop(send(&tensor("m", &[1.0])));
        let mut big_payload = hello(0);
        big_payload.extend_from_slice(&MAGIC);
        big_payload.extend_from_slice(&20u32.to_le_bytes());
        big_payload.extend_from_slice(&(1u64 << 40).to_le_bytes());
        drop(send(&big_payload));
        // A client that stops in the middle of a frame and stays connected.
        let half = tensor("m", &[1.0, 2.0]);
        let stalled = send(&[hello(1), half[..half.len() - 3].to_vec()].concat());
        // The good client, meanwhile.
        let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        drop(send(
            &[
                hello(0),
                tensor("model.layers.0.self_attn.o_proj", &values),
                bye(),
            ]
            .concat(),
        ));
        std::thread::sleep(Duration::from_millis(1500));
        drop(stalled);
    });

    let mut errors: Vec<String> = closes(&events).into_iter().filter_map(|(_, e)| e).collect();
    errors.sort();
    assert_eq!(errors.len(), 5, "{errors:#?}");
    for needle in [
        "must start with \"MLAW\", found \"GET \"",
        "header of 1073741824 bytes (limit 65536)",
        "the first frame must be a hello",
        "payload of 1099511627776 bytes (limit 1048576)",
        "no data for 0.5 s inside a frame's payload (5 of 8 bytes)",
    ] {
        assert!(
            errors.iter().any(|e| e.contains(needle)),
            "no error with {needle:?}: {errors:#?}"
        );
    }
    // The good client's frames, whole and in order, and a clean close.
    let (good_conn, tensor_frame) = events
        .iter()
        .find_map(|e| match e {
            Event::Frame { conn, frame, .. }
                if matches!(frame.header.body, Body::Tensor { .. }) =>
            {
                Some((*conn, frame))
            }
            _ => None,
        })
        .expect("the good client's tensor");
    let got: Vec<f32> = tensor_frame
        .payload
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(got, (0..1000).map(|i| i as f32 * 0.5).collect::<Vec<_>>());
    let kinds: Vec<&str> = events
        .iter()
        .filter_map(|e| match e {
            Event::Frame { conn, frame, .. } if *conn == good_conn => {
                Some(match frame.header.body {
                    Body::Hello { .. } => "hello",
                    Body::Tensor { .. } => "tensor",
                    Body::Bye { .. } => "bye",
                    Body::Step { .. } => "step",
                })
            }
            _ => None,
        })
        .collect();
    assert_eq!(kinds, ["hello", "tensor", "bye"]);
    assert!(closes(&events).contains(&(good_conn, None)));
}

#[test]
fn a_hundred_connections_at_once_all_arrive() {
    let events = serve_and_collect(
        ServerConfig {
            max_connections: 128,
            ..ServerConfig::default()
        },
        100,
        |addr| {
            let threads: Vec<_> = (0..100u32)
                .map(|i| {
                    std::thread::spawn(move || {
                        let mut s = TcpStream::connect(addr).unwrap();
                        let values: Vec<f32> = (0..256).map(|j| (i * 1000 + j) as f32).collect();
                        s.write_all(&[hello(i), tensor(&format!("t{i}"), &values), bye()].concat())
                            .unwrap();
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
        },
    );
    assert!(
        closes(&events).iter().all(|(_, e)| e.is_none()),
        "{:#?}",
        closes(&events)
    );
    let mut seen = 0;
    for event in &events {
        if let Event::Frame { frame, .. } = event {
            if let Body::Tensor { module, .. } = &frame.header.body {
                let i: u32 = module[1..].parse().unwrap();
                let first = f32::from_le_bytes(frame.payload[..4].try_into().unwrap());
                let last = f32::from_le_bytes(frame.payload[1020..].try_into().unwrap());
                assert_eq!((first, last), ((i * 1000) as f32, (i * 1000 + 255) as f32));
                seen += 1;
            }
        }
    }
    assert_eq!(seen, 100);
}

#[test]
fn connections_past_the_cap_are_turned_away() {
    let events = serve_and_collect(
        ServerConfig {
            max_connections: 2,
            ..ServerConfig::default()
        },
        3,
        |addr| {
            let mut a = TcpStream::connect(addr).unwrap();
            let mut b = TcpStream::connect(addr).unwrap();
            a.write_all(&hello(0)).unwrap();
            b.write_all(&hello(1)).unwrap();
            std::thread::sleep(Duration::from_millis(300));
            let start = Instant::now();
            let _c = TcpStream::connect(addr).unwrap();
            std::thread::sleep(Duration::from_millis(300).saturating_sub(start.elapsed()));
            a.write_all(&bye()).unwrap();
            b.write_all(&bye()).unwrap();
        },
    );
    let refused: Vec<&str> = events
        .iter()
        .filter_map(|e| match e {
            Event::Refused { reason, .. } => Some(reason.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(refused, ["more than 2 connections"]);
}

#[test]
fn listen_addresses_are_checked() {
    assert!(Listen::parse("127.0.0.1:7777", false).is_ok());
    assert!(Listen::parse("[::1]:7777", false).is_ok());
    assert!(matches!(
        Listen::parse("unix:/tmp/x.sock", false),
        Ok(Listen::Unix(_))
    ));
    let err = Listen::parse("0.0.0.0:7777", false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("not a loopback address; add --allow-remote"),
        "{err}"
    );
    assert!(Listen::parse("0.0.0.0:7777", true).is_ok());
    for bad in ["localhost", "7777", "unix:", "1.2.3.4:99999"] {
        assert!(Listen::parse(bad, true).is_err(), "{bad}");
    }
}

#[test]
fn the_command_refuses_bad_flags_with_one_error_line() {
    for args in [
        &["attach", "--listen", "0.0.0.0:7777"][..],
        &["attach", "--listen", "nowhere"],
        &["attach", "--max-frame-mb", "0"],
        &["attach", "--idle-secs", "0"],
        &["attach", "--stall-secs", "0"],
        &[
            "attach",
            "--listen",
            "127.0.0.1:0",
            "--max-frame-mb",
            "8",
            "--memory-mb",
            "4",
        ],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_mladb"))
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 1, "{args:?}: {stderr}");
    }
}

#[test]
fn a_unix_socket_serves_and_is_removed_after() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mladb.sock");
    let listen = Listen::parse(&format!("unix:{}", path.display()), false).unwrap();
    // (serve_and_collect_on also checks that a second bind on the live path is refused.)
    let events = serve_and_collect_on(&listen, ServerConfig::default(), 1, |address| {
        let path = address.strip_prefix("unix:").unwrap();
        let mut s = std::os::unix::net::UnixStream::connect(path).unwrap();
        s.write_all(&[hello(0), tensor("t", &[1.0, 2.0]), bye()].concat())
            .unwrap();
    });
    assert_eq!(events.len(), 5, "{events:#?}"); // connected, three frames, closed
    assert!(matches!(
        events.last(),
        Some(Event::Closed { error: None, .. })
    ));
    assert!(!path.exists(), "the socket file outlived the server");
}

#[test]
fn the_ingest_benchmark_runs_every_shape() {
    let out = Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(["bench", "--attach-ingest", "--quick"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<&str> = stdout.lines().filter(|l| l.contains("glm5")).collect();
    assert_eq!(rows.len(), 4, "{stdout}");
    for row in rows {
        let gbs: f64 = row
            .split_whitespace()
            .rev()
            .nth(2)
            .unwrap()
            .parse()
            .unwrap();
        assert!(gbs > 0.0, "{row}");
    }
}

#[test]
fn a_connection_silent_between_frames_is_closed_after_the_idle_time() {
    let config = ServerConfig {
        idle: Duration::from_millis(300),
        ..ServerConfig::default()
    };
    let events = serve_and_collect(config, 1, |addr| {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&hello(0)).unwrap();
        std::thread::sleep(Duration::from_millis(1000));
    });
    let errors: Vec<Option<String>> = closes(&events).into_iter().map(|(_, e)| e).collect();
    assert_eq!(errors.len(), 1);
    let error = errors[0].as_deref().unwrap_or("closed cleanly");
    assert!(
        error.contains("no data for 0.3 s between frames"),
        "{error}"
    );
}
