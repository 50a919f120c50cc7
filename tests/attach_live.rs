//! `mladb attach --layout` compares a running engine with mladb's reference, live. A Rust client
//! replays a recorded run of glm5-tiny as two tensor-parallel ranks at once, each on its own
//! socket, under vLLM-style names (a fused q_a/kv_a projection cut by columns, column-parallel
//! heads, row-parallel partial sums, replicated norms), with one planted numerical divergence in
//! rank 1's shard and one planted pointer disconnect in rank 0's attention wrapper: attach must
//! report both at the right op and rank, and nothing else. The clean replay reports nothing.

mod common;

use std::io::Write;
use std::net::TcpStream;

use mladb::attach::wire::{encode, Body, Dtype, Header, WIRE_VERSION};
use mladb::backend::cpu::CpuBackend;
use mladb::debug::runner::Job;
use mladb::debug::{Flags, RunRecord};
use mladb::engine::generate::Schedule;
use mladb::engine::trace::Phase;
use mladb::engine::ForcedSelections;
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
        (from: "model.layers.*.mlp.gate_up_proj", split_per_rank: true, shard: Columns, split: [
            (to: Some("model.layers.*.mlp.gate_proj"), width: "intermediate_size"),
            (to: Some("model.layers.*.mlp.up_proj"), width: "intermediate_size"),
        ]),
    ],
)"#;

/// The reference run the client replays: glm5-tiny, a prefill of 5 tokens and 2 decode steps.
fn recorded() -> (RunRecord, Vec<u32>, usize) {
    recorded_with(vec![3, 14, 15, 92, 65])
}

/// The same with another prompt, all of it prefilled.
fn recorded_with(prompt: Vec<u32>) -> (RunRecord, Vec<u32>, usize) {
    recorded_forced(prompt, ForcedSelections::default())
}

/// The same with choices imposed: the run of an engine that chose otherwise than mladb.
fn recorded_forced(prompt: Vec<u32>, forced: ForcedSelections) -> (RunRecord, Vec<u32>, usize) {
    let model = common::synthetic("glm5-tiny", SEED);
    let schedule = Schedule {
        prefill_len: prompt.len(),
        prompt,
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
    let forced = std::sync::Arc::new(forced);
    let run = job
        .run_forced(Flags::parse("").unwrap(), &schedule, &forced, None)
        .unwrap();
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
        let mut gate: Option<Vec<f32>> = None;
        for (i, e) in run
            .events
            .iter()
            .enumerate()
            .filter(|(_, e)| e.phase == *phase)
        {
            let v = run.outputs[i].data();
            let ptr = 0x7000_0000 + (i as u64) * 0x1000;
            let name = e.name.as_str();
            // A fused-MoE engine has no module per expert: mladb's ops of each expert have
            // no counterpart among its outputs.
            if e.kind == mladb::engine::trace::OpKind::Expert {
                continue;
            }
            if name.ends_with("self_attn.q_a_proj") {
                q_a = Some(v.to_vec());
            } else if name.ends_with("mlp.gate_proj") {
                gate = Some(v.to_vec());
            } else if name.ends_with("mlp.up_proj") {
                // Merged column-parallel: this rank's [gate_r | up_r] per token.
                let (g, u) = (half(&gate.take().unwrap(), rows, rank), half(v, rows, rank));
                let w = g.len() / rows;
                let fused: Vec<f32> = (0..rows)
                    .flat_map(|r| [&g[r * w..(r + 1) * w], &u[r * w..(r + 1) * w]].concat())
                    .collect();
                out.push(tensor(
                    &name.replace("up_proj", "gate_up_proj"),
                    &fused,
                    ptr,
                    None,
                ));
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
    attach_saving(plants, &[])
}

/// The same with `extra` arguments (`--save DIR`).
fn attach_saving(plants: &[Plant], extra: &[&str]) -> (Vec<Value>, i32) {
    let dir = tempfile::tempdir().unwrap();
    let map = dir.path().join("tp-test.ron");
    std::fs::write(&map, MAP).unwrap();
    let seed = SEED.to_string();
    let mut args = vec!["--json", "--connections", "2", "--layout", "glm5-tiny"];
    args.extend(["--seed", &seed, "--name-map", map.to_str().unwrap()]);
    args.extend(extra);
    let (child, address) = common::spawn_attach(&args);
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
        "mlp.gate_proj",
        "mlp.up_proj",
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

/// vLLM hands the attention output on twice under tensor parallelism: the MLA layer's own
/// output (`mla_attn.mla_attn`) and o_proj's input, both one op's columns. Rank 0 sends both
/// before rank 1 sends anything, and rank 1's o_proj input is off: each module's shards must be
/// put together apart, so the second is compared, not mixed with the first or left waiting.
#[test]
fn two_modules_of_one_sharded_op_are_assembled_apart() {
    use mladb::attach::live::{Comparator, Input, Live};
    use mladb::debug::name_map::NameMap;
    const TWO: &str = r#"(
        engine: "tp-two",
        source: "tests/attach_live.rs",
        rules: [
            (from: "model.layers.*.self_attn.mla_attn", to: Some("model.layers.*.self_attn.attn_output"), shard: Columns, kernel_output: true),
            (from: "model.layers.*.self_attn.o_proj.input", to: Some("model.layers.*.self_attn.attn_output"), shard: Columns, kernel_output: true),
        ],
    )"#;
    let model = common::synthetic("glm5-tiny", SEED);
    let (run, tokens, _) = recorded();
    let map: NameMap = ron::from_str(TWO).unwrap();
    let op = "model.layers.0.self_attn.attn_output";
    let i = run
        .events
        .iter()
        .position(|e| e.phase == Phase::Prefill && e.name == op)
        .unwrap();
    let whole = run.outputs[i].data();
    let mut c = Comparator::new(
        &model,
        &CpuBackend,
        Flags::parse("").unwrap(),
        0..model.layout.num_layers,
        Some(map),
        None,
    );
    let mut lives = Vec::new();
    for rank in 0..2u32 {
        lives.extend(c.take(Input::Hello {
            conn: rank as u64,
            engine: "tp-two".into(),
            rank,
            world_size: 2,
        }));
        lives.extend(c.take(Input::Step {
            conn: rank as u64,
            step: 0,
            tokens: tokens[..5].to_vec(),
            positions: (0..5).collect(),
        }));
    }
    let module = |name: &str| format!("model.layers.0.self_attn.{name}");
    for (rank, name) in [
        (0, "mla_attn"),
        (0, "o_proj.input"),
        (1, "mla_attn"),
        (1, "o_proj.input"),
    ] {
        let mut data = half(whole, 5, rank);
        if rank == 1 && name == "o_proj.input" {
            data.iter_mut().for_each(|x| *x *= 1.5);
        }
        lives.extend(c.take(Input::Tensor {
            conn: rank as u64,
            module: module(name),
            dtype: Dtype::F32,
            data,
            ptr: Some(0x9000 + rank as u64),
            kernel_out_ptr: Some(0x9000 + rank as u64),
            budget: None,
        }));
    }
    lives.extend(c.finish());
    let waiting: Vec<_> = lives
        .iter()
        .filter(|l| matches!(l, Live::Note { text, .. } if text.contains("only ranks")))
        .collect();
    assert!(waiting.is_empty(), "every shard was sent: {waiting:#?}");
    let findings: Vec<_> = lives
        .iter()
        .filter_map(|l| match l {
            Live::Finding { finding, .. } => Some(finding),
            _ => None,
        })
        .collect();
    assert_eq!(findings.len(), 1, "{lives:#?}");
    assert_eq!(findings[0].op, op);
    assert!(
        findings[0].detail.contains("o_proj.input"),
        "{}",
        findings[0].detail
    );
    assert_eq!(
        c.totals.compared, 2,
        "each module compared once, both ranks together"
    );
}

/// Two ranks; the engine runs one prompt (a prefill), then another from position 0. Rank 0
/// gets to the second prompt before rank 1 has sent its tensors of the first: those are
/// compared with mladb's run of the first prompt, not with the run of the second that replaced
/// it (a false finding at every op, before).
#[test]
fn a_lagging_rank_is_compared_with_its_own_sequence() {
    use mladb::attach::live::{Comparator, Input, Live};
    use mladb::debug::name_map::NameMap;
    let model = common::synthetic("glm5-tiny", SEED);
    let prompts = [vec![3, 14, 15, 92, 65], vec![27, 18, 28, 18]];
    let runs: Vec<_> = prompts.iter().map(|p| recorded_with(p.clone()).0).collect();
    let mut c = Comparator::new(
        &model,
        &CpuBackend,
        Flags::parse("").unwrap(),
        0..model.layout.num_layers,
        Some(NameMap::identity()),
        None,
    );
    let mut lives = Vec::new();
    let mut take = |c: &mut Comparator, input: Input| lives.extend(c.take(input));
    let step = |rank: u32, s: usize| Input::Step {
        conn: rank as u64,
        step: s as u64,
        tokens: prompts[s].clone(),
        positions: (0..prompts[s].len() as u32).collect(),
    };
    let tensors = |rank: u32, s: usize| -> Vec<Input> {
        let run = &runs[s];
        run.events
            .iter()
            .enumerate()
            .filter(|(_, e)| e.phase == Phase::Prefill)
            .map(|(i, e)| Input::Tensor {
                conn: rank as u64,
                module: e.name.clone(),
                dtype: Dtype::F32,
                data: run.outputs[i].data().to_vec(),
                ptr: Some(0x1000 + i as u64),
                kernel_out_ptr: None,
                budget: None,
            })
            .collect()
    };
    for rank in 0..2u32 {
        let hello = Input::Hello {
            conn: rank as u64,
            engine: "lag-test".into(),
            rank,
            world_size: 2,
        };
        take(&mut c, hello);
    }
    // Rank 0: the whole first prompt, then the second's step.
    take(&mut c, step(0, 0));
    for t in tensors(0, 0) {
        take(&mut c, t);
    }
    take(&mut c, step(0, 1));
    // Rank 1, late: the first prompt, then the second; rank 0 ends the second.
    take(&mut c, step(1, 0));
    for t in tensors(1, 0) {
        take(&mut c, t);
    }
    take(&mut c, step(1, 1));
    for rank in 0..2 {
        for t in tensors(rank, 1) {
            take(&mut c, t);
        }
    }
    lives.extend(c.finish());
    let findings: Vec<_> = lives
        .iter()
        .filter_map(|l| match l {
            Live::Finding { finding, .. } => Some(format!("{} {}", finding.op, finding.detail)),
            _ => None,
        })
        .collect();
    assert!(findings.is_empty(), "{findings:#?}");
    let per_rank = runs
        .iter()
        .map(|r| {
            r.events
                .iter()
                .filter(|e| e.phase == Phase::Prefill)
                .count()
        })
        .sum::<usize>() as u64;
    assert_eq!(
        c.totals.compared,
        2 * per_rank,
        "every tensor of both ranks compared"
    );
}

/// One rank's frames of the recorded run, each tensor passed through `edit` first.
fn engine_frames(
    run: &RunRecord,
    tokens: &[u32],
    edit: &dyn Fn(Phase, &str, &mut Vec<f32>),
) -> Vec<Vec<u8>> {
    let hello = Body::Hello {
        engine: "mladb-names".into(),
        model: "glm5-tiny".into(),
        rank: 0,
        world_size: 1,
    };
    let mut out = vec![frame(hello, &[])];
    let prefill = tokens.len() - run.outcome.as_ref().unwrap().generated.len();
    for (step, phase) in run.phases().iter().enumerate() {
        let (toks, start) = match phase {
            Phase::Prefill => (tokens[..prefill].to_vec(), 0),
            Phase::Decode(k) => (vec![tokens[prefill + k]], prefill + k),
        };
        let positions = (start as u32..(start + toks.len()) as u32).collect();
        out.push(frame(
            Body::Step {
                phase: "x".into(),
                step: step as u64,
                tokens: toks,
                positions,
            },
            &[],
        ));
        for (i, e) in run
            .events
            .iter()
            .enumerate()
            .filter(|(_, e)| e.phase == *phase)
        {
            let mut v = run.outputs[i].data().to_vec();
            edit(*phase, &e.name, &mut v);
            out.push(tensor(&e.name, &v, 0x1000, None));
        }
    }
    out.push(frame(Body::Bye { dropped: 0 }, &[]));
    out
}

/// `mladb attach --layout glm5-tiny` (identity names) against `frames`, with `extra` flags.
fn attach_frames(frames: Vec<Vec<u8>>, extra: &[&str]) -> (Vec<Value>, i32) {
    let seed = SEED.to_string();
    let mut args = vec![
        "--json",
        "--connections",
        "1",
        "--layout",
        "glm5-tiny",
        "--seed",
        &seed,
    ];
    args.extend(["--name-map", "hf"]);
    args.extend(extra);
    let (child, address) = common::spawn_attach(&args);
    let mut stream = TcpStream::connect(&address).unwrap();
    for f in &frames {
        stream.write_all(f).unwrap();
    }
    drop(stream);
    let output = child.wait_with_output().unwrap();
    let lines = String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (lines, output.status.code().unwrap_or(-1))
}

/// Each prefill MoE gate of `run`: its name, its router logits, and the experts mladb's routing
/// chooses from them per row.
fn prefill_routes(
    run: &RunRecord,
    model: &mladb::model::Model,
) -> Vec<(String, Vec<f32>, Vec<Vec<usize>>)> {
    let moe = model.layout.moe.clone().unwrap();
    let e = moe.n_routed_experts;
    let mut out = Vec::new();
    for (i, ev) in run.events.iter().enumerate() {
        if ev.phase != Phase::Prefill || !ev.name.ends_with(".mlp.gate") {
            continue;
        }
        let logits = run.outputs[i].data().to_vec();
        let bias = model
            .weights
            .get(&format!("{}.e_score_correction_bias", ev.name))
            .unwrap();
        let rows = logits.len() / e;
        let chosen = mladb::ops::moe::route(
            &mladb::tensor::Tensor::from_vec(&[rows, e], logits.clone()),
            bias.data(),
            &moe,
        )
        .experts;
        out.push((ev.name.clone(), logits, chosen));
    }
    out
}

#[test]
fn experts_chosen_otherwise_from_agreeing_router_logits_are_a_flip_not_a_finding() {
    use mladb::model::layout::Layout;
    use mladb::ops::moe::route;
    use mladb::tensor::Tensor;
    let (run, tokens, _) = recorded();
    let model = common::synthetic("glm5-tiny", SEED);
    let moe = model.layout.moe.clone().unwrap();
    let e = moe.n_routed_experts;
    // Over the prefill rows of the MoE layers: a chosen expert and a passed-over one whose
    // logits are the closest among the pairs whose swap changes the choice (the least change to
    // the logits that flips it).
    let mut pairs: Vec<(f32, String, usize, usize, usize)> = Vec::new();
    for (gate, logits, chosen) in prefill_routes(&run, &model) {
        let rows = logits.len() / e;
        let bias = model
            .weights
            .get(&format!("{gate}.e_score_correction_bias"))
            .unwrap();
        for (r, c) in chosen.iter().enumerate() {
            for &a in c {
                for b in (0..e).filter(|j| !c.contains(j)) {
                    let mut v = logits.to_vec();
                    v.swap(r * e + a, r * e + b);
                    let now = route(&Tensor::from_vec(&[rows, e], v), bias.data(), &moe).experts;
                    let (mut x, mut y) = (now[r].clone(), c.clone());
                    x.sort_unstable();
                    y.sort_unstable();
                    if x != y {
                        pairs.push((
                            (logits[r * e + a] - logits[r * e + b]).abs(),
                            gate.clone(),
                            r,
                            a,
                            b,
                        ));
                    }
                }
            }
        }
    }
    pairs.sort_by(|x, y| x.0.total_cmp(&y.0));
    let (_, gate, row, a, b) = pairs.first().cloned().expect("some swap flips a choice");
    let layer = gate.trim_end_matches(".mlp.gate").to_string();
    let swap = |phase: Phase, name: &str, v: &mut Vec<f32>| {
        if phase == Phase::Prefill && name == gate {
            v.swap(row * e + a, row * e + b);
        }
    };
    // The experts' output after the flip differs (here: planted, threefold).
    let experts = format!("{layer}.mlp.experts");
    let off = |phase: Phase, name: &str, v: &mut Vec<f32>| {
        if phase == Phase::Prefill && name == experts {
            v.iter_mut().for_each(|x| *x *= 3.0);
        }
    };
    // The swap's own error sets the tolerance: the logits agree within it.
    let original = run.output(Phase::Prefill, &gate).unwrap().data().to_vec();
    let mut swapped = original.clone();
    swap(Phase::Prefill, &gate, &mut swapped);
    let d2: f64 = original
        .iter()
        .zip(&swapped)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum();
    let n2: f64 = original.iter().map(|x| (*x as f64).powi(2)).sum();
    let tolerance = format!("{:.6e}", 2.0 * (d2 / n2).sqrt() + 1e-6);
    assert!(
        2.0 * (d2 / n2).sqrt() < 0.5,
        "the closest pair is too far apart to call a tie"
    );
    let bias = model
        .weights
        .get(&format!("{gate}.e_score_correction_bias"))
        .unwrap();
    let flipped = route(
        &Tensor::from_vec(&[swapped.len() / e, e], swapped.clone()),
        bias.data(),
        &moe,
    );
    let kept = route(
        &Tensor::from_vec(&[original.len() / e, e], original),
        bias.data(),
        &moe,
    );
    let sorted = |mut v: Vec<usize>| {
        v.sort_unstable();
        v
    };
    assert_ne!(
        sorted(flipped.experts[row].clone()),
        sorted(kept.experts[row].clone()),
        "the swap flips the choice"
    );
    let _ = Layout::builtin_names();

    // The engine: its logits swapped, and everything after them computed from the experts
    // they choose (mladb forced to that choice), the decode steps after it too.
    let choice = gate.replace("mlp.gate", "mlp.gate.topk_indices");
    let mut forced = ForcedSelections::default();
    forced.force(Phase::Prefill, &choice, row, flipped.experts[row].clone());
    let (engine, engine_tokens, _) = recorded_forced(vec![3, 14, 15, 92, 65], forced);
    let (lines, code) = attach_frames(
        engine_frames(&engine, &engine_tokens, &swap),
        &["--tolerance", &tolerance],
    );
    assert_flip_followed(&lines, code, &choice, &experts);

    // What follows the flip is judged: the experts' output off (threefold) after it is a
    // finding, where it used to be excused as the flip's consequence.
    let (lines, code) = attach_frames(
        engine_frames(&engine, &engine_tokens, &|p, n, v| {
            swap(p, n, v);
            off(p, n, v)
        }),
        &["--tolerance", &tolerance],
    );
    let findings = of_event(&lines, "finding");
    assert_eq!(findings.len(), 1, "{findings:#?}");
    assert_eq!(findings[0]["op"], experts.as_str());
    assert_eq!(code, 1);

    // The same divergence without the flip is a finding.
    let (lines, code) = attach_frames(
        engine_frames(&run, &tokens, &off),
        &["--tolerance", &tolerance],
    );
    let findings = of_event(&lines, "finding");
    assert_eq!(findings.len(), 1, "{findings:#?}");
    assert_eq!(findings[0]["op"], experts.as_str());
    assert_eq!(code, 1);
}

/// One token's router logits far off among many: the whole logits tensor agrees within the
/// tolerance, but that row's experts change by much more than its logits' noise. A finding at
/// the choice, not a flip (every row whose experts differed was a flip while the tensor agreed).
#[test]
fn experts_chosen_otherwise_far_beyond_a_rows_noise_are_a_finding() {
    let (run, tokens, _) = recorded_with((0..24).map(|i| (i * 37 + 5) % 200).collect());
    let model = common::synthetic("glm5-tiny", SEED);
    let moe = model.layout.moe.clone().unwrap();
    let e = moe.n_routed_experts;
    // The prefill row whose largest logit is smallest against the whole tensor's norm (the
    // row a whole-tensor tolerance hides best), its best chosen expert and worst passed-over.
    let mut best: Option<(f32, String, usize, usize, usize)> = None;
    for (gate, logits, chosen) in prefill_routes(&run, &model) {
        let norm = logits.iter().map(|x| x * x).sum::<f32>().sqrt();
        for (r, c) in chosen.iter().enumerate() {
            let row = &logits[r * e..(r + 1) * e];
            let scale = row.iter().fold(0f32, |m, x| m.max(x.abs()));
            let a = *c
                .iter()
                .max_by(|x, y| row[**x].total_cmp(&row[**y]))
                .unwrap();
            let b = (0..e)
                .filter(|j| !c.contains(j))
                .min_by(|x, y| row[*x].total_cmp(&row[*y]))
                .unwrap();
            let ratio = scale / norm;
            if best.as_ref().is_none_or(|b| ratio < b.0) {
                best = Some((ratio, gate.clone(), r, a, b));
            }
        }
    }
    let (_, gate, row, a, b) = best.expect("a prefill MoE row");
    let swap = |phase: Phase, name: &str, v: &mut Vec<f32>| {
        if phase == Phase::Prefill && name == gate {
            v.swap(row * e + a, row * e + b);
        }
    };
    let original = run.output(Phase::Prefill, &gate).unwrap().data().to_vec();
    let mut swapped = original.clone();
    swap(Phase::Prefill, &gate, &mut swapped);
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let delta: Vec<f32> = original.iter().zip(&swapped).map(|(x, y)| x - y).collect();
    // The whole tensor passes at 1.5 × its error; the row's noise at that tolerance (the
    // tolerance × its largest logit, as check weighs a choice) is well under the change that
    // swaps the two experts (half their difference).
    let tolerance = 1.5 * norm(&delta) / norm(&original);
    let row_logits = &original[row * e..(row + 1) * e];
    let scale = row_logits.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
    let half_gap = ((original[row * e + a] - original[row * e + b]) / 2.0) as f64;
    assert!(
        half_gap > 2.0 * tolerance * scale,
        "the row's swap is within its noise: gap {half_gap}, noise {}",
        tolerance * scale
    );
    let (lines, code) = attach_frames(
        engine_frames(&run, &tokens, &swap),
        &["--tolerance", &format!("{tolerance:.6e}")],
    );
    let choice = gate.replace("mlp.gate", "mlp.gate.topk_indices");
    let findings = of_event(&lines, "finding");
    assert_eq!(findings.len(), 1, "{findings:#?}");
    assert_eq!(findings[0]["op"], choice.as_str());
    let detail = findings[0]["detail"].as_str().unwrap();
    assert!(detail.contains("beyond their noise"), "{detail}");
    assert_eq!(code, 1);
}

#[test]
fn keys_the_indexer_keeps_otherwise_within_noise_are_a_flip_and_far_below_a_finding() {
    // A prompt longer than the indexer keeps, so that rows pass keys over.
    let (run, tokens, _) = recorded_with((0..24).map(|i| (i * 37 + 5) % 200).collect());
    // Each row (query) of each DSA layer and phase that had more keys than it kept: its last
    // kept key by score, its best and worst passed-over keys.
    struct Row {
        phase: Phase,
        topk: String,
        row: usize,
        slot: usize,
        top_slot: usize,
        top_gap: f32,
        best: usize,
        worst: usize,
        gap: f32,
        worst_gap: f32,
        rms: f32,
    }
    let mut rows = Vec::new();
    for (i, ev) in run.events.iter().enumerate() {
        if !ev.name.ends_with("indexer.topk") {
            continue;
        }
        let kept = run.outputs[i].data();
        let scores = run
            .output(ev.phase, &ev.name.replace(".topk", ".scores"))
            .unwrap()
            .data();
        let n = ev.shape[0];
        let (k, ctx) = (kept.len() / n, scores.len() / n);
        for r in 0..n {
            let row = &scores[r * ctx..(r + 1) * ctx];
            let ks = &kept[r * k..(r + 1) * k];
            let (slot, last) = ks
                .iter()
                .enumerate()
                .filter(|(_, &j)| j >= 0.0)
                .min_by(|a, b| row[*a.1 as usize].total_cmp(&row[*b.1 as usize]))
                .map(|(s, &j)| (s, j as usize))
                .unwrap();
            let (top_slot, top) = ks
                .iter()
                .enumerate()
                .filter(|(_, &j)| j >= 0.0)
                .max_by(|a, b| row[*a.1 as usize].total_cmp(&row[*b.1 as usize]))
                .map(|(s, &j)| (s, j as usize))
                .unwrap();
            let passed: Vec<usize> = (0..ctx)
                .filter(|j| row[*j].is_finite() && !ks.contains(&(*j as f32)))
                .collect();
            if passed.len() < 2 {
                continue;
            }
            let best = *passed
                .iter()
                .max_by(|a, b| row[**a].total_cmp(&row[**b]))
                .unwrap();
            let worst = *passed
                .iter()
                .min_by(|a, b| row[**a].total_cmp(&row[**b]))
                .unwrap();
            let finite: Vec<f32> = row.iter().copied().filter(|x| x.is_finite()).collect();
            let rms = (finite.iter().map(|x| x * x).sum::<f32>() / finite.len() as f32).sqrt();
            rows.push(Row {
                phase: ev.phase,
                topk: ev.name.clone(),
                row: r,
                slot,
                top_slot,
                top_gap: row[top] - row[best],
                best,
                worst,
                gap: row[last] - row[best],
                worst_gap: row[last] - row[worst],
                rms,
            });
        }
    }
    let near = rows
        .iter()
        .min_by(|a, b| (a.gap / a.rms).total_cmp(&(b.gap / b.rms)))
        .expect("a row with keys passed over");
    // A uniform tolerance that puts the closest passed-over key within noise (3 × tolerance ×
    // the row's scale), and the worst one far outside it.
    let tolerance = (near.gap / near.rms / 3.0 * 1.5).max(1e-6);
    assert!(
        near.worst_gap / near.rms / 3.0 > 2.0 * tolerance,
        "the row has no key far below"
    );
    assert!(
        tolerance < 0.5,
        "the closest key is too far apart to call a tie"
    );
    let k = run.output(near.phase, &near.topk).unwrap().data().len()
        / run.output(near.phase, &near.topk).unwrap().shape()[0];
    let layer = near
        .topk
        .trim_end_matches(".self_attn.indexer.topk")
        .to_string();
    let attn_output = format!("{layer}.self_attn.attn_output");
    // The engine's listing with `key` in the row's `slot` (mladb's last kept key by default).
    let plant = |slot: usize, key: usize| {
        let (phase, topk, slot) = (near.phase, near.topk.clone(), near.row * k + slot);
        move |p: Phase, n: &str, v: &mut Vec<f32>| {
            if p == phase && n == topk {
                v[slot] = key as f32;
            }
        }
    };
    let keep = |key: usize| plant(near.slot, key);
    let tol = format!("{tolerance:.6e}");

    // The engine keeps the best passed-over key in place of mladb's last kept one, and
    // attends (and decodes on) over the keys it kept: mladb forced to that choice.
    let listing = run.output(near.phase, &near.topk).unwrap().data();
    let mut chosen: Vec<usize> = listing[near.row * k..(near.row + 1) * k]
        .iter()
        .filter(|&&j| j >= 0.0)
        .map(|&j| j as usize)
        .collect();
    chosen[near.slot] = near.best;
    let mut forced = ForcedSelections::default();
    forced.force(near.phase, &near.topk, near.row, chosen);
    let prompt = (0..24).map(|i| (i * 37 + 5) % 200).collect();
    let (engine, engine_tokens, _) = recorded_forced(prompt, forced);
    let (lines, code) = attach_frames(
        engine_frames(&engine, &engine_tokens, &|_, _, _| {}),
        &["--tolerance", &tol],
    );
    assert_flip_followed(&lines, code, &near.topk, &attn_output);
    // Its attention output off after the flip is a finding, no longer excused.
    let (phase, out) = (near.phase, attn_output.clone());
    let (lines, code) = attach_frames(
        engine_frames(&engine, &engine_tokens, &|p, n, v| {
            if p == phase && n == out {
                v.iter_mut().for_each(|x| *x *= 3.0);
            }
        }),
        &["--tolerance", &tol],
    );
    let findings = of_event(&lines, "finding");
    assert_eq!(findings.len(), 1, "{findings:#?}");
    assert_eq!(findings[0]["op"], attn_output.as_str());
    assert_eq!(code, 1);

    // One finding, at the top-k, saying `says`, for the engine's listing `planted`.
    let one_finding = |planted: &dyn Fn(Phase, &str, &mut Vec<f32>), says: &str| {
        let (lines, code) = attach_frames(
            engine_frames(&run, &tokens, planted),
            &["--tolerance", &tol],
        );
        let findings = of_event(&lines, "finding");
        assert_eq!(findings.len(), 1, "{findings:#?}");
        assert_eq!(findings[0]["op"], near.topk.as_str());
        let detail = findings[0]["detail"].as_str().unwrap();
        assert!(detail.contains(says), "{detail}");
        assert_eq!(code, 1);
    };
    one_finding(&keep(near.worst), "below mladb's last kept key");

    // The engine drops mladb's best kept key for the best passed-over one: the key it kept is
    // near mladb's last, the key it dropped far above its own last. A finding (it was a flip
    // when only the kept keys were scored).
    assert_ne!(near.top_slot, near.slot, "the row keeps more than one key");
    assert!(
        near.top_gap / near.rms / 3.0 > 2.0 * tolerance,
        "the best kept key is near a tie with the passed-over ones"
    );
    one_finding(
        &plant(near.top_slot, near.best),
        "dropped keys scored above its own last kept key",
    );

    // The engine drops mladb's last kept key and keeps nothing in its place (its slot repeats
    // the best key): fewer keys, no tie at all (a flip of gap 0 before).
    let top = run.output(near.phase, &near.topk).unwrap().data()[near.row * k + near.top_slot];
    one_finding(
        &plant(near.slot, top as usize),
        "kept another number of keys than mladb",
    );
}

/// No finding, exit 0, a selection flip noted at `choice`, and `follows` noted as following it.
#[track_caller]
/// The flip at `choice` is noted and followed: mladb re-ran with the engine's choice, and
/// `follows`, an op after it, was compared and agrees; nothing is a finding or excused.
fn assert_flip_followed(lines: &[Value], code: i32, choice: &str, follows: &str) {
    let findings = of_event(lines, "finding");
    assert!(findings.is_empty(), "{findings:#?}");
    let notes: Vec<&str> = of_event(lines, "note")
        .iter()
        .map(|n| n["text"].as_str().unwrap())
        .collect();
    let flip = format!("selection-flip at {choice}");
    assert!(
        notes
            .iter()
            .any(|n| n.starts_with(&flip) && n.contains("re-ran its reference")),
        "{flip}: {notes:#?}"
    );
    let after: Vec<_> = of_event(lines, "compared")
        .into_iter()
        .filter(|c| c["op"] == follows)
        .collect();
    assert!(!after.is_empty(), "{follows} compared");
    assert!(after.iter().all(|c| c["diverges"] == false), "{after:#?}");
    let totals = &of_event(lines, "summary")[0]["totals"];
    assert_eq!(totals["after_selection_flip"], 0, "{totals}");
    assert_eq!(totals["divergent"], 0, "{totals}");
    assert_eq!(code, 0);
}

/// The findings' kind, op, phase and rank, in order.
fn finding_keys(lines: &[Value]) -> Vec<String> {
    of_event(lines, "finding")
        .iter()
        .map(|f| format!("{} {} {} {}", f["kind"], f["op"], f["phase"], f["rank"]))
        .collect()
}

#[test]
fn what_attach_saved_replays_to_the_same_findings() {
    let saved = tempfile::tempdir().unwrap();
    let dir = saved.path().join("run");
    let dir_arg = dir.to_str().unwrap().to_string();
    let (live, code) = attach_saving(
        &[Plant::Divergence, Plant::Disconnect],
        &["--save", &dir_arg],
    );
    assert_eq!(code, 1);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["rank0.frames", "rank1.frames"],
        "whole files, no partial ones left"
    );
    let map = saved.path().join("tp-test.ron");
    std::fs::write(&map, MAP).unwrap();
    let replay = std::process::Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args([
            "attach",
            "--json",
            "--layout",
            "glm5-tiny",
            "--seed",
            &SEED.to_string(),
        ])
        .args(["--name-map", map.to_str().unwrap(), "--replay", &dir_arg])
        .output()
        .unwrap();
    let lines: Vec<Value> = String::from_utf8(replay.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(finding_keys(&lines), finding_keys(&live));
    assert_eq!(finding_keys(&lines).len(), 2);
    assert_eq!(replay.status.code(), Some(1));

    // Saving again into the same directory keeps what is there.
    let (_, code) = attach_saving(&[Plant::None], &["--save", &dir_arg]);
    assert_eq!(code, 0);
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        4,
        "rank0-conn*.frames beside the first"
    );

    // A file that breaks off inside a frame is one clear error.
    let cut = saved.path().join("cut.frames");
    let whole = std::fs::read(dir.join("rank0.frames")).unwrap();
    std::fs::write(&cut, &whole[..whole.len() - 3]).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(["attach", "--replay", cut.to_str().unwrap()])
        .output()
        .unwrap();
    common::assert_clean_error(&out, "cut.frames");
}

#[test]
fn ctrl_c_saves_what_was_received() {
    let saved = tempfile::tempdir().unwrap();
    let dir = saved.path().join("run");
    let (mut child, address) = common::spawn_attach(&["--json", "--save", dir.to_str().unwrap()]);
    let (run, tokens, _) = recorded();
    let frames = engine_frames(&run, &tokens, &|_, _, _| {});
    // Everything but the bye, and the connection left open: the engine is still running.
    let mut stream = TcpStream::connect(&address).unwrap();
    for f in &frames[..frames.len() - 1] {
        stream.write_all(f).unwrap();
    }
    stream.flush().unwrap();
    // Once attach has printed every tensor sent, Ctrl-C.
    let tensors = run.events.len(); // one frame per op of each step
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let (mut seen, mut line) = (0, String::new());
    while seen < tensors {
        line.clear();
        assert!(
            std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0,
            "attach ended early"
        );
        seen += line.contains("\"event\":\"tensor\"") as usize;
    }
    let status = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    std::io::copy(&mut out, &mut std::io::sink()).unwrap();
    assert_eq!(child.wait().unwrap().code(), Some(0), "a clean stop");
    let file = dir.join("rank0.frames");
    let kept = std::fs::read(&file).unwrap();
    let sent: usize = frames[..frames.len() - 1].iter().map(Vec::len).sum();
    assert_eq!(kept.len(), sent, "every frame received was saved, whole");
    drop(stream);
}

/// `mladb import` of the two ranks' frame files (what the hook writes to `file:` addresses),
/// then `mladb check --reference` of the dump it made: (import's stdout and exit code, check's
/// stdout and exit code).
fn import_and_check(plants: &[Plant]) -> ((String, i32), (String, i32)) {
    let dir = tempfile::tempdir().unwrap();
    let map = dir.path().join("tp-test.ron");
    std::fs::write(&map, MAP).unwrap();
    let frames = dir.path().join("frames");
    std::fs::create_dir(&frames).unwrap();
    let (run, tokens, q_lora) = recorded();
    for rank in 0..2 {
        let bytes: Vec<u8> = rank_frames(&run, &tokens, q_lora, rank, plants).concat();
        std::fs::write(frames.join(format!("rank{rank}.frames")), bytes).unwrap();
    }
    let dump = dir.path().join("engine.safetensors");
    let seed = SEED.to_string();
    let mladb = |args: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_mladb"))
            .args(args)
            .output()
            .unwrap();
        (
            common::stdout(&o) + &common::stderr(&o),
            o.status.code().unwrap_or(-1),
        )
    };
    let import = mladb(&[
        "import",
        frames.to_str().unwrap(),
        "--layout",
        "glm5-tiny",
        "--seed",
        &seed,
        "--name-map",
        map.to_str().unwrap(),
        "--out",
        dump.to_str().unwrap(),
    ]);
    let check = mladb(&[
        "check",
        "--layout",
        "glm5-tiny",
        "--seed",
        &seed,
        "--reference",
        dump.to_str().unwrap(),
    ]);
    (import, check)
}

#[test]
fn an_imported_two_rank_recording_checks_clean() {
    let ((import, code), (check, check_code)) = import_and_check(&[Plant::None]);
    assert_eq!(code, 0, "{import}");
    assert!(
        import.contains("2 ranks; a prefill of 5 tokens and 2 decode steps"),
        "{import}"
    );
    assert_eq!(check_code, 0, "{check}");
    assert!(check.contains("no findings"), "{check}");
    // Every sharded and fused op made it into the dump and was compared.
    let compared: usize = check
        .split("compared ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{check}"));
    assert!(compared > 150, "{check}");
}

#[test]
fn an_imported_recording_keeps_its_divergence_and_disconnect() {
    let ((import, code), (check, check_code)) =
        import_and_check(&[Plant::Divergence, Plant::Disconnect]);
    assert_eq!(code, 1, "a disconnect makes import exit 1: {import}");
    let disconnect = import
        .lines()
        .find(|l| l.starts_with("finding: buffer-disconnect"))
        .unwrap_or_else(|| panic!("{import}"));
    assert!(
        disconnect.contains("rank 0, model.layers.1.self_attn.mla_attn"),
        "{disconnect}"
    );
    assert_eq!(check_code, 1, "{check}");
    let mismatch = check
        .lines()
        .find(|l| l.starts_with("reference-mismatch"))
        .unwrap_or_else(|| panic!("{check}"));
    assert!(
        mismatch.contains("decode.1") && mismatch.contains("model.layers.2.self_attn.q_b_proj"),
        "{mismatch}"
    );
}

/// An engine's prompt too long for memory (it comes from the socket, any length) is refused
/// before mladb's reference allocates for it: the step is noted with the estimate and the
/// limit, not run, and attach goes on.
#[test]
fn a_prompt_too_long_for_memory_is_noted_not_run() {
    let n = 20_000u32;
    let frames = vec![
        frame(
            Body::Hello {
                engine: "hf".into(),
                model: "glm5-tiny".into(),
                rank: 0,
                world_size: 1,
            },
            &[],
        ),
        frame(
            Body::Step {
                phase: "prefill".into(),
                step: 0,
                tokens: vec![1; n as usize],
                positions: (0..n).collect(),
            },
            &[],
        ),
        frame(Body::Bye { dropped: 0 }, &[]),
    ];
    let started = std::time::Instant::now();
    let (lines, _) = attach_frames(frames, &["--max-memory-gb", "1"]);
    let notes = of_event(&lines, "note");
    assert!(
        notes.iter().any(|n| {
            let text = n["text"].as_str().unwrap_or("");
            text.contains("step 0 is not compared") && text.contains("--max-memory-gb")
        }),
        "{lines:#?}"
    );
    assert!(of_event(&lines, "reference").is_empty(), "{lines:#?}");
    assert!(
        started.elapsed().as_secs() < 60,
        "the prefill was refused, not run"
    );
}
