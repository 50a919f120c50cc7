//! `mladb attach --layout` compares a running engine with mladb's reference, live. A Rust client
//! replays a recorded run of glm5-tiny as two tensor-parallel ranks at once, each on its own
//! socket, under vLLM-style names (a fused q_a/kv_a projection cut by columns, column-parallel
//! heads, row-parallel partial sums, replicated norms), with one planted numerical divergence in
//! rank 1's shard and one planted pointer disconnect in rank 0's attention wrapper: attach must
//! report both at the right op and rank, and nothing else. The clean replay reports nothing.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};

use mladb::attach::wire::{encode, Body, Dtype, Header, WIRE_VERSION};
use mladb::backend::cpu::CpuBackend;
use mladb::debug::runner::Job;
use mladb::debug::{Flags, RunRecord};
use mladb::engine::generate::Schedule;
use mladb::engine::trace::Phase;
use serde_json::Value;

const SEED: u64 = 5;

/// The test engine's names: vLLM's way of fusing and sharding, on mladb's op names.
const MAP: &str = r#"(
    engine: "tp-test",
    source: "tests/attach_live.rs",
    rules: [
        (from: "model.layers.*.self_attn.fused_qkv_a_proj", split: [
            (to: Some("model.layers.*.self_attn.q_a_proj"), width: "q_lora_rank"),
            (to: Some("model.layers.*.self_attn.kv_a_proj_with_mqa"), width: "kv_lora_rank + qk_rope_head_dim"),
        ]),
        (from: "model.layers.*.self_attn.q_b_proj", to: Some("model.layers.*.self_attn.q_b_proj"), shard: Columns),
        (from: "model.layers.*.self_attn.mla_attn", to: Some("model.layers.*.self_attn.attn_output"), shard: Columns, kernel_output: true),
        (from: "model.layers.*.self_attn.o_proj", to: Some("model.layers.*.self_attn.o_proj"), shard: RowSum),
        (from: "model.layers.*.self_attn.rotary_emb", to: None),
    ],
)"#;

/// The reference run the client replays: glm5-tiny, a prefill of 5 tokens and 2 decode steps.
fn recorded() -> (RunRecord, Vec<u32>, usize) {
    let model = common::synthetic("glm5-tiny", SEED);
    let schedule = Schedule {
        prompt: vec![3, 14, 15, 92, 65],
        prefill_len: 5,
        decode_steps: 2,
    };
    let layers = 0..model.layout.num_layers;
    let job = Job {
        model: &model,
        backend: &CpuBackend,
        schedule: &schedule,
        layers: &layers,
        poison: true,
    };
    let run = job.run(Flags::parse("").unwrap(), None).unwrap();
    let tokens = run.outcome.as_ref().unwrap().tokens.clone();
    (run, tokens, model.layout.q_lora_rank.unwrap())
}

fn frame(body: Body, values: &[f32]) -> Vec<u8> {
    let payload: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    encode(
        &Header {
            v: WIRE_VERSION,
            body,
        },
        &payload,
    )
    .unwrap()
}

fn tensor(module: &str, values: &[f32], ptr: u64, kernel_out_ptr: Option<u64>) -> Vec<u8> {
    let body = Body::Tensor {
        module: module.into(),
        dtype: Dtype::F32,
        shape: vec![values.len() as u64],
        ptr: Some(ptr),
        kernel_out_ptr,
    };
    frame(body, values)
}

/// Rank `rank`'s columns `[rank·w/2, (rank+1)·w/2)` of each row of a `rows`-row tensor.
fn half(values: &[f32], rows: usize, rank: usize) -> Vec<f32> {
    let w = values.len() / rows;
    (0..rows)
        .flat_map(|r| values[r * w + rank * w / 2..r * w + (rank + 1) * w / 2].to_vec())
        .collect()
}

/// What a planted fault changes.
#[derive(Clone, Copy, PartialEq)]
enum Plant {
    None,
    /// Rank 1's shard of layer 2's q_b_proj in the second decode step is off.
    Divergence,
    /// Rank 0's attention wrapper of layer 1 in the prefill hands on a buffer its kernel did not
    /// write (the values are right: only the pointers tell).
    Disconnect,
}

/// Rank `rank`'s frames for the whole recorded run.
fn rank_frames(
    run: &RunRecord,
    tokens: &[u32],
    q_lora: usize,
    rank: usize,
    plants: &[Plant],
) -> Vec<Vec<u8>> {
    let hello = Body::Hello {
        engine: "tp-test".into(),
        model: "glm5-tiny".into(),
        rank: rank as u32,
        world_size: 2,
    };
    let mut out = vec![frame(hello, &[])];
    let phases = run.phases();
    for (step, phase) in phases.iter().enumerate() {
        let (toks, start) = match phase {
            Phase::Prefill => (tokens[..5].to_vec(), 0),
            Phase::Decode(k) => (vec![tokens[5 + k]], 5 + k),
        };
        let rows = toks.len();
        let positions = (start as u32..(start + rows) as u32).collect();
        let body = Body::Step {
            phase: if rows > 1 { "prefill" } else { "decode" }.into(),
            step: step as u64,
            tokens: toks,
            positions,
        };
        out.push(frame(body, &[]));
        let mut q_a: Option<Vec<f32>> = None;
        for (i, e) in run
            .events
            .iter()
            .enumerate()
            .filter(|(_, e)| e.phase == *phase)
        {
            let v = run.outputs[i].data();
            let ptr = 0x7000_0000 + (i as u64) * 0x1000;
            let name = e.name.as_str();
            if name.ends_with("self_attn.q_a_proj") {
                q_a = Some(v.to_vec());
            } else if name.ends_with("self_attn.kv_a_proj_with_mqa") {
                // Fused: q_a's columns then kv_a's, per token, on every rank.
                let q = q_a.take().unwrap();
                let kv_w = v.len() / rows;
                let fused: Vec<f32> = (0..rows)
                    .flat_map(|r| {
                        let mut row = q[r * q_lora..(r + 1) * q_lora].to_vec();
                        row.extend_from_slice(&v[r * kv_w..(r + 1) * kv_w]);
                        row
                    })
                    .collect();
                out.push(tensor(
                    &name.replace("kv_a_proj_with_mqa", "fused_qkv_a_proj"),
                    &fused,
                    ptr,
                    None,
                ));
            } else if name.ends_with("self_attn.q_b_proj") {
                let mut mine = half(v, rows, rank);
                let planted = plants.contains(&Plant::Divergence)
                    && rank == 1
                    && *phase == Phase::Decode(1)
                    && name == "model.layers.2.self_attn.q_b_proj";
                if planted {
                    for x in mine.iter_mut().take(8) {
                        *x += 0.75;
                    }
                }
                out.push(tensor(name, &mine, ptr, None));
            } else if name.ends_with("self_attn.attn_output") {
                let planted = plants.contains(&Plant::Disconnect)
                    && rank == 0
                    && *phase == Phase::Prefill
                    && name == "model.layers.1.self_attn.attn_output";
                let kernel = if planted { ptr + 0x100_0000 } else { ptr };
                out.push(tensor(
                    &name.replace("attn_output", "mla_attn"),
                    &half(v, rows, rank),
                    ptr,
                    Some(kernel),
                ));
            } else if name.ends_with("self_attn.o_proj") {
                // Row-parallel partial sums: rank 0 holds v − s, rank 1 holds s.
                let part: Vec<f32> = v
                    .iter()
                    .enumerate()
                    .map(|(j, x)| {
                        let s = ((j * 37 % 11) as f32 - 5.0) * 0.125;
                        if rank == 0 {
                            x - s
                        } else {
                            s
                        }
                    })
                    .collect();
                out.push(tensor(name, &part, ptr, None));
            } else {
                out.push(tensor(name, v, ptr, None));
            }
        }
    }
    out.push(frame(Body::Bye { dropped: 0 }, &[]));
    out
}

/// Runs `mladb attach` against the two ranks of the recorded run; returns its JSON lines and
/// its exit code.
fn attach(plants: &[Plant]) -> (Vec<Value>, i32) {
    let dir = tempfile::tempdir().unwrap();
    let map = dir.path().join("tp-test.ron");
    std::fs::write(&map, MAP).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args([
            "attach",
            "--listen",
            "127.0.0.1:0",
            "--json",
            "--connections",
            "2",
        ])
        .args([
            "--layout",
            "glm5-tiny",
            "--seed",
            &SEED.to_string(),
            "--name-map",
        ])
        .arg(&map)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    let address = line
        .trim()
        .strip_prefix("mladb attach: listening on ")
        .unwrap_or_else(|| panic!("no address in '{line}'"))
        .to_string();
    let (run, tokens, q_lora) = recorded();
    let ranks: Vec<Vec<Vec<u8>>> = (0..2)
        .map(|r| rank_frames(&run, &tokens, q_lora, r, plants))
        .collect();
    // Both ranks at once, each on its own connection and thread.
    std::thread::scope(|s| {
        for frames in &ranks {
            let address = address.clone();
            s.spawn(move || {
                let mut stream = TcpStream::connect(&address).unwrap();
                for f in frames {
                    stream.write_all(f).unwrap();
                }
            });
        }
    });
    let output = child.wait_with_output().unwrap();
    let lines = String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("'{l}': {e}")))
        .collect();
    (lines, output.status.code().unwrap_or(-1))
}

fn of_event<'a>(lines: &'a [Value], event: &str) -> Vec<&'a Value> {
    lines.iter().filter(|v| v["event"] == event).collect()
}

#[test]
fn a_clean_two_rank_replay_agrees_everywhere() {
    let (lines, code) = attach(&[Plant::None]);
    let findings = of_event(&lines, "finding");
    assert!(findings.is_empty(), "{findings:#?}");
    let compared = of_event(&lines, "compared");
    let summary = of_event(&lines, "summary");
    let totals = &summary[0]["totals"];
    // Three steps; every op of each is compared (the fused projection as its two ops; the
    // sharded ones once for both ranks, the replicated ones once per rank).
    assert_eq!(totals["steps"], 3, "{totals}");
    assert_eq!(totals["divergent"], 0);
    assert_eq!(compared.len() as u64, totals["compared"].as_u64().unwrap());
    assert!(compared.len() > 300, "{} compared", compared.len());
    for op in [
        "self_attn.q_a_proj",
        "self_attn.kv_a_proj_with_mqa",
        "self_attn.q_b_proj",
        "self_attn.attn_output",
        "self_attn.o_proj",
    ] {
        assert!(
            compared
                .iter()
                .any(|c| c["op"].as_str().unwrap().ends_with(op)),
            "{op} compared"
        );
    }
    assert_eq!(
        totals["not_in_run"].as_array().unwrap().len(),
        0,
        "{totals}"
    );
    assert_eq!(code, 0);
}

#[test]
fn a_planted_divergence_and_disconnect_are_reported_at_their_op_and_rank() {
    let (lines, code) = attach(&[Plant::Divergence, Plant::Disconnect]);
    let findings = of_event(&lines, "finding");
    assert_eq!(findings.len(), 2, "{findings:#?}");
    let mismatch = findings
        .iter()
        .find(|f| f["kind"] == "reference-mismatch")
        .unwrap();
    assert_eq!(
        mismatch["op"], "model.layers.2.self_attn.q_b_proj",
        "{mismatch}"
    );
    assert_eq!(mismatch["phase"], "decode.1");
    assert_eq!(mismatch["rank"], 1, "{mismatch}");
    assert_eq!(mismatch["step"], 2);
    let disconnect = findings
        .iter()
        .find(|f| f["kind"] == "buffer-disconnect")
        .unwrap();
    assert_eq!(
        disconnect["op"], "model.layers.1.self_attn.attn_output",
        "{disconnect}"
    );
    assert_eq!(disconnect["rank"], 0);
    assert_eq!(disconnect["phase"], "prefill");
    assert!(disconnect["detail"]
        .as_str()
        .unwrap()
        .contains("the kernel wrote buffer"));
    assert_eq!(code, 1, "findings make attach exit 1");
}
