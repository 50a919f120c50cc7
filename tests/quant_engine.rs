//! Quantized weights in the engine: `--quant` as a GGUF file would hold them, the quantized
//! linear, both routes from a quantized kv_b_proj to W_UK / W_UV (identity matrix and
//! force-dequantize) with their per-head report, the live force-dequant toggle, and the
//! q4k-scale-unpack fault caught by `check` as a quant-mismatch.

mod common;

use mladb::backend::cpu::CpuBackend;
use mladb::backend::Backend;
use mladb::debug::controller::Controller;
use mladb::debug::detect::{check, CheckOptions, FindingKind};
use mladb::debug::quant::kv_b_report;
use mladb::debug::runner::Job;
use mladb::debug::Flags;
use mladb::engine::generate::Schedule;
use mladb::engine::{OpKind, Phase};
use mladb::gguf::GgmlType;
use mladb::model::quant::{QuantFaults, QuantTensor};
use mladb::model::{Layout, Model};
use mladb::stats::rel_l2;
use mladb::tensor::Tensor;
use std::sync::Arc;

fn quantized(layout: &str, ty: GgmlType) -> Model {
    Model::synthetic_quantized(
        Layout::resolve(layout).unwrap(),
        5,
        Some(ty),
        common::BUDGET,
    )
    .unwrap()
}

fn schedule(model: &Model) -> Schedule {
    Schedule {
        prompt: common::prompt(model.layout.vocab_size, 10),
        prefill_len: 8,
        decode_steps: 2,
    }
}

#[test]
fn quant_stores_weights_as_a_gguf_file_would() {
    let model = quantized("glm5-tiny-wide", GgmlType::Q4_K);
    // kv_b_proj rows are 512 values: whole Q4_K super-blocks.
    let kv_b = model
        .weights
        .quantized("model.layers.0.self_attn.kv_b_proj.weight")
        .unwrap()
        .unwrap();
    assert_eq!(kv_b.ty, GgmlType::Q4_K);
    // q_b_proj rows are 96 values: not whole super-blocks, so it falls back to Q4_0.
    let q_b = model
        .weights
        .quantized("model.layers.0.self_attn.q_b_proj.weight")
        .unwrap()
        .unwrap();
    assert_eq!(q_b.ty, GgmlType::Q4_0);
    // Norms and the router stay plain.
    assert!(model
        .weights
        .quantized("model.layers.0.input_layernorm.weight")
        .unwrap()
        .is_none());
    assert!(model
        .weights
        .quantized("model.layers.1.mlp.gate.weight")
        .unwrap()
        .is_none());
    // What the engine reads is the decoded blocks, and the error is what Q4_K makes.
    let read = model
        .weights
        .get("model.layers.0.self_attn.kv_b_proj.weight")
        .unwrap();
    let decoded = kv_b.dequantize(QuantFaults::default()).unwrap();
    assert_eq!(read.data(), &decoded[..]);
    let original = model
        .weights
        .original("model.layers.0.self_attn.kv_b_proj.weight")
        .unwrap()
        .unwrap();
    let err = rel_l2(&decoded, original.data());
    assert!((0.02..0.12).contains(&err), "Q4_K error {err}");
}

#[test]
fn the_quantized_linear_equals_the_dequantized_one() {
    let mut rng = common::Lcg::new(common::seed());
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ] {
        let (rows, cols, n) = (70, 512, 5);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.next_f32() - 0.5).collect();
        let q = QuantTensor::quantize(ty, rows, cols, &w).unwrap();
        let x = Tensor::from_vec(
            &[n, cols],
            (0..n * cols).map(|_| rng.next_f32() - 0.5).collect(),
        );
        let plain = Tensor::from_vec(&[rows, cols], q.dequantize(QuantFaults::default()).unwrap());
        let expected = CpuBackend.linear(&x, &plain, None).unwrap();
        let got = CpuBackend
            .linear_quant(&x, &q, QuantFaults::default())
            .unwrap();
        assert_eq!(got.shape(), &[n, rows]);
        let err = rel_l2(got.data(), expected.data());
        assert!(err < 1e-6, "{ty}: {err}");
    }
}

#[test]
fn force_dequant_switches_the_kv_b_route_and_the_report_compares_them() {
    let model = quantized("glm5-tiny-wide", GgmlType::Q4_K);
    let s = schedule(&model);
    let layers = 0..model.layout.num_layers;
    let job = Job {
        model: &model,
        backend: &CpuBackend,
        schedule: &s,
        layers: &layers,
        poison: false,
    };
    let off = job.run(Flags::default(), None).unwrap();
    let on = job
        .run(Flags::parse("force-dequant").unwrap(), None)
        .unwrap();
    let names = |r: &mladb::debug::RunRecord| -> Vec<String> {
        r.events
            .iter()
            .filter(|e| e.kind == OpKind::Dequantize)
            .map(|e| format!("{} {}", e.phase, e.name))
            .collect()
    };
    // Off: naive prefill multiplies with the blocks; the absorbed decode derives W through the
    // identity matrix once per layer. On: kv_b_proj decoded once per layer, before prefill uses it.
    let (n_off, n_on) = (names(&off), names(&on));
    assert_eq!(n_off.len(), 4, "{n_off:?}");
    assert!(
        n_off
            .iter()
            .all(|n| n.starts_with("decode.0") && n.ends_with("kv_b_identity")),
        "{n_off:?}"
    );
    assert_eq!(n_on.len(), 4, "{n_on:?}");
    assert!(
        n_on.iter()
            .all(|n| n.starts_with("prefill") && n.ends_with("kv_b_dequant")),
        "{n_on:?}"
    );
    // Both routes give the same numbers on an exact backend.
    let logits = |r: &mladb::debug::RunRecord| {
        r.output(Phase::Decode(1), "logits")
            .unwrap()
            .data()
            .to_vec()
    };
    assert!(rel_l2(&logits(&off), &logits(&on)) < 1e-6);
    // The derived weights are the decoded blocks.
    let kv_b = model
        .weights
        .get("model.layers.2.self_attn.kv_b_proj.weight")
        .unwrap();
    let derived = off
        .output(Phase::Decode(0), "model.layers.2.self_attn.kv_b_identity")
        .unwrap();
    assert_eq!(derived.shape(), kv_b.shape());
    assert!(rel_l2(derived.data(), kv_b.data()) < 1e-7);

    let report = kv_b_report(&job, Flags::default()).unwrap();
    assert_eq!(report.len(), 4);
    for r in &report {
        assert_eq!(r.ty, GgmlType::Q4_K);
        for v in [&r.w_uk, &r.w_uv, &r.attn] {
            assert_eq!(v.len(), model.layout.num_heads);
            assert!(
                v.iter().all(|x| x.is_finite() && *x < 1e-6),
                "layer {}: {v:?}",
                r.layer
            );
        }
    }
}

#[test]
fn the_live_toggle_reexecutes_from_the_first_kv_b_op() {
    let model = Arc::new(quantized("glm5-tiny", GgmlType::Q8_0));
    let s = schedule(&model);
    let layers = 0..model.layout.num_layers;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend);
    let mut c = Controller::new(model, backend, s, layers, Flags::default()).unwrap();
    while !c.finished() {
        c.continue_run();
    }
    let before = c.current().len();
    let change = c.set_flag("force-dequant", "on").unwrap();
    assert!(change.note.is_none(), "{:?}", change.note);
    assert!(change.executed > 0 && change.replayed > 0, "{change:?}");
    while !c.finished() {
        c.continue_run();
    }
    let first = change.first_affected.expect("the change affects an op");
    assert!(first.2.contains("layers.0.self_attn"), "{first:?}");
    assert!(c
        .current()
        .find(Phase::Prefill, "model.layers.0.self_attn.kv_b_dequant")
        .is_some());
    assert_eq!(
        c.current().len(),
        before,
        "one derivation op per layer either way"
    );
}

#[test]
fn check_catches_the_q4k_scale_unpacking_fault() {
    let model = quantized("glm5-tiny-wide", GgmlType::Q4_K);
    let s = schedule(&model);
    let layers = 0..model.layout.num_layers;
    let job = Job {
        model: &model,
        backend: &CpuBackend,
        schedule: &s,
        layers: &layers,
        poison: true,
    };
    let options = CheckOptions {
        tolerance: None,
        reference: None,
    };
    let clean = check(&job, Flags::default(), &options).unwrap();
    assert!(clean.findings.is_empty(), "{:#?}", clean.findings);
    let faulty = check(
        &job,
        Flags::parse("inject=q4k-scale-unpack").unwrap(),
        &options,
    )
    .unwrap();
    let quant: Vec<_> = faulty
        .findings
        .iter()
        .filter(|f| f.kind == FindingKind::QuantMismatch)
        .collect();
    assert!(!quant.is_empty(), "{:#?}", faulty.findings);
    assert!(quant[0].op.contains("layers.0.self_attn"), "{:?}", quant[0]);
    assert!(quant[0].detail.contains("Q4_K"), "{}", quant[0].detail);

    // A GGUF file has no original weights: its decoding is checked against the reference codec.
    let gguf = Model::gguf(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/gguf/glm5-sparse-q.gguf"),
        common::BUDGET,
    )
    .unwrap();
    let s = schedule(&gguf);
    let layers = 0..gguf.layout.num_layers;
    let job = Job {
        model: &gguf,
        backend: &CpuBackend,
        schedule: &s,
        layers: &layers,
        poison: true,
    };
    let report = check(&job, Flags::default(), &options).unwrap();
    assert!(report.findings.is_empty(), "{:#?}", report.findings);
    assert!(
        report
            .notes
            .iter()
            .any(|n| n.contains("checked in 4 layer")),
        "{:?}",
        report.notes
    );
}
