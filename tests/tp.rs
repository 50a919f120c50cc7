//! Tensor parallelism on the CPU: N simulated ranks against one rank (TP equals no TP).
//! * the logits and tokens of TP=2 and TP=4 runs equal TP=1's within f32 rounding, on every
//!   tiny layout (a quantized kv_b_proj included), on the HF fixtures and random HF checkpoints,
//!   on all four combinations of MLA paths;
//! * `check --tp N` is clean there in f32 and bf16 and compares every rank's ops;
//! * every tensor-parallel fault is caught by `tp-mismatch` at the op and rank where it acts,
//!   and idles, saying why, on one rank;
//! * a rank count the layout does not divide is an `error:` line and exit code 2;
//! * on the GPU (ignored where there is none; `tools/gpu_check.sh` runs it): clean, and the
//!   faults caught, in f32 and bf16, with the ranks sharing device 0 (a backend each), and on a
//!   host with two GPUs with a rank per device joined by NCCL; NCCL itself on one device.

mod common;

use mladb::backend::cpu::CpuBackend;
use mladb::debug::detect::CheckReport;
use mladb::engine::generate::{self, Schedule};
use mladb::engine::{Engine, EngineOptions, MlaPath, MlaPaths};
use mladb::model::{shard, Layout, Model};
use std::path::Path;
use std::process::Command;

/// glm5-tiny (seed 0) with a 6-token prompt, 4 of it prefilled, and 2 decode steps.
fn glm5_tiny_short() -> (Model, Schedule) {
    let model = common::synthetic("glm5-tiny", 0);
    let schedule = Schedule {
        prompt: common::prompt(model.layout.vocab_size, 6),
        prefill_len: 4,
        decode_steps: 2,
    };
    (model, schedule)
}

fn check_tp(model: &Model, schedule: &Schedule, flags: &str) -> CheckReport {
    common::check_on(&CpuBackend, model, schedule, flags, None)
}

/// The binary run with `args`: its exit code, stdout and stderr.
fn mladb(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(args)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).to_string();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// Each tensor-parallel fault, the op it shows at first and the rank it shows on first.
const TP_FAULTS: &[(&str, &str, usize)] = &[
    ("tp-head-offset", "model.layers.0.self_attn.kv_b_proj", 0),
    (
        "tp-missing-allreduce",
        "model.layers.0.self_attn.o_proj.all_reduce",
        0,
    ),
    (
        "tp-double-reduce",
        "model.layers.0.self_attn.o_proj.all_reduce",
        0,
    ),
    (
        "tp-absorb-unsliced",
        "model.layers.0.self_attn.q_absorbed",
        1,
    ),
];

fn describe(report: &CheckReport) -> String {
    let findings = report
        .findings
        .iter()
        .map(|f| format!("  {} {} {}: {}", f.kind, f.phase, f.op_text(), f.detail));
    let notes = report.notes.iter().map(|n| format!("  note: {n}"));
    findings.chain(notes).collect::<Vec<_>>().join("\n")
}

/// The last logits and the generated tokens of a run on `tp` ranks.
fn logits_of(
    model: &Model,
    schedule: &Schedule,
    paths: MlaPaths,
    tp: usize,
) -> (Vec<f32>, Vec<u32>) {
    let options = EngineOptions {
        tp,
        ..EngineOptions::new(model, paths)
    };
    let mut engine = Engine::new(model, &CpuBackend, options).unwrap();
    let mut last = Vec::new();
    let mut observer = LastLogits(&mut last);
    let outcome = generate::run(&mut engine, schedule, &mut observer).unwrap();
    (last, outcome.generated)
}

/// Keeps the values of the last `logits` op of rank 0 (or of the run without ranks).
struct LastLogits<'a>(&'a mut Vec<f32>);

impl mladb::engine::Observer for LastLogits<'_> {
    fn on_op(
        &mut self,
        e: &mladb::engine::OpEvent,
        t: &mladb::tensor::Tensor,
    ) -> mladb::Result<()> {
        let whole = e.name == "logits" && e.rank.is_none() || e.name == "logits.all_gather";
        if whole && e.rank.unwrap_or(0) == 0 {
            *self.0 = t.data().to_vec();
        }
        Ok(())
    }
    fn wants_stats(&self) -> bool {
        false
    }
}

/// The models of the tests: every tiny layout, a Q4_K kv_b_proj, and the random HF checkpoints.
fn models() -> Vec<(String, Model, Schedule)> {
    let mut out = Vec::new();
    let schedule = |vocab| Schedule {
        prompt: common::prompt(vocab, 10),
        prefill_len: 7,
        decode_steps: 3,
    };
    for layout in ["glm5-tiny", "glm5-tiny-wide", "deepseek-v3-tiny"] {
        let model = common::synthetic(layout, 3);
        let s = schedule(model.layout.vocab_size);
        out.push((layout.to_string(), model, s));
    }
    let q4k = Model::synthetic_quantized(
        Layout::resolve("glm5-tiny-wide").unwrap(),
        0,
        Some(mladb::gguf::GgmlType::from_name("q4_k").unwrap()),
        1 << 30,
    )
    .unwrap();
    let s = schedule(q4k.layout.vocab_size);
    out.push(("glm5-tiny-wide q4_k".into(), q4k, s));
    // The HF fixtures: a sparse DSA context, YaRN, a plain q_proj with attention biases (o_proj's
    // bias added by rank 0 alone), tied embeddings, FP8 block-scaled weights.
    for name in [
        "glm5-sparse",
        "deepseek-v3-yarn",
        "deepseek-v3-plain",
        "deepseek-v3-fp8",
    ] {
        let model =
            Model::hf_checkpoint(&Path::new("tests/fixtures/hf").join(name), 1 << 30).unwrap();
        let s = schedule(model.layout.vocab_size);
        out.push((format!("hf {name}"), model, s));
    }
    let random = Path::new("tests/fixtures/random");
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(random.join("cases.json")).unwrap()).unwrap();
    for c in cases.as_array().unwrap().iter().step_by(4) {
        let name = c["name"].as_str().unwrap();
        let model = Model::hf_checkpoint(&random.join(name), 1 << 30).unwrap();
        let prompt = c["tokens"].as_array().unwrap().iter();
        let s = Schedule {
            prompt: prompt.map(|t| t.as_u64().unwrap() as u32).collect(),
            prefill_len: c["prefill"].as_u64().unwrap() as usize,
            decode_steps: c["decode"].as_u64().unwrap() as usize,
        };
        out.push((format!("random {name}"), model, s));
    }
    out
}

#[test]
fn tensor_parallel_logits_equal_one_ranks_on_every_layout_and_path() {
    let mut compared = 0;
    for (name, model, schedule) in models() {
        let (naive, absorbed) = (MlaPath::Naive, MlaPath::Absorbed);
        for (prefill, decode) in [
            (naive, absorbed),
            (naive, naive),
            (absorbed, absorbed),
            (absorbed, naive),
        ] {
            let paths = MlaPaths { prefill, decode };
            let (one, tokens) = logits_of(&model, &schedule, paths, 1);
            for tp in [2, 4] {
                if shard::check_tp(&model.layout, tp).is_err() {
                    eprintln!("{name}: tp {tp} skipped, the layout does not divide by it");
                    continue;
                }
                let (many, tp_tokens) = logits_of(&model, &schedule, paths, tp);
                assert_eq!(many.len(), one.len(), "{name} tp {tp}");
                let scale = one.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
                let worst = one
                    .iter()
                    .zip(&many)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    worst <= 1e-4 * scale,
                    "{name} tp {tp} {paths:?}: logits differ by {worst}"
                );
                assert_eq!(tokens, tp_tokens, "{name} tp {tp} {paths:?}");
                compared += 1;
            }
        }
    }
    assert!(
        compared >= 16,
        "only {compared} tensor-parallel runs compared"
    );
}

#[test]
fn check_with_tensor_parallelism_is_clean_and_compares_every_rank() {
    let mut checked = 0;
    for (name, model, schedule) in models() {
        for tp in [2, 4] {
            if shard::check_tp(&model.layout, tp).is_err() {
                eprintln!("{name}: tp {tp} skipped, the layout does not divide by it");
                continue;
            }
            for flags in ["dtype=f32", "dtype=bf16", "dtype=f32,decode-path=naive"] {
                let report = check_tp(&model, &schedule, &format!("{flags},tp={tp}"));
                assert!(
                    report.findings.is_empty(),
                    "{name} tp {tp} {flags}:\n{}",
                    describe(&report)
                );
                let note = report
                    .notes
                    .iter()
                    .find(|n| n.starts_with(&format!("tp {tp} vs one rank: ")))
                    .unwrap_or_else(|| panic!("{name} tp {tp}: no tp note\n{}", describe(&report)));
                // Every op but the choices and the partial sums was compared.
                assert!(
                    !note.contains("could not be compared") && !note.contains("have no op"),
                    "{name} tp {tp}: {note}"
                );
                let compared: usize = note["tp 2 vs one rank: ".len()..]
                    .split(' ')
                    .next()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                let ranked = report
                    .run
                    .events
                    .iter()
                    .filter(|e| e.rank.is_some())
                    .count();
                assert!(
                    compared * 10 >= ranked * 7,
                    "{name} tp {tp}: {compared} of {ranked}"
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 24, "only {checked} checks made");
}

#[test]
fn every_tensor_parallel_fault_is_caught_at_its_op_and_rank() {
    for layout in ["glm5-tiny", "deepseek-v3-tiny"] {
        let model = common::synthetic(layout, 0);
        let schedule = Schedule {
            prompt: common::prompt(model.layout.vocab_size, 9),
            prefill_len: 6,
            decode_steps: 3,
        };
        for tp in [2, 4] {
            for dtype in ["f32", "bf16"] {
                for &(fault, op, rank) in TP_FAULTS {
                    let flags = format!("dtype={dtype},tp={tp},inject={fault}");
                    let report = check_tp(&model, &schedule, &flags);
                    let first = report
                        .findings
                        .iter()
                        .find(|f| f.kind.to_string() == "tp-mismatch")
                        .unwrap_or_else(|| {
                            panic!("{layout} {flags}: not caught\n{}", describe(&report))
                        });
                    assert_eq!(
                        (first.op.as_str(), first.rank),
                        (op, Some(rank)),
                        "{layout} {flags}:\n{}",
                        describe(&report)
                    );
                    // Absorption reads rank 0's heads on every rank: rank 0 itself is right.
                    if fault == "tp-absorb-unsliced" {
                        assert!(
                            report.findings.iter().all(|f| f.rank != Some(0)),
                            "{layout} {flags}:\n{}",
                            describe(&report)
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn tensor_parallel_faults_idle_on_one_rank_and_say_why() {
    let (model, schedule) = glm5_tiny_short();
    for fault in [
        "tp-head-offset",
        "tp-missing-allreduce",
        "tp-double-reduce",
        "tp-absorb-unsliced",
    ] {
        let report = check_tp(&model, &schedule, &format!("inject={fault}"));
        assert!(
            report.findings.is_empty(),
            "{fault}:\n{}",
            describe(&report)
        );
        assert!(
            report
                .notes
                .iter()
                .any(|n| n.contains(fault) && n.contains("--tp 2 or more")),
            "{fault}:\n{}",
            describe(&report)
        );
    }
    // Absorption is not used when every path is naive: said so at any rank count (check's
    // absorbed-vs-naive run, which takes the absorbed path, still shows it).
    let report = check_tp(
        &model,
        &schedule,
        "tp=2,inject=tp-absorb-unsliced,decode-path=naive",
    );
    assert!(
        report
            .notes
            .iter()
            .any(|n| n.contains("tp-absorb-unsliced had nothing to act on")),
        "{}",
        describe(&report)
    );
    assert!(
        report
            .findings
            .iter()
            .all(|f| f.kind.to_string() != "tp-mismatch"),
        "{}",
        describe(&report)
    );
}

#[test]
fn a_rank_count_the_layout_does_not_divide_is_an_error_line() {
    for (tp, says) in [
        (
            "3",
            "the 4 attention heads of glm5-tiny do not split into 3 equal parts",
        ),
        ("0", "not a rank count from 1 to 64"),
        ("65", "not a rank count from 1 to 64"),
        ("two", "not a rank count from 1 to 64"),
    ] {
        for command in ["run", "check"] {
            let args = [
                command,
                "--layout",
                "glm5-tiny",
                "--tokens",
                "1,2",
                "--tp",
                tp,
            ];
            let (code, _, stderr) = mladb(&args);
            assert_eq!(code, Some(2), "{command} --tp {tp}: {stderr}");
            assert!(
                stderr.starts_with("error: ")
                    && stderr.contains(says)
                    && stderr.lines().count() == 1,
                "{command} --tp {tp}: {stderr}"
            );
        }
    }
}

#[test]
fn attach_refuses_tensor_parallelism_with_an_error_line() {
    let (code, _, stderr) = mladb(&["attach", "--layout", "glm5-tiny", "--tp", "2"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.starts_with("error: --tp 2: attach compares"),
        "{stderr}"
    );
}

#[test]
fn the_trace_names_each_ranks_ops_and_the_collectives_between_them() {
    let model = common::synthetic("glm5-tiny", 0);
    let schedule = Schedule {
        prompt: vec![1, 2, 3],
        prefill_len: 3,
        decode_steps: 1,
    };
    let report = check_tp(&model, &schedule, "tp=2");
    let events = &report.run.events;
    assert!(events.iter().all(|e| e.rank.is_some()));
    // Both ranks run every op, and each collective once per rank.
    for op in [
        "model.embed_tokens.all_reduce",
        "model.layers.0.self_attn.o_proj.all_reduce",
        "model.layers.3.mlp.all_reduce",
        "logits.all_gather",
    ] {
        let ranks: Vec<_> = events
            .iter()
            .filter(|e| e.name == op && e.phase == mladb::engine::Phase::Prefill)
            .map(|e| e.rank)
            .collect();
        assert_eq!(ranks, [Some(0), Some(1)], "{op}");
    }
    // A rank's attention holds its heads; the latent cache is replicated whole.
    let q = events
        .iter()
        .find(|e| e.name == "model.layers.0.self_attn.q_b_proj")
        .unwrap();
    let heads = model.layout.num_heads / 2;
    assert_eq!(q.shape, [3, heads * model.layout.qk_head_dim()]);
    let latent = events
        .iter()
        .find(|e| e.name == "model.layers.0.self_attn.latent_cache" && e.rank == Some(1))
        .unwrap();
    assert_eq!(latent.shape[1], model.layout.latent_width());
    // The absorbed path is the production default: decode ran it on every rank.
    assert_eq!(MlaPaths::production().decode, MlaPath::Absorbed);
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn on_the_gpu_ranks_are_clean_and_the_faults_caught() {
    // On a host with fewer GPUs than ranks every rank runs on device 0 with a backend of its
    // own; on a host with more, TP=2 runs across two devices (see the two-GPU test).
    gpu_ranks_clean_and_faults_caught(&[2, 4]);
}

/// Every GPU backend at each of `tps`: clean against TP=1 on the tiny layouts and glm5-rank8
/// (whose bf16 attention runs the fast kernels), and every TP fault caught on its rank.
fn gpu_ranks_clean_and_faults_caught(tps: &[usize]) {
    for (name, backend, _) in common::gpu_backends() {
        let dtype = if name.ends_with("bf16") {
            "bf16"
        } else {
            "f32"
        };
        for (layout, tokens, fast) in [
            ("glm5-tiny", 9, false),
            ("deepseek-v3-tiny", 9, false),
            ("glm5-rank8", 100, true),
        ] {
            let model = common::synthetic(layout, 0);
            let schedule = Schedule {
                prompt: common::prompt(model.layout.vocab_size, tokens),
                prefill_len: tokens - 3,
                decode_steps: 3,
            };
            for &tp in tps {
                let flags = format!("dtype={dtype},tp={tp}");
                let report = common::check_on(&*backend, &model, &schedule, &flags, None);
                assert!(
                    report.findings.is_empty(),
                    "{name} {layout} {flags}:\n{}",
                    describe(&report)
                );
                assert_eq!(
                    report.run.events.iter().any(|e| e.ran_fast_kernel()),
                    fast && dtype == "bf16",
                    "{name} {layout} {flags}: fast kernels"
                );
                // Each rank's outputs live on the device it runs on.
                let on = backend.rank_backends(tp).unwrap().expect("CUDA ranks");
                let own_devices = on.all_reduce.is_some();
                for e in report
                    .run
                    .events
                    .iter()
                    .filter(|e| e.output.device_index > 0)
                {
                    assert!(
                        own_devices,
                        "{name} {layout} {flags}: {} on device {}",
                        e.name, e.output.device_index
                    );
                    assert_eq!(
                        Some(e.output.device_index),
                        e.rank,
                        "{name} {layout} {flags}: {}",
                        e.name
                    );
                }
                for &(fault, op, rank) in TP_FAULTS {
                    let flags = format!("{flags},inject={fault}");
                    let report = common::check_on(&*backend, &model, &schedule, &flags, None);
                    let first = report
                        .findings
                        .iter()
                        .find(|f| f.kind.to_string() == "tp-mismatch")
                        .unwrap_or_else(|| panic!("{name} {layout} {flags}: not caught"));
                    assert_eq!(
                        (first.op.as_str(), first.rank),
                        (op, Some(rank)),
                        "{name} {layout} {flags}"
                    );
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn nccl_loads_sums_one_rank_and_refuses_two_ranks_on_one_device() {
    use mladb::backend::cuda::device::nccl::{nccl_version, NcclRanks};
    use mladb::backend::cuda::device::{Elem, Gpu};
    let version = nccl_version().expect("NCCL loads");
    assert!(version.starts_with("2."), "{version}");
    let gpu = std::sync::Arc::new(Gpu::open(0).unwrap());
    let values: Vec<f32> = (0..6144).map(|i| (i as f32 * 0.37).sin()).collect();
    for elem in [Elem::F32, Elem::Bf16] {
        let send = gpu.upload(&values, elem).unwrap();
        let ranks = NcclRanks::new(vec![gpu.clone()]).unwrap();
        let sums = ranks.all_reduce_sum(&[&send]).unwrap();
        // One rank: the sum is its own part, bit for bit.
        assert_eq!(
            gpu.download(&sums[0]).unwrap(),
            gpu.download(&send).unwrap()
        );
    }
    let refused = NcclRanks::new(vec![gpu.clone(), gpu])
        .err()
        .expect("refused");
    assert!(
        refused.to_string().contains("device 0 holds two ranks"),
        "{refused}"
    );
}

#[test]
#[ignore = "needs two GPUs: tools/gpu_check.sh runs it where the host has them"]
fn on_two_gpus_tp2_runs_a_rank_per_device_through_nccl() {
    let count = cudarc::driver::CudaContext::device_count().unwrap_or(0);
    assert!(
        count >= 2,
        "this test needs two CUDA devices; this host has {count}"
    );
    for (name, backend, _) in common::gpu_backends() {
        let on = backend.rank_backends(2).unwrap().expect("CUDA ranks");
        assert!(
            on.all_reduce.is_some() && on.note.contains("NCCL"),
            "{name}: {}",
            on.note
        );
    }
    gpu_ranks_clean_and_faults_caught(&[2]);
}

#[test]
fn a_session_records_the_ranks_and_replays_them_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tp.ron");
    let path_text = path.to_str().unwrap();
    let (code, stdout, _) = mladb(&[
        "check",
        "--layout",
        "glm5-tiny",
        "--prefill",
        "5",
        "--decode",
        "2",
        "--tp",
        "2",
        "--inject",
        "tp-absorb-unsliced",
        "--record",
        path_text,
    ]);
    assert_eq!(code, Some(1), "check has findings: {stdout}");
    assert!(
        stdout.contains("model.layers.0.self_attn.q_absorbed (rank 1)"),
        "{stdout}"
    );
    let session = mladb::session::Session::load(&path).unwrap();
    assert_eq!(session.runs[0].flags.tp, 2);
    let ranks: std::collections::BTreeSet<_> =
        session.runs[0].ops.iter().map(|o| o.event.rank).collect();
    assert_eq!(ranks.into_iter().collect::<Vec<_>>(), [Some(0), Some(1)]);
    let finding = session
        .check
        .as_ref()
        .unwrap()
        .findings
        .iter()
        .find(|f| f.kind.to_string() == "tp-mismatch")
        .cloned()
        .unwrap();
    assert_eq!(finding.rank, Some(1));
    let (code, stdout, stderr) = mladb(&["replay", path_text, "--verify"]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("bit for bit"), "{stdout}");
}

#[test]
fn the_tui_shows_one_rank_at_a_time_and_every_rank_of_the_selected_op() {
    use mladb::tui::app::Node;
    use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
    let mut app = common::tiny_app("tp=2");
    let press = |app: &mut mladb::tui::app::App, c: char| {
        app.on_key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE))
    };
    press(&mut app, 'c');
    let ranks_shown = |app: &mladb::tui::app::App| {
        let run = app.mirror.current().unwrap();
        let mut shown: Vec<Option<usize>> = app
            .rows()
            .iter()
            .filter_map(|r| match r.node {
                Node::Op(i) => Some(run.events[i].rank),
                _ => None,
            })
            .collect();
        shown.sort();
        shown.dedup();
        shown
    };
    assert_eq!(ranks_shown(&app), [Some(0), Some(1)]);
    press(&mut app, 'r');
    assert_eq!(app.rank_view, Some(0));
    assert_eq!(ranks_shown(&app), [Some(0)]);
    press(&mut app, 'r');
    assert_eq!(ranks_shown(&app), [Some(1)]);
    press(&mut app, 'r');
    assert_eq!(app.rank_view, None);
    assert!(
        app.log.iter().any(|l| l == "tree: rank 1 of 2"),
        "{:?}",
        app.log
    );
    // The Tensor pane of a rank's op lists the op on both ranks.
    let run = app.mirror.current().unwrap();
    let q = run.find_at(
        mladb::engine::Phase::Prefill,
        Some(1),
        "model.layers.0.self_attn.q_b_proj",
    );
    app.selected = Some(Node::Op(q.unwrap()));
    let mut terminal = ratatui::Terminal::new(ratatui::backend::TestBackend::new(160, 48)).unwrap();
    terminal
        .draw(|f| mladb::tui::ui::draw(f, &mut app))
        .unwrap();
    let text = terminal.backend().to_string();
    assert!(
        text.contains("rank 0 min") && text.contains("rank 1 min"),
        "{text}"
    );
    assert!(text.contains("r1 "), "{text}");
    // The Buffers pane follows the chain of the selected op's rank.
    let attn = app.mirror.current().unwrap().find_at(
        mladb::engine::Phase::Prefill,
        Some(1),
        "model.layers.0.self_attn.attn_output",
    );
    app.selected = Some(Node::Op(attn.unwrap()));
    app.tab = mladb::tui::app::Tab::Buffers;
    terminal
        .draw(|f| mladb::tui::ui::draw(f, &mut app))
        .unwrap();
    let text = terminal.backend().to_string();
    assert!(
        text.contains("attention chain, layer 0, prefill, rank 1"),
        "{text}"
    );
    // Without ranks the key says there are none.
    let mut plain = common::tiny_app("");
    press(&mut plain, 'r');
    assert_eq!(plain.rank_view, None);
    assert!(plain
        .log
        .last()
        .unwrap()
        .contains("no tensor-parallel ranks"));
    // `:set tp 2` re-runs on two ranks; a count the layout does not divide is refused.
    let command = |app: &mut mladb::tui::app::App, line: &str| {
        press(app, ':');
        line.chars().for_each(|c| press(app, c));
        app.on_key(KeyEvent::new(KeyCode::Enter, KeyModifiers::NONE));
    };
    command(&mut plain, "set tp 3");
    assert!(
        plain
            .log
            .iter()
            .any(|l| l.contains("do not split into 3 equal parts")),
        "{:?}",
        plain.log
    );
    command(&mut plain, "set tp 2");
    press(&mut plain, 'c');
    let run = plain.mirror.current().unwrap();
    assert_eq!(run.flags.tp, 2);
    assert!(run.events.iter().any(|e| e.rank == Some(1)));
}

#[test]
fn bisect_of_a_tensor_parallel_run_against_one_rank_names_the_rank() {
    // (exit code, stdout, stderr) of bisect --a A --b B, as JSON or as text.
    let bisect = |a: &str, b: &str, json: bool| {
        let schedule = ["--layout", "glm5-tiny", "--prefill", "5", "--decode", "2"];
        let mut args = vec!["bisect"];
        args.extend(schedule);
        args.extend(["--a", a, "--b", b]);
        args.extend(json.then_some("--json"));
        mladb(&args)
    };
    let (code, out, err) = bisect("tp=2", "tp=1", true);
    assert_eq!(code, Some(0), "{out}{err}");
    let clean: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(clean["first"].is_null(), "{out}");
    assert_eq!(clean["not_compared"].as_array().unwrap().len(), 0, "{out}");
    assert!(clean["compared"].as_u64().unwrap() > 100, "{out}");
    let fault = "tp=2,inject=tp-missing-allreduce";
    let (code, out, err) = bisect(fault, "tp=1", true);
    assert_eq!(code, Some(1), "{out}{err}");
    let found: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        found["first"]["name"].as_str(),
        Some("model.layers.0.self_attn.o_proj.all_reduce"),
        "{out}"
    );
    let (_, text, _) = bisect(fault, "tp=1", false);
    assert!(
        text.contains("first divergent:") && text.contains("o_proj.all_reduce (rank 0)"),
        "{text}"
    );
    let (code, _, err) = bisect("tp=1", "tp=2", false);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.starts_with("error: bisect compares a run of tp 1 with one of tp 2"),
        "{err}"
    );
}

#[test]
fn dumps_and_recorded_tensors_name_each_ranks_output_apart() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("tp.safetensors");
    let session = dir.path().join("tp.ron");
    let (code, _, err) = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--tokens",
        "1,2,3",
        "--tp",
        "2",
        "--dump",
        dump.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(0), "{err}");
    let bytes = std::fs::read(&dump).unwrap();
    let names: Vec<String> = safetensors::SafeTensors::deserialize(&bytes)
        .unwrap()
        .names()
        .into_iter()
        .map(str::to_string)
        .collect();
    for rank in ["@rank0", "@rank1"] {
        let name = format!("prefill/model.layers.0.self_attn.q_b_proj{rank}");
        assert!(names.contains(&name), "{name} not in {names:?}");
    }
    let (code, _, err) = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--tokens",
        "1,2,3",
        "--tp",
        "2",
        "--record",
        session.to_str().unwrap(),
        "--record-tensors",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let (code, _, err) = mladb(&["replay", session.to_str().unwrap(), "--verify"]);
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn a_reference_dump_is_refused_for_a_tensor_parallel_run_with_an_error_line() {
    let fixture = Path::new("tests/fixtures/hf/glm5-sparse");
    let dump = fixture.join("hf-dump.safetensors");
    let (model, dump) = (fixture.to_str().unwrap(), dump.to_str().unwrap());
    let (code, _, stderr) = mladb(&["check", "--model", model, "--reference", dump, "--tp", "2"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.starts_with("error: a reference dump holds the whole model's tensors"),
        "{stderr}"
    );
}

#[test]
fn run_says_where_the_ranks_run_and_what_joins_them() {
    let (code, stdout, stderr) = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--tokens",
        "1,2",
        "--decode",
        "1",
        "--tp",
        "2",
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.contains("tensor parallel: 2 ranks simulated one after another on the cpu backend, joined by exact sums in rank order"),
        "{stdout}"
    );
    let (code, stdout, _) = mladb(&["run", "--layout", "glm5-tiny", "--tokens", "1,2"]);
    assert_eq!(code, Some(0));
    assert!(!stdout.contains("tensor parallel"), "{stdout}");
    // A rank count past the limit is an error line, before any rank is made.
    let (code, _, stderr) = mladb(&["bench", "--layout", "glm5-tiny", "--tp", "65"]);
    assert_eq!(code, Some(2));
    assert!(stderr.starts_with("error: --tp 65"), "{stderr}");
}

/// A fault every rank count shares (the decode's slot mapping sends the latent row one slot
/// early, so attention reads an unwritten slot) makes the same NaN on the ranks and on one rank:
/// the NaN/Inf finding reports it, and tp-mismatch, which used to report every such op as a
/// difference between the two, says in a note that they agree.
#[test]
fn nan_alike_on_the_ranks_and_on_one_rank_is_not_a_tp_mismatch() {
    let (model, schedule) = glm5_tiny_short();
    let report = check_tp(&model, &schedule, "tp=2,inject=kv-cache-off-by-one");
    let kinds: Vec<String> = report.findings.iter().map(|f| f.kind.to_string()).collect();
    assert!(
        kinds.iter().any(|k| k == "nan-inf"),
        "{}",
        describe(&report)
    );
    assert!(
        kinds.iter().all(|k| k != "tp-mismatch"),
        "{}",
        describe(&report)
    );
    assert!(
        report
            .notes
            .iter()
            .any(|n| n.starts_with("tensor parallel vs one rank: ")
                && n.contains("hold the same NaN/Inf")),
        "{}",
        describe(&report)
    );
}
