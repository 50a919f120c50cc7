//! The verdicts of `check` in both directions: clean runs of every tiny layout and of 20 random
//! HF checkpoints (ties included) report no findings in f32 and in bf16; every fault of the
//! catalogue is still caught in bf16; a tie built on purpose is noted; a choice that differs
//! within noise is noted and forced, one that differs beyond it is a finding; notes leave the
//! exit code alone. The clean runs on the CPU in f32 and bf16 (`NAME::cpu`) and on the GPU's f32
//! and bf16 backends (`NAME::gpu`, ignored where there is no GPU; `--include-ignored` runs them).

mod common;

use mladb::backend::cpu::CpuBackend;
use mladb::backend::Backend;
use mladb::debug::detect::CheckReport;
use mladb::debug::external::ExternalDump;
use mladb::debug::runner::Job;
use mladb::debug::Flags;
use mladb::engine::generate::Schedule;
use mladb::engine::trace::{OpKind, Phase};
use mladb::engine::ForcedSelections;
use mladb::gguf::GgmlType;
use mladb::model::{Layout, Model};
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

const RANDOM: &str = "tests/fixtures/random";

fn run_check(
    model: &Model,
    schedule: &Schedule,
    flags: &str,
    reference: Option<ExternalDump>,
) -> CheckReport {
    common::check_on(&CpuBackend, model, schedule, flags, reference)
}

/// The CPU in f32 and bf16, or the GPU's f32 and bf16 backends (a GPU required): (name,
/// backend, the dtype flag that goes with it). Made once per process (a GPU backend compiles
/// its kernels).
type Backends = Vec<(String, Arc<dyn Backend>, &'static str)>;

fn backends(gpu: bool) -> Backends {
    if !gpu {
        return vec![
            ("cpu f32".into(), Arc::new(CpuBackend), "dtype=f32"),
            ("cpu bf16".into(), Arc::new(CpuBackend), "dtype=bf16"),
        ];
    }
    static GPU: std::sync::OnceLock<Backends> = std::sync::OnceLock::new();
    GPU.get_or_init(|| {
        common::gpu_backends()
            .into_iter()
            .map(|(name, b, _)| {
                let dtype = if name.ends_with("bf16") {
                    "dtype=bf16"
                } else {
                    "dtype=f32"
                };
                (name.to_string(), b, dtype)
            })
            .collect()
    })
    .clone()
}

/// The findings other than the all-zero head weights a tied checkpoint has by construction.
fn besides_zero_head_weights(report: &CheckReport) -> Vec<String> {
    report
        .findings
        .iter()
        .filter(|f| !(f.kind.to_string() == "all-zero" && f.op.ends_with("indexer.weights_proj")))
        .map(|f| format!("  {} {} {}: {}", f.kind, f.phase, f.op, f.detail))
        .collect()
}

fn describe(report: &CheckReport) -> String {
    report
        .findings
        .iter()
        .map(|f| format!("  {} {} {}: {}", f.kind, f.phase, f.op, f.detail))
        .collect::<Vec<_>>()
        .join("\n")
}

/// One case of tools/make_random_checkpoints.py.
struct Case {
    name: String,
    dir: PathBuf,
    schedule: Schedule,
    dump: Option<PathBuf>,
}

fn random_cases() -> Vec<Case> {
    let text = std::fs::read_to_string(Path::new(RANDOM).join("cases.json")).unwrap();
    let cases: serde_json::Value = serde_json::from_str(&text).unwrap();
    cases
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let name = c["name"].as_str().unwrap().to_string();
            let dir = Path::new(RANDOM).join(&name);
            let tokens = c["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            Case {
                dump: c["dump"].as_str().map(|d| dir.join(d)),
                schedule: Schedule {
                    prompt: tokens,
                    prefill_len: c["prefill"].as_u64().unwrap() as usize,
                    decode_steps: c["decode"].as_u64().unwrap() as usize,
                },
                dir,
                name,
            }
        })
        .collect()
}

/// The first GLM-5 case of the random checkpoints (it has a DSA indexer).
fn glm5_case() -> Case {
    random_cases()
        .into_iter()
        .find(|c| c.name.starts_with("glm5"))
        .unwrap()
}

/// A plain CPU run of the whole model, outputs poisoned first.
fn plain_run(model: &Model, schedule: &Schedule) -> mladb::debug::RunRecord {
    let layers = 0..model.layout.num_layers;
    let job = Job {
        model,
        backend: &CpuBackend,
        schedule,
        layers: &layers,
        poison: true,
    };
    job.run(Flags::default(), None).unwrap()
}

/// The run's first prefill DSA top-k: (op index, event).
fn first_prefill_topk(run: &mladb::debug::RunRecord) -> (usize, &mladb::engine::trace::OpEvent) {
    run.events
        .iter()
        .enumerate()
        .find(|(_, e)| e.kind == OpKind::IndexTopK && e.phase == Phase::Prefill)
        .unwrap()
}

fn clean_tiny_layouts_report_nothing_in_f32_and_bf16(gpu: bool) {
    for layout in ["glm5-tiny", "glm5-tiny-wide", "deepseek-v3-tiny"] {
        for seed in [0, 1, 5] {
            let model = common::synthetic(layout, seed);
            for prefill in [6, 12] {
                let schedule = Schedule {
                    prompt: common::prompt(model.layout.vocab_size, 12),
                    prefill_len: prefill,
                    decode_steps: 4,
                };
                for (name, backend, dtype) in backends(gpu) {
                    let report = common::check_on(&*backend, &model, &schedule, dtype, None);
                    assert!(
                        report.findings.is_empty(),
                        "{layout} seed {seed} prefill {prefill} {name}:\n{}",
                        describe(&report)
                    );
                }
            }
        }
    }
}

/// Short contexts, where the DSA indexer scores one to a dozen keys with its 4 heads: each of
/// these clean runs had a finding (found by a sweep of random clean runs, 2026-12-08). At
/// `indexer.scores`: a single key scored 0 (every head's dot negative: the ReLU's zero,
/// reported as all-zero); scores made of terms that cancel, or of a dot small beside its
/// vectors, moved 20 to 40 times their inputs' relative error, past a gain fitted on longer
/// contexts; scores the other run's ReLU zeroed were +∞ apart, relative (the two before the
/// last case). At `indexer.weights_proj` (the last case, projections quantized): a projection to
/// 4 values that were all near 0.05 at one token, where they are near 0.7 at the others.
fn short_contexts_report_nothing(gpu: bool) {
    struct Short {
        layout: &'static str,
        seed: u64,
        prompt: &'static [u32],
        prefill: usize,
        decode: usize,
        flags: &'static str,
        quant: Option<GgmlType>,
    }
    let short = |layout, seed, prompt, prefill, decode, flags| Short {
        layout,
        seed,
        prompt,
        prefill,
        decode,
        flags,
        quant: None,
    };
    let cases = [
        short("glm5-tiny", 557, &[74], 1, 7, "dtype=f32"),
        short("glm5-tiny", 376, &[7], 1, 11, "dtype=bf16"),
        short("glm5-tiny-wide", 0, &[9, 145, 190], 1, 4, "dtype=bf16"),
        short("glm5-tiny-wide", 235, &[152], 1, 4, "dtype=bf16"),
        short(
            "glm5-tiny-wide",
            493,
            &[166],
            1,
            7,
            "dtype=bf16,prefill-path=absorbed",
        ),
        short("glm5-tiny", 783, &[34], 1, 5, "dtype=bf16,tp=2"),
        short(
            "glm5-tiny",
            359,
            &[169],
            1,
            4,
            "dtype=bf16,tp=2,mla-disable",
        ),
        short(
            "glm5-tiny-wide",
            728,
            &[138, 5, 190],
            1,
            10,
            "dtype=bf16,decode-path=naive",
        ),
        Short {
            quant: Some(GgmlType::Q4_K),
            ..short("glm5-tiny", 422, &[27], 1, 11, "dtype=bf16,mla-disable")
        },
        Short {
            quant: Some(GgmlType::Q8_0),
            ..short("glm5-tiny", 59, &[51, 132, 155], 3, 8, "dtype=bf16")
        },
    ];
    for c in &cases {
        let layout = Layout::resolve(c.layout).unwrap();
        let model = Model::synthetic_quantized(layout, c.seed, c.quant, common::BUDGET).unwrap();
        let schedule = Schedule {
            prompt: c.prompt.to_vec(),
            prefill_len: c.prefill,
            decode_steps: c.decode,
        };
        for (name, backend, dtype) in backends(gpu) {
            // Each case in its own dtype: the CPU's side of it, or the GPU backend of that dtype.
            if !c.flags.starts_with(dtype) {
                continue;
            }
            let report = common::check_on(&*backend, &model, &schedule, c.flags, None);
            assert!(
                report.findings.is_empty(),
                "{} seed {} prompt {:?} {} {name}:\n{}",
                c.layout,
                c.seed,
                c.prompt,
                c.flags,
                describe(&report)
            );
        }
    }
}

fn random_hf_checkpoints_are_clean_in_f32_and_bf16(gpu: bool) {
    let cases = random_cases();
    assert!(cases.len() >= 20, "the fixture holds {} cases", cases.len());
    let mut ties = 0;
    for case in &cases {
        let model = Model::hf_checkpoint(&case.dir, 1 << 30).unwrap();
        for (name, backend, dtype) in backends(gpu) {
            let report = common::check_on(&*backend, &model, &case.schedule, dtype, None);
            assert!(
                report.findings.is_empty(),
                "{} {name}:\n{}",
                case.name,
                describe(&report)
            );
            ties += report
                .selection_notes
                .iter()
                .filter(|n| {
                    n.kind == "ambiguous-selection"
                        && n.detail.contains("exact ties")
                        && !n.detail.contains("(0 exact ties)")
                })
                .count();
        }
    }
    assert!(ties > 0, "some random case must break an exact tie");
}

/// Against transformers' own dump, a torch top-k that breaks an exact DSA tie another way than
/// mladb is noted and followed, not reported as a mismatch.
#[test]
fn a_reference_that_breaks_ties_another_way_is_followed_not_reported() {
    let mut followed = 0;
    for case in random_cases() {
        let Some(dump) = &case.dump else { continue };
        let model = Model::hf_checkpoint(&case.dir, 1 << 30).unwrap();
        let reference = ExternalDump::load(dump, None, None).unwrap();
        let meta = reference
            .meta
            .clone()
            .expect("the fixture dump has metadata");
        // Fed the reference's generated tokens, as check --reference does.
        let mut prompt = meta.tokens.clone();
        prompt.extend(&meta.generated);
        let schedule = Schedule {
            prompt,
            prefill_len: meta.prefill,
            decode_steps: 0,
        };
        let report = run_check(&model, &schedule, "dtype=f32", Some(reference));
        assert!(
            report.findings.is_empty(),
            "{}:\n{}",
            case.name,
            describe(&report)
        );
        followed += report
            .selection_notes
            .iter()
            .filter(|n| n.kind == "selection-flip" && n.comparison == "reference")
            .count();
    }
    assert!(followed > 0, "no fixture dump broke a tie another way");
}

#[test]
fn every_fault_is_caught_in_bf16() {
    for layout in ["glm5-tiny", "deepseek-v3-tiny"] {
        let model = common::synthetic(layout, 0);
        let schedule = Schedule {
            prompt: common::prompt(model.layout.vocab_size, 12),
            prefill_len: 9,
            decode_steps: 4,
        };
        for (fault, op) in [
            ("output-buffer-disconnect", "attn_output"),
            ("softmax-scale-latent", "attn_probs"),
            ("absorb-wrong-split", "attn_probs"),
            ("lse-base-mismatch", "attn_probs"),
            ("skip-padded-rows", "attn_probs"),
            ("kv-cache-off-by-one", "attn_probs"),
        ] {
            let report = run_check(
                &model,
                &schedule,
                &format!("dtype=bf16,inject={fault}"),
                None,
            );
            let first = report
                .findings
                .first()
                .unwrap_or_else(|| panic!("{layout} {fault}: not caught"));
            assert_eq!(
                first.op,
                format!("model.layers.0.self_attn.{op}"),
                "{layout} {fault}:\n{}",
                describe(&report)
            );
        }
    }
    // The FP8 latent cache's codec faults: they need the cache (and GLM-5's latent rows).
    let model = common::synthetic("glm5-rank8", 0);
    let schedule = Schedule {
        prompt: common::prompt(model.layout.vocab_size, 12),
        prefill_len: 9,
        decode_steps: 4,
    };
    for fault in ["fp8-scale-default", "fp8-amax-padded-rows"] {
        let flags = format!("dtype=bf16,kv-cache-dtype=fp8_ds_mla,inject={fault}");
        let report = run_check(&model, &schedule, &flags, None);
        let first = report
            .findings
            .first()
            .unwrap_or_else(|| panic!("glm5-rank8 {fault}: not caught"));
        assert_eq!(
            (first.kind.to_string().as_str(), first.op.as_str()),
            ("kv-quant-mismatch", "model.layers.0.self_attn.latent_cache"),
            "{fault}:\n{}",
            describe(&report)
        );
    }
    let model = Model::synthetic_quantized(
        mladb::model::Layout::resolve("glm5-tiny-wide").unwrap(),
        0,
        Some(mladb::gguf::GgmlType::from_name("q4_k").unwrap()),
        1 << 30,
    )
    .unwrap();
    let schedule = Schedule {
        prompt: common::prompt(model.layout.vocab_size, 12),
        prefill_len: 9,
        decode_steps: 3,
    };
    let report = run_check(
        &model,
        &schedule,
        "dtype=bf16,inject=q4k-scale-unpack",
        None,
    );
    assert!(
        report
            .findings
            .iter()
            .any(|f| f.kind.to_string() == "quant-mismatch"),
        "{}",
        describe(&report)
    );
}

/// A copy of a random GLM-5 checkpoint whose indexer head weights are all zero: every DSA score
/// is exactly 0, so every top-k with more keys than it keeps breaks an exact tie. (The head
/// weights themselves are then an all-zero output, which check rightly reports.)
fn tied_checkpoint(from: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(from.join("config.json"), dir.path().join("config.json")).unwrap();
    let bytes = std::fs::read(from.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let zeros: Vec<(String, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let data = if name.ends_with("indexer.weights_proj.weight") {
                vec![0u8; view.data().len()]
            } else {
                view.data().to_vec()
            };
            (name, data)
        })
        .collect();
    let views: Vec<(String, TensorView)> = zeros
        .iter()
        .map(|(name, data)| {
            let v = st.tensor(name).unwrap();
            (
                name.clone(),
                TensorView::new(v.dtype(), v.shape().to_vec(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    dir
}

#[test]
fn a_tie_built_on_purpose_is_noted_with_its_candidates() {
    let case = glm5_case();
    let dir = tied_checkpoint(&case.dir);
    let model = Model::hf_checkpoint(dir.path(), 1 << 30).unwrap();
    let report = run_check(&model, &case.schedule, "dtype=f32", None);
    let others = besides_zero_head_weights(&report);
    assert!(others.is_empty(), "{}", others.join("\n"));
    let ties: Vec<_> = report
        .selection_notes
        .iter()
        .filter(|n| n.kind == "ambiguous-selection" && n.op.ends_with("indexer.topk"))
        .collect();
    assert!(
        !ties.is_empty(),
        "no tie noted: {:#?}",
        report.selection_notes
    );
    // All scores are 0: margins are exact ties, candidates listed on both sides.
    let first = &ties[0].detail;
    assert!(first.contains("margin 0.00e0"), "{first}");
    assert!(!first.contains("(0 exact ties)"), "{first}");
    assert!(
        first.contains("kept [") && first.contains("left out ["),
        "{first}"
    );
}

/// Another engine that breaks an exact DSA tie the other way (mladb itself, forced to the other
/// choice, standing in for it): the flip is noted and followed, and no finding remains.
#[test]
fn a_tie_broken_the_other_way_is_followed() {
    let case = glm5_case();
    let dir = tied_checkpoint(&case.dir);
    let model = Model::hf_checkpoint(dir.path(), 1 << 30).unwrap();
    let layers = 0..model.layout.num_layers;
    let job = Job {
        model: &model,
        backend: &CpuBackend,
        schedule: &case.schedule,
        layers: &layers,
        poison: true,
    };
    let run = job.run(Flags::default(), None).unwrap();
    // A prefill top-k row that decides (more causal keys than it keeps).
    let topk = model.layout.indexer.as_ref().unwrap().topk;
    let (i, e) = first_prefill_topk(&run);
    let row = (0..e.shape[0])
        .find(|&r| r + 1 > topk)
        .expect("a deciding row");
    let listing = run.outputs[i].data()[row * e.shape[1]..(row + 1) * e.shape[1]].to_vec();
    let left_out = (0..=row).find(|k| !listing.contains(&(*k as f32))).unwrap();

    // Every score is 0: a left-out key in place of a kept one is the tie broken another way.
    let mut other_way: Vec<usize> = listing.iter().map(|&k| k as usize).collect();
    other_way[0] = left_out;
    let mut forced = ForcedSelections::default();
    forced.force(e.phase, &e.name, row, other_way);
    let other_engine = job
        .run_forced(
            Flags::default(),
            &case.schedule,
            &std::sync::Arc::new(forced),
            None,
        )
        .unwrap();
    let dump = ExternalDump::from_run(&other_engine);
    // Without the choice in the dump (transformers' hooks record no indices), the difference
    // stays, but the finding says what it follows.
    let mut without_choice = ExternalDump::from_run(&other_engine);
    without_choice.tensors.remove(&(e.phase, e.name.clone()));
    let report = run_check(&model, &case.schedule, "", Some(without_choice));
    let after_tie = report
        .findings
        .iter()
        .find(|f| f.kind.to_string() == "reference-mismatch")
        .unwrap_or_else(|| panic!("the other tie-break shows:\n{}", describe(&report)));
    assert!(
        after_tie.detail.contains("likely a tie-break difference")
            && after_tie.detail.contains("holds no choice"),
        "{}",
        after_tie.detail
    );
    let report = run_check(&model, &case.schedule, "", Some(dump));
    let others = besides_zero_head_weights(&report);
    assert!(others.is_empty(), "{}", others.join("\n"));
    assert!(
        report
            .selection_notes
            .iter()
            .any(|n| n.kind == "selection-flip" && n.op == e.name && n.comparison == "reference"),
        "{:#?}",
        report.selection_notes
    );
}

/// mladb's own dump with one DSA choice changed to the causal key its scores rank lowest: a
/// choice no noise explains, reported at the top-k.
#[test]
fn a_choice_beyond_noise_is_a_finding() {
    let case = glm5_case();
    let model = Model::hf_checkpoint(&case.dir, 1 << 30).unwrap();
    let run = plain_run(&model, &case.schedule);
    let topk = model.layout.indexer.as_ref().unwrap().topk;
    let (i, e) = first_prefill_topk(&run);
    let scores = run
        .output(e.phase, &e.name.replace(".topk", ".scores"))
        .unwrap();
    let row = e.shape[0] - 1;
    assert!(row + 1 > topk, "the last prefill row decides");
    let causal = &scores.row(row)[..=row];
    let (worst, _) = causal
        .iter()
        .enumerate()
        .min_by(|a, b| a.1.total_cmp(b.1))
        .unwrap();
    let mut dump = ExternalDump::from_run(&run);
    let (_, data) = dump.tensors.get_mut(&(e.phase, e.name.clone())).unwrap();
    let listing = &mut data[row * e.shape[1]..(row + 1) * e.shape[1]];
    // Replace the kept key the scores rank highest by the one they rank lowest.
    let best = (0..listing.len())
        .max_by(|&a, &b| causal[listing[a] as usize].total_cmp(&causal[listing[b] as usize]))
        .unwrap();
    listing[best] = worst as f32;
    let report = run_check(&model, &case.schedule, "", Some(dump));
    let finding = report
        .findings
        .iter()
        .find(|f| f.op == e.name && f.index == i)
        .unwrap_or_else(|| panic!("no finding at the top-k:\n{}", describe(&report)));
    assert!(
        finding.detail.contains("beyond noise"),
        "{}",
        finding.detail
    );
}

#[test]
fn notes_leave_the_exit_code_alone() {
    let out = Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args([
            "check",
            "--layout",
            "deepseek-v3-tiny",
            "--seed",
            "1",
            "--prefill",
            "6",
            "--decode",
            "4",
            "--dtype",
            "bf16",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("note: selection-flip"), "{stdout}");
    assert!(stdout.contains("no findings"), "{stdout}");
    assert_eq!(out.status.code(), Some(0), "{stdout}");
}

/// The TUI's comparisons (`d`) are selection-aware too: on a clean bf16 run whose other-path run
/// flips a routing choice within noise, the flip is logged and forced, no op is marked as
/// diverging, and a saved session replays and verifies with the forced choice.
#[test]
fn the_debugger_compares_as_check_does() {
    use mladb::debug::compare::{compare_runs, first_divergence};
    use mladb::debug::tolerance::Tolerances;
    use mladb::engine::StorageDtype;
    use mladb::tui::host::AuxKind;
    use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
    let mut app = common::live_app("glm5-tiny", "dtype=bf16", 12, 12, 4);
    for c in "cd".chars() {
        app.on_key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE));
    }
    assert!(
        app.log
            .iter()
            .any(|l| l.contains("selection flip within noise")),
        "{:#?}",
        app.log
    );
    let run = app.mirror.current().unwrap();
    let other = app.mirror.aux(AuxKind::OtherPath).unwrap();
    assert!(!other.forced.is_empty(), "the other-path run was forced");
    let heads = app.mirror.layout().unwrap().num_heads;
    let list = compare_runs(run, other, heads, &Tolerances::Table(StorageDtype::Bf16));
    assert!(first_divergence(&list).is_none());

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.ron");
    for c in format!(":save {}", path.display()).chars() {
        app.on_key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE));
    }
    app.on_key(KeyEvent::new(KeyCode::Enter, KeyModifiers::NONE));
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        text.contains("forced:"),
        "the session records the forced choice"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(["replay", path.to_str().unwrap(), "--verify"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

cpu_and_gpu!(
    clean_tiny_layouts_report_nothing_in_f32_and_bf16,
    short_contexts_report_nothing,
    random_hf_checkpoints_are_clean_in_f32_and_bf16,
);
