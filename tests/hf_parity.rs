//! Parity with HF transformers, the external oracle: tiny random checkpoints made by
//! tools/make_hf_fixtures.py, with transformers' logits and per-layer outputs beside them.
//! mladb loads each checkpoint through `--model DIR` and must match within 1e-4 relative L2,
//! for a whole-prompt prefill and for prefill-then-decode, on every MLA path.

mod common;

use mladb::backend::cpu::CpuBackend;
use mladb::engine::{Engine, EngineOptions, MlaPath, MlaPaths, Phase, Recorder};
use mladb::model::Model;
use mladb::stats::rel_l2;
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const TOLERANCE: f64 = 1e-4;
const CASES: [&str; 4] = [
    "glm5-sparse",
    "deepseek-v3-yarn",
    "deepseek-v3-plain",
    "deepseek-v3-fp8",
];

struct Reference {
    tensors: HashMap<String, Vec<f32>>,
    prompt: Vec<u32>,
    prefill_len: usize,
    generated: Vec<u32>,
}

fn fixture_dir(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(case)
}

fn load_reference(case: &str) -> Reference {
    let path = fixture_dir(case).join("reference.safetensors");
    let bytes = std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run tools/make_hf_fixtures.py)", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap();
    let mut tensors = HashMap::new();
    let mut prompt = Vec::new();
    for (name, view) in st.tensors() {
        match view.dtype() {
            safetensors::Dtype::F32 => {
                let v = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                tensors.insert(name, v);
            }
            safetensors::Dtype::I32 => {
                prompt = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
                    .collect();
            }
            other => panic!("unexpected dtype {other:?} for {name}"),
        }
    }
    Reference {
        tensors,
        prompt,
        prefill_len: meta["prefill_len"].parse().unwrap(),
        generated: serde_json::from_str(&meta["generated"]).unwrap(),
    }
}

fn check(
    rec: &Recorder,
    reference: &Reference,
    ref_prefix: &str,
    phase: Phase,
    layers: usize,
    what: &str,
) {
    let mut names = vec!["logits".to_string()];
    names.extend((0..layers).map(|l| format!("model.layers.{l}")));
    for name in names {
        let key = format!("{ref_prefix}/{name}");
        let want = reference
            .tensors
            .get(&key)
            .unwrap_or_else(|| panic!("reference lacks {key}"));
        let got = rec
            .output(phase, &name)
            .unwrap_or_else(|| panic!("mladb did not run {name} in {phase}"));
        let err = rel_l2(got.data(), want);
        assert!(err < TOLERANCE, "{what}: {key} rel L2 {err:.3e}");
    }
}

fn model(case: &str) -> Model {
    Model::hf_checkpoint(&fixture_dir(case), common::BUDGET).unwrap()
}

#[test]
fn prefill_logits_and_every_layer_match_transformers() {
    for case in CASES {
        let reference = load_reference(case);
        let model = model(case);
        let layers = model.layout.num_layers;
        for prefill in [MlaPath::Naive, MlaPath::Absorbed] {
            let paths = MlaPaths {
                prefill,
                decode: MlaPath::Absorbed,
            };
            let mut engine = Engine::new(
                &model,
                &CpuBackend,
                EngineOptions::all_layers(&model, paths),
            )
            .unwrap();
            let mut rec = Recorder::default();
            engine.prefill(&reference.prompt, &mut rec).unwrap();
            check(
                &rec,
                &reference,
                "prefill",
                Phase::Prefill,
                layers,
                &format!("{case} {prefill:?} prefill"),
            );
        }
    }
}

#[test]
fn prefill_then_decode_matches_transformers_on_every_path() {
    for case in CASES {
        let reference = load_reference(case);
        let model = model(case);
        let layers = model.layout.num_layers;
        let k = reference.prefill_len;
        let feed: Vec<u32> = reference.prompt[k..]
            .iter()
            .chain(&reference.generated)
            .copied()
            .collect();
        for paths in [
            MlaPaths::production(),
            MlaPaths::disabled(),
            MlaPaths {
                prefill: MlaPath::Absorbed,
                decode: MlaPath::Absorbed,
            },
            MlaPaths {
                prefill: MlaPath::Absorbed,
                decode: MlaPath::Naive,
            },
        ] {
            let what = format!("{case} {paths:?}");
            let mut engine = Engine::new(
                &model,
                &CpuBackend,
                EngineOptions::all_layers(&model, paths),
            )
            .unwrap();
            let mut rec = Recorder::default();
            engine.prefill(&reference.prompt[..k], &mut rec).unwrap();
            check(
                &rec,
                &reference,
                "cached.prefill",
                Phase::Prefill,
                layers,
                &what,
            );
            for (step, &token) in feed.iter().enumerate() {
                let logits = engine.decode(token, &mut rec).unwrap();
                check(
                    &rec,
                    &reference,
                    &format!("cached.decode.{step}"),
                    Phase::Decode(step),
                    layers,
                    &what,
                );
                // Greedy generation picks what transformers picked: the logits after position
                // k + step predict the token at k + step + 1.
                if let Some(g) = (k + step + 1).checked_sub(reference.prompt.len()) {
                    if g < reference.generated.len() {
                        let (next, _) = mladb::engine::generate::argmax(logits.row(0));
                        assert_eq!(
                            next as u32, reference.generated[g],
                            "{what} greedy step {step}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn fixtures_exercise_what_they_claim() {
    let glm = model("glm5-sparse");
    let ix = glm.layout.indexer.as_ref().unwrap();
    assert!(
        load_reference("glm5-sparse").prompt.len() > ix.topk,
        "context longer than index_topk"
    );
    assert!(ix
        .layer_modes
        .as_ref()
        .unwrap()
        .contains(&mladb::model::layout::IndexerMode::Shared));
    let yarn = model("deepseek-v3-yarn");
    assert!(matches!(
        yarn.layout.rope.scaling,
        mladb::model::layout::RopeScaling::Yarn { .. }
    ));
    let moe = yarn.layout.moe.as_ref().unwrap();
    assert!(
        moe.n_group > 1 && moe.topk_group < moe.n_group,
        "group-limited routing"
    );
    assert_ne!(
        yarn.layout.v_head_dim,
        yarn.layout.qk_head_dim(),
        "v_head_dim differs from qk head dim"
    );
    let fp8 = std::fs::read(fixture_dir("deepseek-v3-fp8").join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&fp8).unwrap();
    let kv_b = st
        .tensor("model.layers.0.self_attn.kv_b_proj.weight")
        .unwrap();
    assert_eq!(
        kv_b.dtype(),
        safetensors::Dtype::F8_E4M3,
        "FP8 weights with block scales"
    );
    assert!(st
        .tensor("model.layers.0.self_attn.kv_b_proj.weight_scale_inv")
        .is_ok());
    let plain = model("deepseek-v3-plain");
    assert!(
        plain.layout.q_lora_rank.is_none()
            && !plain.layout.rope.interleaved
            && plain.layout.attention_bias
    );
}

/// tools/hf_dump.py recorded every module output of transformers for glm5-sparse (prefill 6,
/// then 4 prompt tokens and 3 greedy ones through decode); mapped to mladb's op names with the
/// HF name map, every one agrees with mladb's op of the same name.
#[test]
fn every_hf_module_output_matches_the_op_of_the_same_name() {
    use mladb::debug::detect::{check, CheckOptions, FindingKind};
    use mladb::debug::external::{ExternalDump, NameMap};
    use mladb::debug::runner::Job;
    use mladb::debug::Flags;
    use mladb::engine::generate::Schedule;
    let reference = load_reference("glm5-sparse");
    let model = model("glm5-sparse");
    let dump_path = fixture_dir("glm5-sparse").join("hf-dump.safetensors");
    let schedule = Schedule {
        prompt: reference.prompt.clone(),
        prefill_len: 6,
        decode_steps: 3,
    };
    let layers = 0..model.layout.num_layers;
    let job = Job {
        model: &model,
        backend: &CpuBackend,
        schedule: &schedule,
        layers: &layers,
        poison: true,
    };
    let dump = ExternalDump::load(&dump_path, Some(&NameMap::hf()), None).unwrap();
    let run = job.run(Flags::default(), None).unwrap();
    let compared = dump.compare(&run, model.layout.num_heads).unwrap();
    assert!(compared.comparisons.len() > 500, "{}", compared.summary());
    for c in &compared.comparisons {
        let d = c
            .diff
            .as_ref()
            .unwrap_or_else(|e| panic!("{} {}: {e}", c.phase, c.name));
        assert!(
            d.error() < TOLERANCE,
            "{} {}: {}",
            c.phase,
            c.name,
            d.summary()
        );
    }
    // A fault shows against it at the first op transformers also has.
    let dump = ExternalDump::load(&dump_path, Some(&NameMap::hf()), None).unwrap();
    let options = CheckOptions {
        tolerance: None,
        reference: Some(dump),
    };
    let report = check(
        &job,
        Flags::parse("inject=rope-noninterleaved").unwrap(),
        &options,
    )
    .unwrap();
    let first = report
        .findings
        .iter()
        .find(|f| f.kind == FindingKind::ReferenceMismatch)
        .unwrap();
    assert_eq!(
        (first.phase, first.op.as_str()),
        (Phase::Prefill, "model.layers.0.self_attn.o_proj")
    );
}
