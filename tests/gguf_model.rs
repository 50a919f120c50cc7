//! GGUF models end to end: tools/hf_to_gguf.py converts tiny HF fixtures to GGUF (some tensors
//! quantized to Q8_0 / Q5_0 / Q5_1 / Q4_1 / Q4_0 / F16, experts stacked, kv_b_proj merged or
//! split into attn_k_b / attn_v_b) and writes what gguf-py decodes the quantized tensors back
//! to. mladb's forward pass on the GGUF file must equal its pass on the HF checkpoint with those
//! decoded tensors in place of the originals; files with a missing or misshapen tensor fail
//! with an error naming it.

mod common;

use mladb::engine::{MlaPath, MlaPaths, OpKind, Phase};
use mladb::gguf::{GgmlType, GgufFile, GgufWriter};
use mladb::model::Model;
use mladb::stats::rel_l2;
use safetensors::SafeTensors;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const CASES: [(&str, &str); 2] = [
    ("glm5-sparse-q", "glm5-sparse"),
    ("deepseek-v3-plain-split", "deepseek-v3-plain"),
];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn f32s(view: &safetensors::tensor::TensorView) -> Vec<f32> {
    view.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The HF fixture with every tensor gguf-py decoded put in place of the original.
fn dequantized_checkpoint(gguf_case: &str, hf_case: &str) -> tempfile::TempDir {
    let hf = fixtures().join("hf").join(hf_case);
    let original = std::fs::read(hf.join("model.safetensors")).unwrap();
    let decoded =
        std::fs::read(fixtures().join(format!("gguf/{gguf_case}.dequant.safetensors"))).unwrap();
    let (original, decoded) = (
        SafeTensors::deserialize(&original).unwrap(),
        SafeTensors::deserialize(&decoded).unwrap(),
    );
    let mut tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)> = BTreeMap::new();
    for (name, view) in original.tensors() {
        tensors.insert(name, (view.shape().to_vec(), f32s(&view)));
    }
    let mut replaced = 0;
    for (name, view) in decoded.tensors() {
        let entry = tensors
            .get_mut(&name)
            .unwrap_or_else(|| panic!("{name} not in the checkpoint"));
        assert_eq!(entry.0, view.shape(), "{name}");
        entry.1 = f32s(&view);
        replaced += 1;
    }
    assert!(replaced > 10, "only {replaced} tensors were quantized");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(hf.join("config.json"), dir.path().join("config.json")).unwrap();
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, (s, v))| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    dir
}

#[test]
fn gguf_files_run_like_their_dequantized_checkpoints() {
    for (gguf_case, hf_case) in CASES {
        let path = fixtures().join(format!("gguf/{gguf_case}.gguf"));
        let gguf = Model::gguf(&path, common::BUDGET).unwrap();
        let dir = dequantized_checkpoint(gguf_case, hf_case);
        let hf = Model::hf_checkpoint(dir.path(), common::BUDGET).unwrap();
        for l in 0..hf.layout.num_layers {
            assert_eq!(
                gguf.layout.mlp_kind(l),
                hf.layout.mlp_kind(l),
                "{gguf_case}: layer {l}"
            );
        }
        let mut expected = hf.layout.clone();
        expected.name = gguf.layout.name.clone();
        expected.mlp = gguf.layout.mlp.clone();
        assert_eq!(gguf.layout, expected, "{gguf_case}: layout");
        let prompt = common::prompt(hf.layout.vocab_size, 12);
        for (prefill, decode) in [
            (MlaPath::Naive, MlaPath::Absorbed),
            (MlaPath::Absorbed, MlaPath::Naive),
        ] {
            let paths = MlaPaths { prefill, decode };
            let (a, out_a) = common::record(&gguf, paths, &prompt, 10, 2);
            let (b, out_b) = common::record(&hf, paths, &prompt, 10, 2);
            assert_eq!(out_a.generated, out_b.generated, "{gguf_case}");
            // The GGUF run has one op more per layer: its quantized kv_b_proj made plain for
            // the absorbed path (through the identity matrix), which must equal the plain one.
            let extra: Vec<&str> = a
                .events
                .iter()
                .filter(|e| e.kind == OpKind::Dequantize)
                .map(|e| e.name.as_str())
                .collect();
            // (The split form is held as a plain weight: the pair is reassembled on read.)
            let quantized_kv_b = gguf.has_quantized_kv_b();
            assert_eq!(quantized_kv_b, gguf_case == "glm5-sparse-q");
            let per_layer = if quantized_kv_b { 1 } else { 0 };
            assert_eq!(extra.len(), per_layer * gguf.layout.num_layers, "{extra:?}");
            assert_eq!(a.events.len(), b.events.len() + extra.len());
            let mut worst = 0.0f64;
            for (i, e) in a.events.iter().enumerate() {
                let x = &a.outputs[i];
                let y = if e.kind == OpKind::Dequantize {
                    let l = e.layer.unwrap();
                    &*hf.weights
                        .get(&format!("model.layers.{l}.self_attn.kv_b_proj.weight"))
                        .unwrap()
                } else {
                    b.output(e.phase, &e.name)
                        .unwrap_or_else(|| panic!("{}", e.name))
                };
                let err = rel_l2_masked(x.data(), y.data());
                assert!(
                    err <= 1e-6,
                    "{gguf_case} {}: {} differs by {err:e}",
                    e.phase,
                    e.name
                );
                worst = worst.max(err);
            }
            let logits = common::output(&a, Phase::Decode(1), "logits");
            assert!(logits.data().iter().all(|v| v.is_finite()));
            println!(
                "{gguf_case} {paths:?}: {} ops, worst rel. L2 {worst:e}",
                a.events.len()
            );
        }
    }
}

/// Relative L2 over the finite values; masked (−∞) entries must sit in the same places.
fn rel_l2_masked(a: &[f32], b: &[f32]) -> f64 {
    let finite = |v: &f32| v.is_finite();
    for (x, y) in a.iter().zip(b) {
        assert!(
            finite(x) == finite(y) && (finite(x) || x == y),
            "{x} vs {y}"
        );
    }
    let (a, b): (Vec<f32>, Vec<f32>) = a.iter().zip(b).filter(|(x, _)| x.is_finite()).unzip();
    rel_l2(&a, &b)
}

/// Rewrites a fixture, leaving out or replacing one tensor.
fn rewrite(
    src: &Path,
    drop: &str,
    replace: Option<(&str, Vec<u64>)>,
) -> (tempfile::TempDir, PathBuf) {
    let file = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        if k != "general.alignment" {
            w.metadata(k.clone(), v.clone()).unwrap();
        }
    }
    for t in file.tensors() {
        if t.name == drop {
            continue;
        }
        match &replace {
            Some((name, shape)) if *name == t.name => {
                let n: u64 = shape.iter().product();
                w.tensor_f32(t.name.clone(), shape, &vec![0.5; n as usize])
                    .unwrap();
            }
            _ => {
                w.tensor(
                    t.name.clone(),
                    t.ty,
                    &t.shape(),
                    file.tensor_data(t).to_vec(),
                )
                .unwrap();
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.gguf");
    w.write(&path).unwrap();
    (dir, path)
}

#[test]
fn a_missing_or_misshapen_tensor_is_named() {
    let src = fixtures().join("gguf/glm5-sparse-q.gguf");
    let (_d, path) = rewrite(&src, "blk.1.attn_kv_b.weight", None);
    let err = Model::gguf(&path, common::BUDGET)
        .err()
        .expect("a missing tensor fails")
        .to_string();
    assert!(
        err.contains("model.layers.1.self_attn.kv_b_proj.weight"),
        "{err}"
    );

    let (_d, path) = rewrite(&src, "", Some(("blk.2.attn_output.weight", vec![64, 95])));
    let err = Model::gguf(&path, common::BUDGET)
        .err()
        .expect("a misshapen tensor fails")
        .to_string();
    assert!(err.contains("blk.2.attn_output.weight"), "{err}");
    assert!(
        err.contains("[64, 96]") && err.contains("[64, 95]"),
        "{err}"
    );

    let (_d, path) = rewrite(&src, "blk.0.ffn_norm.weight", None);
    let err = Model::gguf(&path, common::BUDGET)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("post_attention_layernorm"), "{err}");
}

#[test]
fn the_split_kv_b_form_is_reassembled() {
    // The converter stored attn_v_b as Q8_0 (attn_k_b's rows of 16 are not whole blocks, so it
    // stayed F32, as llama.cpp would keep it); the merged weight the engine reads must be W_UK
    // (transposed back) over W_UV per head.
    let file = GgufFile::open(fixtures().join("gguf/deepseek-v3-plain-split.gguf")).unwrap();
    assert_eq!(
        file.tensor("blk.0.attn_v_b.weight").unwrap().ty,
        GgmlType::Q8_0
    );
    assert!(file.tensor("blk.0.attn_kv_b.weight").is_err());
    let model = Model::gguf(file.path(), common::BUDGET).unwrap();
    let kv_b = model
        .weights
        .get("model.layers.0.self_attn.kv_b_proj.weight")
        .unwrap();
    let (k, v) = (
        file.dequantize("blk.0.attn_k_b.weight").unwrap(),
        file.dequantize("blk.0.attn_v_b.weight").unwrap(),
    );
    let (n, l, p) = (4, 32, 16);
    let vd = 24;
    for h in 0..n {
        for pi in 0..p {
            for li in 0..l {
                assert_eq!(
                    kv_b.data()[(h * (p + vd) + pi) * l + li],
                    k[(h * l + li) * p + pi]
                );
            }
        }
        for vi in 0..vd {
            for li in 0..l {
                assert_eq!(
                    kv_b.data()[(h * (p + vd) + p + vi) * l + li],
                    v[(h * vd + vi) * l + li]
                );
            }
        }
    }
}
