//! The FP8 latent cache (`--kv-cache-dtype fp8_ds_mla`) on the CPU: the cache holds each row as
//! the codec's round trip and every attention reads it; `check` stays clean with it in f32 and
//! bf16 over seeds and schedules, catches both codec faults (and reports them idle on a bf16
//! cache), says nothing about FP8 when the cache is bf16; the layout it needs is an error
//! elsewhere; sessions saved before the flag load with a bf16 cache.

mod common;

use mladb::backend::cpu::CpuBackend;
use mladb::debug::detect::{CheckReport, FindingKind};
use mladb::debug::idle::{idle_flags, KvBStorage, Subject};
use mladb::debug::runner::Job;
use mladb::debug::{Flags, RunRecord};
use mladb::engine::faults::Fault;
use mladb::engine::generate::Schedule;
use mladb::engine::trace::{OpKind, Phase};
use mladb::engine::{Engine, EngineOptions, MlaPaths};
use mladb::model::Model;
use mladb::ops::kv_fp8::round_trip;
use mladb::ops::{Fp8Faults, KvCacheDtype};

fn schedule(model: &Model, len: usize, prefill: usize, decode: usize) -> Schedule {
    Schedule {
        prompt: common::prompt(model.layout.vocab_size, len),
        prefill_len: prefill,
        decode_steps: decode,
    }
}

fn run(model: &Model, schedule: &Schedule, flags: &str) -> RunRecord {
    let layers = 0..model.layout.num_layers;
    let job = Job {
        model,
        backend: &CpuBackend,
        schedule,
        layers: &layers,
        poison: true,
    };
    job.run(Flags::parse(flags).unwrap(), None).unwrap()
}

fn run_check(model: &Model, schedule: &Schedule, flags: &str) -> CheckReport {
    common::check_on(&CpuBackend, model, schedule, flags, None)
}

/// The rows a layer's latent cache write was given: c_kv | k_pe of the same phase.
fn written(run: &RunRecord, phase: Phase, prefix: &str) -> Vec<Vec<f32>> {
    let c_kv = run
        .output(phase, &format!("{prefix}kv_a_layernorm"))
        .unwrap();
    let k_pe = run.output(phase, &format!("{prefix}k_rope")).unwrap();
    (0..c_kv.rows())
        .map(|t| c_kv.row(t).iter().chain(k_pe.row(t)).copied().collect())
        .collect()
}

#[test]
fn the_cache_holds_the_codec_round_trip_and_attention_reads_it() {
    let model = common::synthetic("glm5-rank8", 4);
    let s = schedule(&model, 10, 6, 4);
    for dtype in ["f32", "bf16"] {
        let fp8 = run(
            &model,
            &s,
            &format!("dtype={dtype}, kv-cache-dtype=fp8_ds_mla"),
        );
        let plain = run(&model, &s, &format!("dtype={dtype}"));
        assert!(fp8.finished() && plain.finished());
        let mut writes = 0;
        for (i, e) in fp8.events.iter().enumerate() {
            let Some(prefix) = e.name.strip_suffix("latent_cache") else {
                continue;
            };
            let rows = written(&fp8, e.phase, prefix);
            let want: Vec<f32> = rows
                .iter()
                .flat_map(|r| round_trip(r, Fp8Faults::default()).unwrap())
                .collect();
            assert_eq!(
                fp8.outputs[i].data(),
                &want[..],
                "{dtype} {} {}",
                e.phase,
                e.name
            );
            assert_ne!(want, rows.concat(), "E4M3 moves some value");
            // With a bf16 cache the write is the rows as given.
            let j = plain.find(e.phase, &e.name).unwrap();
            let plain_rows = written(&plain, e.phase, prefix).concat();
            assert_eq!(plain.outputs[j].data(), &plain_rows[..]);
            writes += 1;
        }
        // A prefill of 6, the 4 prompt tokens left and 4 generated ones decoded: 9 phases.
        assert_eq!(writes, 3 * 9, "three layers, nine phases");
        // The first attention reads the quantized cache: it differs from the bf16 cache's,
        // while everything before the first cache write is the same.
        let first = fp8
            .events
            .iter()
            .position(|e| e.name.ends_with("latent_cache"))
            .unwrap();
        for i in 0..first {
            assert_eq!(fp8.outputs[i].data(), plain.outputs[i].data());
        }
        let attn = "model.layers.0.self_attn.attn_output";
        let (a, b) = (
            fp8.output(Phase::Prefill, attn).unwrap(),
            plain.output(Phase::Prefill, attn).unwrap(),
        );
        assert_ne!(
            a.data(),
            b.data(),
            "{dtype}: the naive prefill reads the cached rows"
        );
        // The naive path's decompression reads the cache, not an orphan buffer.
        let kv_b = &fp8.events[fp8
            .find(Phase::Prefill, "model.layers.0.self_attn.kv_b_proj")
            .unwrap()];
        assert!(kv_b
            .inputs
            .iter()
            .any(|r| r.role == mladb::engine::trace::BufferRole::Cache));
    }
}

#[test]
fn check_is_clean_with_an_fp8_cache() {
    for (seed, (len, prefill, decode)) in [(0, (12, 6, 4)), (1, (20, 20, 0)), (2, (30, 9, 8))] {
        let model = common::synthetic("glm5-rank8", seed);
        let s = schedule(&model, len, prefill, decode);
        for flags in [
            "kv-cache-dtype=fp8_ds_mla",
            "dtype=bf16, kv-cache-dtype=fp8_ds_mla",
            "mla-disable, kv-cache-dtype=fp8_ds_mla",
            "prefill-path=absorbed, decode-path=naive, kv-cache-dtype=fp8_ds_mla",
        ] {
            let report = run_check(&model, &s, flags);
            assert!(
                report.findings.is_empty(),
                "seed {seed} {flags}: {:#?}",
                report.findings
            );
            assert!(
                report
                    .notes
                    .iter()
                    .any(|n| n.contains("fp8_ds_mla vs a bf16 latent cache")),
                "{:?}",
                report.notes
            );
        }
    }
}

#[test]
fn both_codec_faults_are_caught_by_kv_quant_mismatch() {
    let model = common::synthetic("glm5-rank8", 7);
    let s = schedule(&model, 12, 9, 3);
    for dtype in ["f32", "bf16"] {
        for fault in ["fp8-scale-default", "fp8-amax-padded-rows"] {
            for (scope, phase) in [("", Phase::Prefill), ("@decode", Phase::Decode(0))] {
                let flags =
                    format!("dtype={dtype}, kv-cache-dtype=fp8_ds_mla, inject={fault}{scope}");
                let report = run_check(&model, &s, &flags);
                let first = report
                    .findings
                    .iter()
                    .find(|f| f.kind == FindingKind::KvQuantMismatch)
                    .unwrap_or_else(|| panic!("{flags}: not caught: {:#?}", report.findings));
                assert_eq!(first.op, "model.layers.0.self_attn.latent_cache", "{flags}");
                assert_eq!(first.phase, phase, "{flags}: {}", first.detail);
                assert!(first.detail.contains("beyond what E4M3 explains"));
            }
        }
    }
}

#[test]
fn a_bf16_cache_has_no_fp8_findings_and_its_faults_idle() {
    let model = common::synthetic("glm5-rank8", 1);
    let s = schedule(&model, 8, 5, 2);
    let report = run_check(&model, &s, "inject=fp8-scale-default");
    assert!(report.findings.is_empty(), "{:#?}", report.findings);
    assert!(!report.notes.iter().any(|n| n.contains("fp8_ds_mla vs")));
    assert!(
        report.notes.iter().any(
            |n| n.contains("inject fp8-scale-default had nothing to act on")
                && n.contains("--kv-cache-dtype fp8_ds_mla")
        ),
        "{:?}",
        report.notes
    );
    // Idle exactly when the run is the run without the fault, in each scope.
    let kv_b = KvBStorage::of(&model, &(0..model.layout.num_layers)).unwrap();
    let no_decode = schedule(&model, 6, 6, 0);
    for (s, base) in [
        (&s, ""),
        (&s, "kv-cache-dtype=fp8_ds_mla"),
        (&no_decode, "kv-cache-dtype=fp8_ds_mla"),
    ] {
        let clean = run(&model, s, base);
        for f in [Fault::Fp8ScaleDefault, Fault::Fp8AmaxPaddedRows] {
            for scope in ["", "@prefill", "@decode"] {
                let text = format!("{base}, inject={}{scope}", f.name());
                let with_it = run(&model, s, &text);
                let idle = idle_flags(&with_it.flags, &kv_b, &with_it.events, true)
                    .into_iter()
                    .find(|i| i.subject == Subject::Fault(f));
                let same = with_it
                    .outputs
                    .iter()
                    .zip(&clean.outputs)
                    .all(|(a, b)| a.data() == b.data());
                assert_eq!(idle.is_some(), same, "{text} on {s:?}: {idle:?}");
            }
        }
    }
}

#[test]
fn the_format_needs_glm5_latent_rows() {
    let model = common::synthetic("glm5-tiny", 0);
    let options = EngineOptions {
        kv_cache: KvCacheDtype::Fp8DsMla,
        ..EngineOptions::new(&model, MlaPaths::production())
    };
    let err = Engine::new(&model, &CpuBackend, options)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("kv-cache-dtype fp8_ds_mla needs kv_lora_rank 512 and qk_rope_head_dim 64 (this layout: 64+16)"),
        "{err}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args([
            "run",
            "--layout",
            "glm5-tiny",
            "--kv-cache-dtype",
            "fp8_ds_mla",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("error: kv-cache-dtype fp8_ds_mla needs"),
        "{stderr}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(["run", "--layout", "glm5-rank8", "--kv-cache-dtype", "e5m2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error: --kv-cache-dtype"));
}

#[test]
fn sessions_saved_before_the_flag_load_with_a_bf16_cache() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("sessions");
    for name in [
        "force-dequant.ron",
        "output-buffer-disconnect.ron",
        "weight-absorption.ron",
    ] {
        let s = mladb::session::Session::load(&dir.join(name)).unwrap();
        assert_eq!(s.flags.kv_cache, KvCacheDtype::Bf16, "{name}");
    }
    // The op an FP8 run adds nothing to: its trace has the same ops as a bf16 run's.
    let model = common::synthetic("glm5-rank8", 2);
    let s = schedule(&model, 6, 4, 1);
    let (a, b) = (
        run(&model, &s, "kv-cache-dtype=fp8_ds_mla"),
        run(&model, &s, ""),
    );
    let names = |r: &RunRecord| -> Vec<(Phase, String, OpKind)> {
        r.events
            .iter()
            .map(|e| (e.phase, e.name.clone(), e.kind))
            .collect()
    };
    assert_eq!(names(&a), names(&b));
}
