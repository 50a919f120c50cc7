//! Real checkpoints at real scale (issue 17): GLM-5 with its real tensor names and shapes
//! (hidden 6144, 64 heads, q_lora 2048, kv_lora 512, the 32×128 indexer, dense intermediate
//! 12288, expert intermediate 2048), written by `mladb layout export` (what
//! `tools/make_glm5_checkpoint.sh` runs) in several shards behind
//! `model.safetensors.index.json`, then loaded back with `mladb run --model`. In FP8: two
//! layers, layer 0 dense and layer 1 MoE (8 routed experts and the shared one); in bf16, whose
//! weights take twice the room, the MoE layer alone (1.05 GB on disk rather than 1.9).
//!
//! What must hold: the files are what transformers and the official FP8 checkpoints hold
//! (names, shapes, dtypes, scale shapes, index and total size); the loader reads exactly the
//! synthetic weights stored in bf16, or quantized and dequantized per 128×128 block; a run on
//! the bf16 checkpoint is bit for bit the run on bf16-rounded synthetic weights, and close to
//! the synthetic run; the FP8 run stays within FP8's error of the synthetic run; a damaged
//! checkpoint (a scale rewritten, a shard gone, a shard left out of the index) is an error.

use mladb::backend::cpu::CpuBackend;
use mladb::backend::DeviceChoice;
use mladb::engine::generate::{self, Schedule};
use mladb::engine::{Engine, Recorder};
use mladb::model::layout::MlpPlan;
use mladb::model::weights::safetensors::CheckpointWeights;
use mladb::model::weights::synthetic::SyntheticWeights;
use mladb::model::{Catalog, Layout, Model, WeightSource, WeightStore};
use mladb::ops::kv_fp8;
use mladb::setup::FlagOptions;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Instant;

const SEED: u64 = 7;
/// FP8: two layers (0 dense, 1 MoE), 8 routed experts (every one of them in a token's top 8,
/// so no routing decision hangs on rounding), 1024 vocabulary entries.
const FP8_COUNTS: &[&str] = &[
    "--layers",
    "2",
    "--first-dense",
    "1",
    "--experts",
    "8",
    "--vocab",
    "1024",
];
/// bf16: the MoE layer alone.
const BF16_COUNTS: &[&str] = &[
    "--layers",
    "1",
    "--first-dense",
    "0",
    "--experts",
    "8",
    "--vocab",
    "1024",
];
const TOKENS: &str = "3,141,59,265,358,979";
const PROMPT: [u32; 6] = [3, 141, 59, 265, 358, 979];
const DECODE: usize = 2;

/// The layout a checkpoint is of, made here from glm5's numbers (not by the export's code).
fn small_glm5(layers: usize, first_dense: usize) -> Layout {
    let mut layout = Layout::resolve("glm5").unwrap();
    layout.num_layers = layers;
    layout.mlp = MlpPlan::FirstDense(first_dense);
    layout.moe.as_mut().unwrap().n_routed_experts = 8;
    layout.vocab_size = 1024;
    layout
}

/// Held by each test that runs a real-scale model: one at a time, memory holds one model's
/// weights (a run peaks at 4.5 GB) rather than three, and on a small machine the tests take
/// its cores in turn rather than fighting over them.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static HEAVY: std::sync::Mutex<()> = std::sync::Mutex::new(());
    HEAVY.lock().unwrap_or_else(|p| p.into_inner())
}

fn mladb(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(args)
        .output()
        .expect("the mladb binary runs")
}

/// Runs mladb, which must succeed; its standard output.
fn succeed(args: &[&str]) -> String {
    let out = mladb(args);
    assert!(
        out.status.success(),
        "mladb {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs mladb, which must fail as bad input does: exit 2, one `error:` line; that line.
fn refused(args: &[&str]) -> String {
    let out = mladb(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "mladb {args:?}: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(
        lines.len() == 1 && lines[0].starts_with("error: "),
        "one error line: {stderr}"
    );
    lines[0].to_string()
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `mladb layout export --layout glm5 ... OUT` with these counts and this dtype.
fn export(out: &Path, dtype: &str, counts: &[&str], shard_mb: &str) -> String {
    let seed = SEED.to_string();
    let mut args = vec!["layout", "export", "--layout", "glm5", "--seed", &seed];
    args.extend(counts);
    args.extend(["--dtype", dtype, "--shard-mb", shard_mb, path(out)]);
    succeed(&args)
}

/// A safetensors file's header and the length of its data.
fn header(file: &Path) -> (serde_json::Map<String, Value>, u64) {
    let mut f = std::fs::File::open(file).unwrap();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).unwrap();
    let n = u64::from_le_bytes(len);
    let mut text = vec![0u8; n as usize];
    f.read_exact(&mut text).unwrap();
    let mut header: serde_json::Map<String, Value> = serde_json::from_slice(&text).unwrap();
    header.remove("__metadata__");
    (header, f.metadata().unwrap().len() - 8 - n)
}

/// The real GLM-5 shape of the tensors of each kind, written out by hand: (name after
/// `model.layers.L.`, shape), for every layer, dense layers and MoE layers (8 experts).
const ATTENTION_SHAPES: &[(&str, [usize; 2])] = &[
    ("self_attn.q_a_proj.weight", [2048, 6144]),
    ("self_attn.q_b_proj.weight", [64 * 256, 2048]),
    ("self_attn.kv_a_proj_with_mqa.weight", [576, 6144]),
    ("self_attn.kv_b_proj.weight", [64 * 448, 512]),
    ("self_attn.o_proj.weight", [6144, 64 * 256]),
    ("self_attn.indexer.wq_b.weight", [32 * 128, 2048]),
    ("self_attn.indexer.wk.weight", [128, 6144]),
    ("self_attn.indexer.weights_proj.weight", [32, 6144]),
];
const DENSE_SHAPES: &[(&str, [usize; 2])] = &[
    ("mlp.gate_proj.weight", [12288, 6144]),
    ("mlp.up_proj.weight", [12288, 6144]),
    ("mlp.down_proj.weight", [6144, 12288]),
];
const MOE_SHAPES: &[(&str, [usize; 2])] = &[
    ("mlp.gate.weight", [8, 6144]),
    ("mlp.experts.0.gate_proj.weight", [2048, 6144]),
    ("mlp.experts.7.down_proj.weight", [6144, 2048]),
    ("mlp.shared_experts.up_proj.weight", [2048, 6144]),
    ("mlp.shared_experts.down_proj.weight", [6144, 2048]),
];

/// Tensors the official FP8 checkpoints quantize: the projections of attention, the indexer's
/// wq_b and wk, the dense MLP and every expert; not the router, weights_proj or the LM head.
fn quantized_in_fp8(name: &str) -> bool {
    let projections = [
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
        "indexer.wq_b",
        "indexer.wk",
        "gate_proj",
        "up_proj",
        "down_proj",
    ];
    name.starts_with("model.layers.")
        && projections
            .iter()
            .any(|p| name.ends_with(&format!(".{p}.weight")))
}

/// Checks the directory's files: the index against the shards' headers, every tensor of the
/// layout present once with its shape and the dtype the format gives it; returns the shards.
fn check_files(dir: &Path, layout: &Layout, fp8: bool) -> usize {
    let index: Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let files: BTreeSet<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
    let n = files.len();
    assert!(n >= 3, "several shards, so the index matters: {files:?}");
    let mut stored = BTreeMap::new();
    let mut total = 0;
    for (i, file) in files.iter().enumerate() {
        assert_eq!(*file, format!("model-{:05}-of-{n:05}.safetensors", i + 1));
        let (tensors, data) = header(&dir.join(file));
        total += data;
        for (name, info) in tensors {
            assert_eq!(map[&name], *file, "{name} is where the index says");
            stored.insert(name, info);
        }
    }
    assert_eq!(index["metadata"]["total_size"], total);
    assert_eq!(
        stored.len(),
        map.len(),
        "the index lists every stored tensor once"
    );
    let catalog = Catalog::new(layout);
    let mut expected = 0;
    for (name, spec) in catalog.iter() {
        let info = &stored[name];
        let shape: Vec<usize> = serde_json::from_value(info["shape"].clone()).unwrap();
        assert_eq!(shape, spec.shape, "{name}");
        let want = if name.ends_with("e_score_correction_bias") {
            "F32"
        } else if fp8 && quantized_in_fp8(name) {
            "F8_E4M3"
        } else {
            "BF16"
        };
        assert_eq!(info["dtype"], want, "{name}");
        expected += 1;
        if want == "F8_E4M3" {
            let scales = &stored[&format!("{name}_scale_inv")];
            assert_eq!(scales["dtype"], "F32");
            let blocks = vec![shape[0].div_ceil(128), shape[1].div_ceil(128)];
            assert_eq!(scales["shape"], serde_json::json!(blocks), "{name}");
            expected += 1;
        }
    }
    assert_eq!(
        stored.len(),
        expected,
        "nothing beyond the layout's tensors"
    );
    for name in ["model.embed_tokens.weight", "lm_head.weight"] {
        assert_eq!(stored[name]["shape"], serde_json::json!([1024, 6144]));
    }
    for l in 0..layout.num_layers {
        let mlp = match layout.mlp_kind(l) {
            mladb::model::MlpKind::Dense => DENSE_SHAPES,
            mladb::model::MlpKind::Moe => MOE_SHAPES,
        };
        for (name, shape) in ATTENTION_SHAPES.iter().chain(mlp) {
            let name = format!("model.layers.{l}.{name}");
            assert_eq!(stored[&name]["shape"], serde_json::json!(shape), "{name}");
        }
    }
    let config: Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "glm_moe_dsa");
    if fp8 {
        assert_eq!(
            config["quantization_config"],
            serde_json::json!({"quant_method": "fp8", "fmt": "e4m3",
                "weight_block_size": [128, 128], "activation_scheme": "dynamic"})
        );
    } else {
        assert!(config.get("quantization_config").is_none());
    }
    // `mladb layout import` (the loader's own reading) gives back the layout.
    let ron = succeed(&["layout", "import", path(&dir.join("config.json"))]);
    let mut imported = Layout::from_ron_str(&ron, Path::new("import.ron")).unwrap();
    imported.name = "glm5".into();
    assert_eq!(imported, *layout);
    n
}

/// Logits of every step (dump name → values) and the generated tokens of one run.
#[derive(Debug)]
struct Run {
    logits: BTreeMap<String, Vec<f32>>,
    generated: Vec<u64>,
}

/// `mladb run MODEL --tokens ... --decode 2 --dtype bf16`, its logits read from `--dump`.
fn run_binary(model: &[&str], scratch: &Path) -> Run {
    let dump = scratch.join("run.safetensors");
    let _ = std::fs::remove_file(&dump);
    let decode = DECODE.to_string();
    let mut args = vec!["run"];
    args.extend(model);
    args.extend([
        "--tokens", TOKENS, "--decode", &decode, "--dtype", "bf16", "--json",
    ]);
    args.extend(["--dump", path(&dump)]);
    let stdout = succeed(&args);
    let summary: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let bytes = std::fs::read(&dump).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let logits = tensors
        .tensors()
        .into_iter()
        .filter(|(name, _)| name.ends_with("/logits"))
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, values)
        })
        .collect();
    let generated = serde_json::from_value(summary["generated"].clone()).unwrap();
    Run { logits, generated }
}

/// The synthetic weights of the same layout and seed, run by the binary: what a checkpoint's
/// run is compared with.
fn reference(layout: &Layout, scratch: &Path) -> Run {
    let ron = scratch.join("reference.ron");
    std::fs::write(&ron, layout.to_ron()).unwrap();
    let seed = SEED.to_string();
    let run = run_binary(&["--layout", path(&ron), "--seed", &seed], scratch);
    assert_eq!(run.logits.len(), 1 + DECODE, "{:?}", run.logits.keys());
    assert_eq!(run.generated.len(), DECODE);
    run
}

/// Checks that each step chose the reference's token wherever the reference's top two logits
/// are further apart than twice the step's largest difference (so the differences cannot have
/// swapped them); returns how many steps were that clear, up to the first that was not.
fn same_choices(run: &Run, reference: &Run) -> usize {
    let mut clear = 0;
    for (name, want) in &reference.logits {
        let last = |v: &[f32]| v[v.len() - 1024..].to_vec();
        let (want, got) = (last(want), last(&run.logits[name]));
        let max_diff = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let argmax = |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
        let top = argmax(&want);
        let runner_up = (0..want.len())
            .filter(|&i| i != top)
            .map(|i| want[i])
            .fold(f32::NEG_INFINITY, f32::max);
        if want[top] - runner_up <= 2.0 * max_diff {
            break;
        }
        assert_eq!(argmax(&got), top, "{name}: a clear choice changed");
        clear += 1;
    }
    clear
}

/// Synthetic weights as the bf16 checkpoint stores them: rounded to bf16, the router bias
/// kept in f32.
struct Bf16Rounded(SyntheticWeights);

impl WeightSource for Bf16Rounded {
    fn describe(&self) -> String {
        "synthetic weights rounded to bf16".into()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.0.shape(name)
    }

    fn read_rows(&self, name: &str, start_row: usize, out: &mut [f32]) -> mladb::Result<()> {
        self.0.read_rows(name, start_row, out)?;
        if !name.ends_with("e_score_correction_bias") {
            for v in out.iter_mut() {
                *v = half::bf16::from_f32(*v).to_f32();
            }
        }
        Ok(())
    }
}

/// The binary's run with bf16 storage, done in this process on `source`.
fn run_library(layout: &Layout, source: Box<dyn WeightSource>) -> Run {
    let layers = 0..layout.num_layers;
    let layout = layout.clone();
    let weights = WeightStore::new(&layout, source, 8 << 30).unwrap();
    let model = Model {
        layout,
        weights,
        rank_stores: Default::default(),
    };
    let flags = FlagOptions {
        dtype: Some("bf16".into()),
        ..FlagOptions::default()
    }
    .flags_with_env(DeviceChoice::Cpu, false)
    .unwrap();
    let options = flags.engine_options(layers, false).unwrap();
    let mut engine = Engine::new(&model, &CpuBackend, options).unwrap();
    let mut recorder = Recorder::default();
    let schedule = Schedule {
        prompt: PROMPT.to_vec(),
        prefill_len: PROMPT.len(),
        decode_steps: DECODE,
    };
    let outcome = generate::run(&mut engine, &schedule, &mut recorder).unwrap();
    let logits = recorder
        .events
        .iter()
        .zip(&recorder.outputs)
        .filter(|(e, _)| e.name == "logits")
        .map(|(e, t)| (e.dump_name(), t.data().to_vec()))
        .collect();
    Run {
        logits,
        generated: outcome.generated.iter().map(|&t| t as u64).collect(),
    }
}

/// The largest |a - b| over every step's logits, and the largest relative L2 error of a step.
fn distance(a: &Run, b: &Run) -> (f32, f64) {
    assert_eq!(
        a.logits.keys().collect::<Vec<_>>(),
        b.logits.keys().collect::<Vec<_>>()
    );
    let mut worst = (0f32, 0f64);
    for (name, x) in &a.logits {
        let y = &b.logits[name];
        assert_eq!(x.len(), y.len());
        assert!(x.iter().chain(y).all(|v| v.is_finite()), "{name}");
        let max = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0f32, f32::max);
        let rel = mladb::stats::rel_l2(x, y);
        worst = (worst.0.max(max), worst.1.max(rel));
    }
    worst
}

fn du(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

#[test]
fn bf16_glm5_at_real_shapes_runs_as_its_synthetic_weights() {
    let _heavy = one_at_a_time();
    let start = Instant::now();
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("glm5-bf16");
    let layout = small_glm5(1, 0);
    let said = export(&dir, "bf16", BF16_COUNTS, "128");
    let shards = check_files(&dir, &layout, false);
    let verified = succeed(&["layout", "verify", path(&dir)]);
    assert!(
        verified.contains("the synthetic weights of seed 7 stored as bf16"),
        "{verified}"
    );
    let ckpt = run_binary(&["--model", path(&dir)], root.path());
    // Bit for bit the run on the synthetic weights rounded as the checkpoint stores them.
    let synthetic = SyntheticWeights::new(&layout, SEED);
    let rounded = run_library(&layout, Box::new(Bf16Rounded(synthetic)));
    assert_eq!(
        ckpt.logits.keys().collect::<Vec<_>>(),
        rounded.logits.keys().collect::<Vec<_>>()
    );
    for (name, x) in &ckpt.logits {
        let y = &rounded.logits[name];
        let same = x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(same, "{name}: the checkpoint's run differs");
    }
    assert_eq!(ckpt.generated, rounded.generated);
    // Against the synthetic weights themselves (f32): logits moved only as far as rounding the
    // weights to bf16 (8 significant bits, 0.2% RMS) moves them, and the same clear choices.
    let reference = reference(&layout, root.path());
    let (max, rel) = distance(&ckpt, &reference);
    assert!(
        max > 0.0,
        "bf16 weights must change something: a vacuous comparison"
    );
    assert!(
        max < 0.1 && rel < 2e-2,
        "max |Δlogit| {max:.3e}, rel L2 {rel:.3e}"
    );
    let clear = same_choices(&ckpt, &reference);
    eprintln!(
        "bf16: {shards} shards, {:.2} GB on disk; max |Δlogit| vs f32 synthetic {max:.3e} (rel \
         L2 {rel:.3e}); {clear} of {} choices clear and kept, tokens {:?} vs {:?}; {:.1}s\n{said}",
        du(&dir) as f64 / 1e9,
        1 + DECODE,
        ckpt.generated,
        reference.generated,
        start.elapsed().as_secs_f64()
    );
}

/// The value the official recipe stores for each weight of a [rows, cols] tensor, computed
/// here with the FP8 cache's codec: per 128×128 block s = amax / 448, then e4m3(w / s) · s.
fn fp8_expected(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    for br in (0..rows).step_by(128) {
        for bc in (0..cols).step_by(128) {
            let (r1, c1) = ((br + 128).min(rows), (bc + 128).min(cols));
            let mut amax = 0f32;
            for r in br..r1 {
                for c in bc..c1 {
                    amax = amax.max(values[r * cols + c].abs());
                }
            }
            let s = amax / 448.0;
            for r in br..r1 {
                for c in bc..c1 {
                    let byte = kv_fp8::e4m3_from_f32(values[r * cols + c] / s);
                    out[r * cols + c] = kv_fp8::e4m3_to_f32(byte) * s;
                }
            }
        }
    }
    out
}

#[test]
fn fp8_glm5_at_real_shapes_loads_its_block_scaled_weights_exactly() {
    let _heavy = one_at_a_time();
    let start = Instant::now();
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("glm5-fp8");
    let layout = small_glm5(2, 1);
    let said = export(&dir, "fp8", FP8_COUNTS, "256");
    let shards = check_files(&dir, &layout, true);
    let synthetic = SyntheticWeights::new(&layout, SEED);
    let loaded = CheckpointWeights::open(&dir).unwrap();
    let read = |w: &dyn WeightSource, name: &str, start: usize, rows: usize| {
        let cols: usize = w.shape(name).unwrap()[1..].iter().product::<usize>().max(1);
        let mut out = vec![0f32; rows * cols];
        w.read_rows(name, start, &mut out).unwrap();
        out
    };
    // Whole tensors of each kind, among them kv_a_proj_with_mqa, whose 576 rows end in half a
    // block, and the indexer's wk, one block of rows.
    for name in [
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.1.self_attn.indexer.wk.weight",
        "model.layers.1.mlp.experts.7.gate_proj.weight",
        "model.layers.1.mlp.shared_experts.down_proj.weight",
    ] {
        let shape = layout_shape(&layout, name);
        let original = read(&synthetic, name, 0, shape[0]);
        let want = fp8_expected(&original, shape[0], shape[1]);
        let got = read(&loaded, name, 0, shape[0]);
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(g, w)| g.to_bits() != w.to_bits())
            .count();
        assert_eq!(
            differ, 0,
            "{name}: {differ} values differ from the FP8 recipe's"
        );
        let unchanged = got.iter().zip(&original).filter(|(g, o)| g == o).count();
        assert!(
            unchanged < got.len() / 4,
            "{name}: FP8 must round most values"
        );
    }
    // Rows read from the middle of a block: 500..576 (the last block starts at 512).
    let name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight";
    let whole = read(&loaded, name, 0, 576);
    assert_eq!(read(&loaded, name, 500, 76), whole[500 * 6144..]);
    // What stays out of FP8 is read exactly as bf16, the router bias as f32.
    for name in [
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.self_attn.indexer.weights_proj.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
        "lm_head.weight",
    ] {
        let rows = layout_shape(&layout, name)[0];
        let want: Vec<f32> = read(&synthetic, name, 0, rows)
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(read(&loaded, name, 0, rows), want, "{name}");
    }
    let bias = "model.layers.1.mlp.gate.e_score_correction_bias";
    assert_eq!(read(&loaded, bias, 0, 8), read(&synthetic, bias, 0, 8));
    drop(loaded);
    // Every tensor, through the loader, is what the export wrote.
    let verified = succeed(&["layout", "verify", path(&dir)]);
    assert!(
        verified.contains("seed 7 stored as fp8, blocks of 128×128"),
        "{verified}"
    );
    // The run: within FP8's error of the synthetic run. E4M3 keeps 4 significant bits (a
    // weight moves by up to 1/16 of itself); through the two layers the logits (spread ~1)
    // moved by 0.23 at most, 6.0% relative, when this was written (2026-12-02): the bounds
    // leave twice that. A wrong scale, a misplaced block or a misread row moves them by their
    // whole size.
    let fp8 = run_binary(&["--model", path(&dir)], root.path());
    let reference = reference(&layout, root.path());
    let (max, rel) = distance(&fp8, &reference);
    assert!(
        max > 0.0,
        "FP8 weights must change something: a vacuous comparison"
    );
    assert!(
        max < 0.5 && rel < 0.12,
        "max |Δlogit| {max:.3e}, rel L2 {rel:.3e}"
    );
    let clear = same_choices(&fp8, &reference);
    eprintln!(
        "fp8: {shards} shards, {:.2} GB on disk; max |Δlogit| vs synthetic {max:.3e} (rel L2 \
         {rel:.3e}); {clear} of {} choices clear and kept, tokens {:?} vs {:?}; {:.1}s\n{said}",
        du(&dir) as f64 / 1e9,
        1 + DECODE,
        fp8.generated,
        reference.generated,
        start.elapsed().as_secs_f64()
    );
}

fn layout_shape(layout: &Layout, name: &str) -> Vec<usize> {
    Catalog::new(layout).get(name).unwrap().shape.clone()
}

/// A copy of a checkpoint directory: hard links, except `copied`, whose bytes are new files.
fn linked_copy(src: &Path, dst: &Path, copied: &[&str]) {
    std::fs::create_dir(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let name = entry.unwrap().file_name();
        let (from, to) = (src.join(&name), dst.join(&name));
        if copied.contains(&name.to_str().unwrap()) {
            std::fs::copy(from, to).unwrap();
        } else {
            std::fs::hard_link(from, to).unwrap();
        }
    }
}

#[test]
fn a_damaged_fp8_checkpoint_is_an_error_not_a_run() {
    let _heavy = one_at_a_time();
    // One dense layer at real shapes is enough here.
    let root = tempfile::tempdir().unwrap();
    let good = root.path().join("good");
    let counts = ["--layers", "1", "--first-dense", "1", "--vocab", "256"];
    export(&good, "fp8", &counts, "128");
    let index: Value =
        serde_json::from_slice(&std::fs::read(good.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight";
    let scales = format!("{name}_scale_inv");

    // Every scale of kv_a_proj_with_mqa set to 1.0, as a loader step skipping the scales
    // leaves them: the loader has no way to know, `layout verify` names it (the tensors before
    // it in the checkpoint verified; an untouched export verifies whole in the FP8 test).
    let bad = root.path().join("scales-1");
    let file = map[&scales].as_str().unwrap();
    linked_copy(&good, &bad, &[file]);
    let (tensors, _) = header(&bad.join(file));
    let mut bytes = std::fs::read(bad.join(file)).unwrap();
    let data = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let [begin, end]: [usize; 2] =
        serde_json::from_value(tensors[&scales]["data_offsets"].clone()).unwrap();
    assert_eq!(
        end - begin,
        5 * 48 * 4,
        "5×48 blocks: the last row of blocks is half"
    );
    for chunk in bytes[data + begin..data + end].chunks_exact_mut(4) {
        chunk.copy_from_slice(&1f32.to_le_bytes());
    }
    std::fs::write(bad.join(file), bytes).unwrap();
    let e = refused(&["layout", "verify", path(&bad)]);
    assert!(
        e.contains(&format!(
            "{name} is not the synthetic weights of seed 7 stored as FP8"
        )) && e.contains(&scales)
            && e.contains("the first at [0, 0]"),
        "{e}"
    );

    // A shard gone: the index names it.
    let gone = root.path().join("shard-gone");
    linked_copy(&good, &gone, &[]);
    let files: BTreeSet<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
    assert!(files.len() >= 3, "{files:?}");
    let second = *files.iter().nth(1).unwrap();
    std::fs::remove_file(gone.join(second)).unwrap();
    let e = refused(&["run", "--model", path(&gone), "--decode", "0"]);
    assert!(
        e.contains(&format!("lists shard {second}, which does not exist")),
        "{e}"
    );

    // A shard left out of the index: its tensors are missing, by name.
    let unlisted = root.path().join("shard-unlisted");
    linked_copy(&good, &unlisted, &["model.safetensors.index.json"]);
    let mut index = index.clone();
    let weight_map = index["weight_map"].as_object_mut().unwrap();
    let left_out: Vec<String> = weight_map
        .iter()
        .filter(|(_, v)| *v == second)
        .map(|(k, _)| k.clone())
        .collect();
    weight_map.retain(|_, v| v != second);
    std::fs::write(
        unlisted.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let e = refused(&["run", "--model", path(&unlisted), "--decode", "0"]);
    assert!(
        e.contains("is missing from") && left_out.iter().any(|n| e.contains(n.as_str())),
        "{e}"
    );
    let e = refused(&["layout", "verify", path(&unlisted)]);
    assert!(e.contains("lacks"), "{e}");
}

#[test]
fn export_refuses_what_it_cannot_write_and_leaves_no_half_directory() {
    let root = tempfile::tempdir().unwrap();
    let tiny = |out: &Path| -> Vec<String> {
        let args = [
            "layout",
            "export",
            "--layout",
            "glm5-tiny",
            "--dtype",
            "fp8",
        ];
        let more = ["--shard-mb", "1", path(out)];
        args.iter().chain(&more).map(|s| s.to_string()).collect()
    };
    // A directory holding anything is left alone.
    let full = root.path().join("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("keep.txt"), b"mine").unwrap();
    let args = tiny(&full);
    let e = refused(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        e.contains("exists and is not empty: refusing to write over it"),
        "{e}"
    );
    assert_eq!(std::fs::read(full.join("keep.txt")).unwrap(), b"mine");
    assert_eq!(std::fs::read_dir(&full).unwrap().count(), 1);
    // Counts a model cannot have.
    let out_dir = root.path().join("x");
    let o = path(&out_dir);
    let e = refused(&[
        "layout",
        "export",
        "--layout",
        "glm5",
        "--experts",
        "4",
        "--dtype",
        "bf16",
        o,
    ]);
    assert!(
        e.contains("--experts 4") && e.contains("num_experts_per_tok"),
        "{e}"
    );
    let e = refused(&[
        "layout", "export", "--layout", "glm5", "--layers", "0", "--dtype", "bf16", o,
    ]);
    assert!(
        e.contains("--layers 0: must be between 1 and the 78 layers"),
        "{e}"
    );
    let e = refused(&[
        "layout",
        "export",
        "--layout",
        "glm5",
        "--layers",
        "2",
        "--first-dense",
        "3",
        "--dtype",
        "fp8",
        o,
    ]);
    assert!(e.contains("--first-dense 3"), "{e}");
    assert!(!out_dir.exists());

    // Killed while writing: no directory at the name, and the next export cleans up.
    let ckpt = root.path().join("ckpt");
    let seed = SEED.to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args([
            "layout", "export", "--layout", "glm5", "--seed", &seed, "--layers", "1",
        ])
        .args([
            "--vocab",
            "256",
            "--dtype",
            "bf16",
            "--shard-mb",
            "64",
            path(&ckpt),
        ])
        .spawn()
        .unwrap();
    let tmp = root.path().join(format!(".ckpt.mladb-tmp-{}", child.id()));
    let began = Instant::now();
    let second_shard = || {
        std::fs::read_dir(&tmp).is_ok_and(|mut d| {
            d.any(|e| {
                e.unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("model-00002-")
            })
        })
    };
    while !second_shard() {
        assert!(
            began.elapsed().as_secs() < 60,
            "the export never reached its second shard"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the export ended before it was killed"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!ckpt.exists(), "a killed export leaves nothing at its name");
    assert!(tmp.exists());
    let said = succeed(&tiny(&ckpt).iter().map(String::as_str).collect::<Vec<_>>());
    assert!(said.contains("glm5-tiny"), "{said}");
    assert!(
        !tmp.exists(),
        "the dead export's temporary directory is removed"
    );
    succeed(&["layout", "verify", path(&ckpt)]);
}
