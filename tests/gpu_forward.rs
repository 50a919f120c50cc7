//! Whole forward passes on the GPU against the CPU reference and the HF fixtures, and the fault
//! catalogue caught on the GPU. Ignored by default (CI has no GPU; cargo counts them as
//! ignored); `tools/gpu_check.sh` runs them with `--include-ignored` on the H200 the project
//! borrows, where a missing GPU fails them.

mod common;

use common::*;
use mladb::backend::cpu::CpuBackend;
use mladb::debug::detect::{check, CheckOptions, FindingKind};
use mladb::debug::runner::Job;
use mladb::debug::Flags;
use mladb::engine::generate::Schedule;
use mladb::engine::trace::Phase;
use mladb::engine::{MlaPath, MlaPaths, StorageDtype};
use mladb::model::Model;
use mladb::stats::rel_l2;
use std::path::Path;

fn run(
    model: &Model,
    backend: &dyn mladb::backend::Backend,
    flags: Flags,
    schedule: &Schedule,
) -> mladb::debug::RunRecord {
    let layers = 0..model.layout.num_layers;
    Job {
        model,
        backend,
        schedule,
        layers: &layers,
        poison: true,
    }
    .run(flags, None)
    .unwrap()
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn tiny_layouts_match_the_cpu_on_every_path() {
    for (name, gpu, tol) in gpu_backends() {
        let storage = if name.ends_with("bf16") {
            StorageDtype::Bf16
        } else {
            StorageDtype::F32
        };
        for layout in ["glm5-tiny", "deepseek-v3-tiny"] {
            let model = synthetic(layout, 31);
            let schedule = Schedule {
                prompt: prompt(model.layout.vocab_size, 12),
                prefill_len: 9,
                decode_steps: 2,
            };
            for paths in [
                MlaPaths::production(),
                MlaPaths::disabled(),
                MlaPaths {
                    prefill: MlaPath::Absorbed,
                    decode: MlaPath::Naive,
                },
            ] {
                let flags = Flags {
                    prefill_path: paths.prefill,
                    decode_path: paths.decode,
                    mla_disable: paths == MlaPaths::disabled(),
                    dtype: storage,
                    ..Flags::default()
                };
                let cpu = run(&model, &CpuBackend, flags, &schedule);
                let g = run(&model, gpu.as_ref(), flags, &schedule);
                assert_eq!(cpu.len(), g.len(), "{name} {layout}: op count");
                // Op by op in order. In bf16 the two runs (the CPU's emulated rounding, the
                // device's) may part at a MoE router or DSA top-k whose near-tie rounding flips
                // (seen on the H200 for both tiny layouts): every op up to the first flipped
                // selection must agree, nothing after it is compared. In f32 nothing may flip
                // and the logits of every phase must agree.
                for (i, e) in g.events.iter().enumerate() {
                    // Equal infinities (masked scores) agree; NaN never does.
                    let (a, b) = (&g.outputs[i], &cpu.outputs[i]);
                    let err =
                        mladb::debug::compare::diff(a.data(), b.data(), a.shape(), None).rel_l2;
                    if storage == StorageDtype::Bf16
                        && e.name.ends_with("topk_indices")
                        && err > 0.0
                    {
                        eprintln!(
                            "{name} {layout} {paths:?}: selection {}/{} flips under bf16 rounding (op {i} of {}); later ops not compared",
                            e.phase,
                            e.name,
                            g.len()
                        );
                        break;
                    }
                    assert!(
                        err < tol,
                        "{name} {layout} {paths:?}: op {i} {}/{} rel err {err:.3e}",
                        e.phase,
                        e.name
                    );
                }
                if storage == StorageDtype::F32 {
                    for phase in cpu.phases() {
                        let (a, b) = (
                            g.output(phase, "logits").unwrap(),
                            cpu.output(phase, "logits").unwrap(),
                        );
                        let err = rel_l2(a.data(), b.data());
                        assert!(
                            err < tol,
                            "{name} {layout} {paths:?} {phase}: logits rel err {err:.3e}"
                        );
                    }
                }
                // Nothing unwritten, and the buffers the trace names are device buffers.
                assert!(
                    g.events.iter().all(|e| e.stats.unwritten == 0),
                    "{name} {layout}: unwritten elements"
                );
                let on_device = g
                    .events
                    .iter()
                    .filter(|e| e.output.device == mladb::engine::trace::Device::Cuda)
                    .count();
                assert!(
                    on_device > g.len() / 2,
                    "{name}: {on_device} of {} outputs on the device",
                    g.len()
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn hf_fixtures_match_transformers_on_the_gpu() {
    for (name, gpu, tol) in gpu_backends() {
        if name.ends_with("bf16") {
            continue;
        }
        for case in [
            "glm5-sparse",
            "deepseek-v3-yarn",
            "deepseek-v3-plain",
            "deepseek-v3-fp8",
        ] {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/hf")
                .join(case);
            let model = Model::hf_checkpoint(&dir, BUDGET).unwrap();
            let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let prompt: Vec<u32> = st
                .tensor("prompt")
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
                .collect();
            let want: Vec<f32> = st
                .tensor("prefill/logits")
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let schedule = Schedule {
                prefill_len: prompt.len(),
                prompt,
                decode_steps: 0,
            };
            let g = run(&model, gpu.as_ref(), Flags::default(), &schedule);
            let err = rel_l2(g.output(Phase::Prefill, "logits").unwrap().data(), &want);
            assert!(
                err < tol,
                "{name} {case}: logits vs transformers rel err {err:.3e}"
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn the_fault_catalogue_is_caught_on_the_gpu() {
    for (name, gpu, _) in gpu_backends() {
        if name.ends_with("bf16") {
            continue;
        }
        let model = synthetic("glm5-tiny", 21);
        let schedule = Schedule {
            prompt: prompt(model.layout.vocab_size, 12),
            prefill_len: 9,
            decode_steps: 2,
        };
        let layers = 0..model.layout.num_layers;
        let job = Job {
            model: &model,
            backend: gpu.as_ref(),
            schedule: &schedule,
            layers: &layers,
            poison: true,
        };
        let clean = check(
            &job,
            Flags::default(),
            &CheckOptions {
                tolerance: None,
                reference: None,
            },
        )
        .unwrap();
        assert!(clean.findings.is_empty(), "{name}: {:#?}", clean.findings);
        for (fault, kind, op) in [
            (
                "output-buffer-disconnect",
                FindingKind::BufferDisconnect,
                "attn_output",
            ),
            (
                "softmax-scale-latent",
                FindingKind::AbsorbedNaiveMismatch,
                "attn_probs",
            ),
            (
                "absorb-wrong-split",
                FindingKind::AbsorbedNaiveMismatch,
                "attn_probs",
            ),
            (
                "lse-base-mismatch",
                FindingKind::AbsorbedNaiveMismatch,
                "attn_probs",
            ),
            // f32 storage runs the reference kernels, which leave the last head unwritten (the
            // fast decode's padded rows are tests/gpu_attention.rs's).
            ("skip-padded-rows", FindingKind::Unwritten, "attn_latent"),
            (
                "kv-cache-off-by-one",
                FindingKind::PrefillDecodeMismatch,
                "attn_probs",
            ),
        ] {
            let report = check(
                &job,
                Flags::parse(&format!("inject={fault}")).unwrap(),
                &CheckOptions {
                    tolerance: None,
                    reference: None,
                },
            )
            .unwrap();
            let want = format!("model.layers.0.self_attn.{op}");
            assert!(
                report
                    .findings
                    .iter()
                    .any(|f| f.kind == kind && f.op == want),
                "{name} {fault}: {:#?}",
                report.findings
            );
        }
    }
    // The FP8 latent cache's codec faults need the cache and GLM-5's latent rows: glm5-rank8
    // on bf16 storage, where the FP8-cache decode kernels run (their write kernel carries the
    // faults too).
    let gpu = cuda_backend(mladb::engine::StorageDtype::Bf16);
    let model = synthetic("glm5-rank8", 21);
    let schedule = Schedule {
        prompt: prompt(model.layout.vocab_size, 12),
        prefill_len: 9,
        decode_steps: 2,
    };
    let layers = 0..model.layout.num_layers;
    let job = Job {
        model: &model,
        backend: &gpu,
        schedule: &schedule,
        layers: &layers,
        poison: true,
    };
    for fault in ["fp8-scale-default", "fp8-amax-padded-rows"] {
        let mut flags =
            Flags::parse(&format!("kv-cache-dtype=fp8_ds_mla, inject={fault}")).unwrap();
        flags.device = mladb::debug::flags::DeviceFlag::Cuda;
        flags.dtype = mladb::engine::StorageDtype::Bf16;
        let options = CheckOptions {
            tolerance: None,
            reference: None,
        };
        let report = check(&job, flags, &options).unwrap();
        assert!(
            report
                .findings
                .iter()
                .any(|f| f.kind == FindingKind::KvQuantMismatch
                    && f.op == "model.layers.0.self_attn.latent_cache"),
            "cuda-bf16 {fault}: {:#?}",
            report.findings
        );
        // The fast decode read the faulty bytes the write kernel made, as the reference read
        // the faulty rows: the two kernels agree.
        assert!(
            !report
                .findings
                .iter()
                .any(|f| f.kind == FindingKind::KernelMismatch),
            "cuda-bf16 {fault}: {:#?}",
            report.findings
        );
    }
}

/// Keeps each event, handed over late (statistics brought back many ops at a time).
#[derive(Default)]
struct LateEvents(Vec<mladb::engine::trace::OpEvent>);

impl mladb::engine::trace::Observer for LateEvents {
    fn on_op(
        &mut self,
        event: &mladb::engine::trace::OpEvent,
        _: &mladb::tensor::Tensor,
    ) -> mladb::Result<()> {
        self.0.push(event.clone());
        Ok(())
    }

    fn takes_late_events(&self) -> bool {
        true
    }
}

/// A pass whose observer takes late events gets every op, in order, with the statistics an
/// observer handed each event at once gets (within the run-to-run noise of the device's
/// atomics), on both storage dtypes and on the fast and reference kernels.
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn late_events_carry_the_statistics_of_their_own_op() {
    use mladb::engine::{generate, Engine, EngineOptions, Recorder};
    for (name, gpu, tol) in gpu_backends() {
        let model = synthetic("glm5-tiny", 5);
        let schedule = Schedule {
            prompt: prompt(model.layout.vocab_size, 40),
            prefill_len: 33,
            decode_steps: 3,
        };
        let options = || EngineOptions::all_layers(&model, MlaPaths::production());
        let mut now = Recorder::default();
        generate::run(
            &mut Engine::new(&model, gpu.as_ref(), options()).unwrap(),
            &schedule,
            &mut now,
        )
        .unwrap();
        let mut late = LateEvents::default();
        generate::run(
            &mut Engine::new(&model, gpu.as_ref(), options()).unwrap(),
            &schedule,
            &mut late,
        )
        .unwrap();
        assert_eq!(late.0.len(), now.events.len(), "{name}: op count");
        let device_ops = now.events.iter().filter(|e| e.kernel.is_some()).count();
        assert!(device_ops > 0, "{name}: no attention op ran on the device");
        for (a, b) in late.0.iter().zip(&now.events) {
            let what = format!("{name} op {} {} {}", b.index, b.phase, b.name);
            assert_eq!(
                (a.index, a.phase, &a.name),
                (b.index, b.phase, &b.name),
                "{what}"
            );
            let (s, w) = (&a.stats, &b.stats);
            assert_eq!(
                (s.count, s.nan, s.unwritten, s.pos_inf, s.neg_inf),
                (w.count, w.nan, w.unwritten, w.pos_inf, w.neg_inf),
                "{what}"
            );
            assert!(
                (s.l2 - w.l2).abs() <= tol * w.l2.max(1e-6),
                "{what}: l2 {} late vs {} at once",
                s.l2,
                w.l2
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn a_small_device_cache_evicts_and_remakes_the_same_weights() {
    for (name, gpu, _) in gpu_backends() {
        let storage = if name.ends_with("bf16") {
            StorageDtype::Bf16
        } else {
            StorageDtype::F32
        };
        let flags = Flags {
            dtype: storage,
            ..Flags::default()
        };
        let schedule = Schedule {
            prompt: prompt(64, 10),
            prefill_len: 8,
            decode_steps: 2,
        };
        // Unbounded, then bounded to 64 KiB: far less than one layer's weights, so nearly every
        // weight is made again at each use.
        let roomy = synthetic("glm5-tiny", 5);
        let want = run(&roomy, gpu.as_ref(), flags, &schedule);
        assert!(roomy.weights.cached_bytes().device > 64 << 10, "{name}");
        let tight = synthetic("glm5-tiny", 5);
        tight.weights.set_device_budget(64 << 10);
        let got = run(&tight, gpu.as_ref(), flags, &schedule);
        let held = tight.weights.cached_bytes().device;
        assert!(held <= 64 << 10, "{name}: {held} bytes held on the device");
        assert_eq!(want.len(), got.len(), "{name}");
        for (i, e) in want.events.iter().enumerate() {
            let (a, b) = (want.outputs[i].data(), got.outputs[i].data());
            let same = a
                .iter()
                .zip(b)
                .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()));
            assert!(same, "{name}: {} differs with the small cache", e.name);
        }
    }
}

/// `--device auto` on a GPU host runs on the GPU and says so in the run's flags, with the GPU's
/// default dtype (bf16): the detectors that need the device flag (kernel-mismatch) act, and a
/// recorded session verifies against its own device. It used to run on the GPU with flags
/// saying cpu and f32.
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn device_auto_on_a_gpu_runs_there_and_says_so() {
    common::cuda_backend(StorageDtype::Bf16);
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(["run", "--layout", "glm5-tiny", "--device", "auto", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", common::stderr(&o));
    let out = common::stdout(&o);
    let summary: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(summary["device"], "cuda", "{summary}");
    assert_eq!(summary["flags"]["device"], "cuda", "{summary}");
    assert_eq!(summary["flags"]["dtype"], "bf16", "{summary}");
    // check's kernel-mismatch acts (it is skipped with a note on the CPU), on a layout with
    // GLM-5's latent width, the one the fast kernels are built for (glm5-tiny's 64/64 head dims
    // run the reference kernels on the GPU too, and say so).
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(["check", "--layout", "glm5-rank8", "--device", "auto"])
        .output()
        .unwrap();
    let out = common::stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{out}{}", common::stderr(&o));
    let compared = out
        .lines()
        .find_map(|l| l.split("fast vs reference kernels: ").nth(1))
        .and_then(|rest| rest.split(' ').next()?.parse::<usize>().ok());
    assert!(compared.is_some_and(|n| n > 0), "{out}");
}

/// On the fast kernels (GLM-5's latent width on the GPU: glm5-rank8), softmax-scale-latent and
/// lse-base-mismatch in the decode act, over a context that spans several of the fast decode's
/// splits: no note may call them idle. The idle report used to look for the reference kernel's
/// probabilities, which the fast kernels do not write, and said "every query attended to a
/// single key" / "the longest was 0" beside the findings they caused.
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn faults_acting_in_the_fast_decode_are_not_called_idle() {
    common::cuda_backend(StorageDtype::Bf16);
    let tokens: Vec<String> = (0..70)
        .map(|i| ((i * 7919 + 11) % 2000).to_string())
        .collect();
    let tokens = tokens.join(",");
    for fault in ["softmax-scale-latent@decode", "lse-base-mismatch@decode"] {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_mladb"))
            .args([
                "check", "--device", "cuda", "--layout", "glm5", "--layers", "0..1",
            ])
            .args([
                "--weight-cache-mb",
                "60000",
                "--tokens",
                &tokens,
                "--decode",
                "2",
            ])
            .args(["--inject", fault, "--json"])
            .output()
            .unwrap();
        let out = common::stdout(&o);
        let summary: serde_json::Value =
            serde_json::from_str(out.lines().last().unwrap_or("{}")).unwrap();
        let notes = summary["notes"].as_array().cloned().unwrap_or_default();
        let name = fault.split('@').next().unwrap();
        assert!(
            !notes.iter().any(|n| {
                let n = n.as_str().unwrap_or("");
                n.contains(name) && n.contains("nothing to act on")
            }),
            "{fault}: {notes:#?}"
        );
        assert!(
            summary["findings"].as_u64().unwrap_or(0) > 0,
            "{fault}: {out}"
        );
        assert_eq!(o.status.code(), Some(1), "{}", common::stderr(&o));
    }
}

/// A session recorded on the GPU's fast kernels is verified on the GPU, and refused on the
/// CPU with one error line (the CPU has no such kernels, so every op after the first attention
/// would "mismatch"); a bf16 session recorded on the CPU is verified on the GPU through the
/// reference kernels, whose ops are the CPU's. Both used to end in a false `mismatch`.
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn sessions_verify_across_devices_on_the_kernels_they_ran() {
    common::cuda_backend(StorageDtype::Bf16);
    let dir = tempfile::tempdir().unwrap();
    let mladb = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_mladb"))
            .args(args)
            .output()
            .unwrap()
    };
    let gpu = dir.path().join("gpu.ron");
    let cpu = dir.path().join("cpu.ron");
    let common_args = [
        "--layout",
        "glm5-rank8",
        "--layers",
        "0..1",
        "--tokens",
        "5,6,7,8,9",
    ];
    for (device, path) in [("cuda", &gpu), ("cpu", &cpu)] {
        let o = mladb(
            &[
                &[
                    "run", "--device", device, "--dtype", "bf16", "--decode", "2",
                ][..],
                &common_args,
                &["--record", path.to_str().unwrap()],
            ]
            .concat(),
        );
        assert!(o.status.success(), "{}", common::stderr(&o));
    }
    let verify = |path: &std::path::Path, device: &str| {
        mladb(&[
            "replay",
            path.to_str().unwrap(),
            "--verify",
            "--device",
            device,
        ])
    };
    let o = verify(&gpu, "cuda");
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}{}",
        common::stdout(&o),
        common::stderr(&o)
    );
    let o = verify(&gpu, "cpu");
    common::assert_clean_error(&o, "verify it with --device cuda");
    let o = verify(&cpu, "cuda");
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}{}",
        common::stdout(&o),
        common::stderr(&o)
    );
}
