//! The Python hook (python/mladb_hook, standard library only) against mladb: the frame writer
//! (wire.py) against the reader, read back exactly and refusing what the reader would; the
//! sender (hook.py) against `mladb attach`, with frames in order from a background thread, the
//! `drop` policy counting what a full queue turned away, and a file of frames. Needs python3.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::process::{Command, Stdio};

use mladb::attach::wire::{read_frame, Body, Dtype, Limits};

fn python(script: &str) -> Command {
    let mut cmd = Command::new("python3");
    cmd.arg("-c")
        .arg(script)
        .env("PYTHONPATH", concat!(env!("CARGO_MANIFEST_DIR"), "/python"))
        .env("PYTHONDONTWRITEBYTECODE", "1");
    cmd
}

/// Runs `script` with python/ on the path and returns its stdout.
fn run_python(script: &str) -> Vec<u8> {
    let out = python(script)
        .output()
        .expect("python3 must be on the path for this test (CI has it)");
    assert!(
        out.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[test]
fn the_python_sender_talks_to_mladb_attach() {
    let (mut server, address) = common::spawn_attach(&["--json", "--connections", "1"]);
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
    assert_eq!(events[3]["stats"]["pos_inf"], 1);
    assert_eq!(events[3]["stats"]["mean"], 2.0);
    assert_eq!(events[3]["stats"]["count"], 4);
    assert_eq!(events[4]["dtype"], "bf16");
    assert_eq!(events[4]["stats"]["abs_max"], 3.0);
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

#[test]
fn frames_written_by_the_python_hook_are_read_back_exactly() {
    let stream = run_python(
        r#"
import struct, sys
from mladb_hook import wire
out = sys.stdout.buffer
out.write(wire.hello("hf", "glm5-tiny", rank=1, world_size=2))
out.write(wire.step("decode", 3, [7, 8], [12, 13]))
out.write(wire.tensor("model.layers.0.self_attn.o_proj", "f32", [2, 3], struct.pack("<6f", *range(6)), ptr=0x7f0000001000))
out.write(wire.tensor("model.layers.0.self_attn.attn", "bf16", [4], struct.pack("<4H", 0x3f80, 0x4000, 0xbf80, 0), ptr=16, kernel_out_ptr=32))
out.write(wire.bye(dropped=5))
"#,
    );
    let mut reader = stream.as_slice();
    let mut frames = Vec::new();
    while let Some(frame) = read_frame(&mut reader, Limits::default()).unwrap() {
        frames.push(frame);
    }
    assert_eq!(frames.len(), 5);
    assert!(matches!(
        &frames[0].header.body,
        Body::Hello { engine, model, rank: 1, world_size: 2 } if engine == "hf" && model == "glm5-tiny"
    ));
    assert!(matches!(
        &frames[1].header.body,
        Body::Step { phase, step: 3, tokens, positions }
            if phase == "decode" && tokens == &[7, 8] && positions == &[12, 13]
    ));
    match &frames[2].header.body {
        Body::Tensor {
            module,
            dtype: Dtype::F32,
            shape,
            ptr: Some(0x7f00_0000_1000),
            kernel_out_ptr: None,
        } => {
            assert_eq!(module, "model.layers.0.self_attn.o_proj");
            assert_eq!(shape, &[2, 3]);
        }
        other => panic!("not the f32 tensor: {other:?}"),
    }
    let values: Vec<f32> = frames[2]
        .payload
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(values, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    assert!(matches!(
        &frames[3].header.body,
        Body::Tensor {
            dtype: Dtype::Bf16,
            ptr: Some(16),
            kernel_out_ptr: Some(32),
            ..
        }
    ));
    let bf16: Vec<f32> = frames[3]
        .payload
        .chunks_exact(2)
        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert_eq!(bf16, [1.0, 2.0, -1.0, 0.0]);
    assert!(matches!(frames[4].header.body, Body::Bye { dropped: 5 }));
}

#[test]
fn the_python_writer_refuses_what_the_reader_would() {
    let text = String::from_utf8(run_python(
        r#"
from mladb_hook import wire
for args in [("m", "f32", [3], b"\0" * 8), ("m", "f64", [1], b"\0" * 8), ("m", "i64", [2, 2], b"\0" * 31)]:
    try:
        wire.tensor(*args)
        print("accepted", args[:3])
    except ValueError as e:
        print("refused:", e)
"#,
    ))
    .unwrap();
    assert_eq!(text.lines().count(), 3, "{text}");
    assert!(text.lines().all(|l| l.starts_with("refused:")), "{text}");
    assert!(text.contains("needs 12 bytes, got 8"), "{text}");
}

/// `mladb attach --model DIR --json` against tools/replay_dump.py replaying `dump` (with
/// `extra` arguments); returns the JSON lines and the exit code.
fn attach_replay(model: &str, dump: &str, extra: &[&str]) -> (Vec<serde_json::Value>, i32) {
    let root = env!("CARGO_MANIFEST_DIR");
    let model = format!("{root}/{model}");
    let (server, address) =
        common::spawn_attach(&["--json", "--connections", "1", "--model", &model]);
    let replay = Command::new("python3")
        .arg(format!("{root}/tools/replay_dump.py"))
        .arg(format!("{root}/{dump}"))
        .args(["--address", &address])
        .args(extra)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 must be on the path for this test (CI has it)");
    assert!(
        replay.status.success(),
        "{}",
        String::from_utf8_lossy(&replay.stderr)
    );
    let out = server.wait_with_output().unwrap();
    let lines = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (lines, out.status.code().unwrap_or(-1))
}

const GLM5_DUMP: &str = "tests/fixtures/hf/glm5-sparse/hf-dump.safetensors";

fn findings(lines: &[serde_json::Value]) -> Vec<&serde_json::Value> {
    lines.iter().filter(|v| v["event"] == "finding").collect()
}

#[test]
fn transformers_outputs_replayed_live_agree_with_mladb_at_every_mapped_op() {
    // Every module output transformers wrote for the GLM-5 fixture (prefill and seven decode
    // steps), sent as the hook would have sent it, against mladb's reference of the checkpoint.
    let (lines, code) = attach_replay("tests/fixtures/hf/glm5-sparse", GLM5_DUMP, &[]);
    assert!(findings(&lines).is_empty(), "{:#?}", findings(&lines));
    let summary = lines.iter().find(|v| v["event"] == "summary").unwrap();
    assert_eq!(summary["totals"]["steps"], 8, "{summary}");
    assert!(
        summary["totals"]["compared"].as_u64().unwrap() >= 500,
        "{summary}"
    );
    assert_eq!(summary["totals"]["divergent"], 0);
    assert_eq!(code, 0);
}

#[test]
fn a_divergence_planted_in_a_transformers_tensor_is_found_at_its_op() {
    let (lines, code) = attach_replay(
        "tests/fixtures/hf/glm5-sparse",
        GLM5_DUMP,
        &["--scale", "decode.2/model.layers.1.self_attn.q_b_proj=1.5"],
    );
    let f = findings(&lines);
    assert_eq!(f.len(), 1, "{f:#?}");
    assert_eq!(f[0]["kind"], "reference-mismatch");
    assert_eq!(f[0]["op"], "model.layers.1.self_attn.q_b_proj");
    assert_eq!(f[0]["phase"], "decode.2");
    assert_eq!(code, 1);
}

#[test]
fn an_engine_running_another_model_is_never_an_all_clear() {
    // The GLM-5 fixture's tensors against a DeepSeek-V3 checkpoint: other sizes, other numbers.
    let (lines, code) = attach_replay("tests/fixtures/hf/deepseek-v3-plain", GLM5_DUMP, &[]);
    assert!(!findings(&lines).is_empty(), "{lines:#?}");
    assert_eq!(code, 1);
}
