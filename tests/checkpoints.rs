//! HF checkpoint directories in their other shapes: sharded with an index, routed experts stacked
//! (transformers 5's in-memory format), and f16/bf16 storage. Each is made here from a committed
//! fixture and must give what the original gives.

mod common;

use mladb::backend::cpu::CpuBackend;
use mladb::engine::{Engine, EngineOptions, MlaPaths, NullObserver};
use mladb::model::Model;
use mladb::stats::rel_l2;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::Path;

type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;
/// Per layer prefix, per expert: the bytes of gate, up and down.
type ExpertBytes = BTreeMap<String, BTreeMap<usize, [Option<Vec<u8>>; 3]>>;

fn read_fixture(case: &str) -> (std::path::PathBuf, Tensors) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(case);
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    (dir, tensors)
}

fn write(path: &Path, tensors: &Tensors) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn logits(dir: &Path) -> Vec<f32> {
    let model = Model::hf_checkpoint(dir, common::BUDGET).unwrap();
    let mut engine = Engine::new(
        &model,
        &CpuBackend,
        EngineOptions::all_layers(&model, MlaPaths::production()),
    )
    .unwrap();
    engine
        .prefill(&[3, 14, 15, 92, 65, 35, 89, 79], &mut NullObserver)
        .unwrap()
        .into_data()
}

fn new_checkpoint(src: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    dir
}

#[test]
fn sharded_checkpoint_with_index_loads_the_same_model() {
    let (src, tensors) = read_fixture("glm5-sparse");
    let dir = new_checkpoint(&src);
    let (mut a, mut b) = (Tensors::new(), Tensors::new());
    let mut map = serde_json::Map::new();
    for (i, (name, t)) in tensors.into_iter().enumerate() {
        let shard = if i % 2 == 0 {
            "model-00001-of-00002.safetensors"
        } else {
            "model-00002-of-00002.safetensors"
        };
        map.insert(name.clone(), serde_json::json!(shard));
        if i % 2 == 0 {
            a.insert(name, t)
        } else {
            b.insert(name, t)
        };
    }
    write(&dir.path().join("model-00001-of-00002.safetensors"), &a);
    write(&dir.path().join("model-00002-of-00002.safetensors"), &b);
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    assert_eq!(logits(dir.path()), logits(&src));
}

#[test]
fn stacked_experts_load_the_same_model() {
    let (src, tensors) = read_fixture("glm5-sparse");
    let dir = new_checkpoint(&src);
    let mut out = Tensors::new();
    let mut stacks = ExpertBytes::new();
    let mut dims = BTreeMap::new();
    for (name, (d, shape, bytes)) in tensors {
        if let Some((prefix, rest)) = name.split_once(".mlp.experts.") {
            let (e, proj) = rest.split_once('.').unwrap();
            let slot = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
                .iter()
                .position(|p| *p == proj)
                .unwrap();
            stacks
                .entry(prefix.to_string())
                .or_default()
                .entry(e.parse().unwrap())
                .or_default()[slot] = Some(bytes);
            dims.insert((prefix.to_string(), slot), shape);
            assert_eq!(d, Dtype::F32);
        } else {
            out.insert(name, (d, shape, bytes));
        }
    }
    for (prefix, experts) in stacks {
        let n = experts.len();
        let (gate, down) = (&dims[&(prefix.clone(), 0)], &dims[&(prefix.clone(), 2)]);
        let mut gate_up = Vec::new();
        let mut downs = Vec::new();
        for (_, [g, u, d]) in experts {
            gate_up.extend(g.unwrap());
            gate_up.extend(u.unwrap());
            downs.extend(d.unwrap());
        }
        out.insert(
            format!("{prefix}.mlp.experts.gate_up_proj"),
            (Dtype::F32, vec![n, 2 * gate[0], gate[1]], gate_up),
        );
        out.insert(
            format!("{prefix}.mlp.experts.down_proj"),
            (Dtype::F32, vec![n, down[0], down[1]], downs),
        );
    }
    write(&dir.path().join("model.safetensors"), &out);
    assert_eq!(logits(dir.path()), logits(&src));
}

#[test]
fn f16_and_bf16_checkpoints_load_within_their_precision() {
    let (src, tensors) = read_fixture("deepseek-v3-yarn");
    let reference = logits(&src);
    for (dtype, tolerance) in [(Dtype::F16, 5e-3), (Dtype::BF16, 3e-2)] {
        let dir = new_checkpoint(&src);
        let converted: Tensors = tensors
            .iter()
            .map(|(n, (_, s, b))| {
                let bytes = b
                    .chunks_exact(4)
                    .flat_map(|c| {
                        let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                        match dtype {
                            Dtype::F16 => half::f16::from_f32(v).to_le_bytes(),
                            _ => half::bf16::from_f32(v).to_le_bytes(),
                        }
                    })
                    .collect();
                (n.clone(), (dtype, s.clone(), bytes))
            })
            .collect();
        write(&dir.path().join("model.safetensors"), &converted);
        let err = rel_l2(&logits(dir.path()), &reference);
        assert!(err > 0.0 && err < tolerance, "{dtype:?}: rel err {err:.3e}");
    }
}
