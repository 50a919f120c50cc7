//! The Python hook's sender (python/mladb_hook/hook.py, standard library only) against
//! `mladb attach` and mladb's frame reader: frames in order from a background thread, the
//! `drop` policy counting what a full queue turned away, a file of frames. Needs python3.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::process::{Command, Stdio};

use mladb::attach::wire::{read_frame, Body, Limits};

fn python(script: &str) -> Command {
    let mut cmd = Command::new("python3");
    cmd.arg("-c")
        .arg(script)
        .env("PYTHONPATH", concat!(env!("CARGO_MANIFEST_DIR"), "/python"))
        .env("PYTHONDONTWRITEBYTECODE", "1");
    cmd
}

fn run_python(script: &str) -> String {
    let out = python(script)
        .output()
        .expect("python3 must be on the path for this test (CI has it)");
    assert!(
        out.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_python_sender_talks_to_mladb_attach() {
    let mut server = Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args([
            "attach",
            "--listen",
            "127.0.0.1:0",
            "--json",
            "--connections",
            "1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(server.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    let address = line
        .trim()
        .strip_prefix("mladb attach: listening on ")
        .unwrap_or_else(|| panic!("no address on stderr: {line:?}"))
        .to_string();
    run_python(&format!(
        r#"
import struct
from mladb_hook import Sender
with Sender("{address}", "hf", "glm5-tiny", rank=1, world_size=2) as s:
    s.step("prefill", 0, [1, 2, 3], [0, 1, 2])
    s.tensor("model.layers.0.self_attn", "f32", [2, 2], struct.pack("<4f", 1, 2, 3, float("inf")), ptr=4096)
    s.tensor("model.layers.0.mlp", "bf16", [1], struct.pack("<H", 0x4040), ptr=8192)
"#
    ));
    let mut stdout = String::new();
    server
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    let status = server.wait().unwrap();
    assert!(status.success(), "{stdout}");
    let events: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "connected",
            "hello",
            "step",
            "tensor",
            "tensor",
            "bye",
            "closed"
        ],
        "{stdout}"
    );
    assert_eq!(events[1]["rank"], 1);
    assert_eq!(events[1]["world_size"], 2);
    assert_eq!(events[2]["tokens"], serde_json::json!([1, 2, 3]));
    assert_eq!(events[3]["rank"], 1);
    assert_eq!(events[3]["ptr"], "0x1000");
    assert_eq!(events[3]["stats"]["inf"], 1);
    assert_eq!(events[3]["stats"]["mean"], 2.0);
    assert_eq!(events[4]["dtype"], "bf16");
    assert_eq!(events[4]["stats"]["max_abs"], 3.0);
    assert_eq!(events[5]["dropped"], 0);
    assert!(events[6]["error"].is_null(), "{stdout}");
}

#[test]
fn a_full_queue_under_the_drop_policy_drops_and_counts() {
    // A listener that reads nothing until the sender has tried all its tensors: the socket's
    // buffers fill, the sender's thread blocks, its queue of two fills, and the rest is dropped.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    let mut child = python(&format!(
        r#"
import sys
from mladb_hook import Sender
s = Sender("{address}", "hf", "m", queue_size=2, policy="drop")
for i in range(40):
    s.tensor(f"t{{i}}", "f32", [262144], bytes(1 << 20))
print(s.dropped, flush=True)
sys.stdin.readline()
s.close()
"#
    ))
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let (mut stream, _) = listener.accept().unwrap();
    let mut said = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut said)
        .unwrap();
    let dropped: u64 = said.trim().parse().unwrap();
    drop(child.stdin.take()); // lets the sender close
    let limits = Limits::default();
    let mut tensors = 0u64;
    let mut bye = None;
    while let Some(frame) = read_frame(&mut stream, limits).unwrap() {
        match frame.header.body {
            Body::Tensor { .. } => tensors += 1,
            Body::Bye { dropped } => bye = Some(dropped),
            _ => {}
        }
    }
    assert!(child.wait().unwrap().success());
    assert!(dropped > 0, "nothing was dropped");
    assert_eq!(bye, Some(dropped));
    assert_eq!(tensors + dropped, 40);
}

#[test]
fn a_file_address_writes_the_frames_to_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.frames");
    run_python(&format!(
        r#"
from mladb_hook import Sender
with Sender("file:{}", "hf", "m") as s:
    s.tensor("x", "i64", [2], (7).to_bytes(8, "little") + (9).to_bytes(8, "little"))
"#,
        path.display()
    ));
    let bytes = std::fs::read(&path).unwrap();
    let mut reader = &bytes[..];
    let mut kinds = Vec::new();
    while let Some(frame) = read_frame(&mut reader, Limits::default()).unwrap() {
        kinds.push(match frame.header.body {
            Body::Hello { .. } => "hello",
            Body::Tensor { .. } => "tensor",
            Body::Bye { .. } => "bye",
            Body::Step { .. } => "step",
        });
    }
    assert_eq!(kinds, ["hello", "tensor", "bye"]);
}
