//! Every public command, run as the real binary.

mod common;

use common::{assert_clean_error, stderr, stdout};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn mladb(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(args)
        .output()
        .expect("the mladb binary runs")
}

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(case)
}

#[test]
fn run_prints_the_op_trace_of_glm5_tiny() {
    let o = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--tokens",
        "3,141,59",
        "--decode",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in [
        "model.embed_tokens",
        "model.layers.0.self_attn.kv_a_proj_with_mqa",
        "model.layers.3.self_attn.q_absorbed",
        "model.layers.1.mlp.gate.topk_indices",
        "decode.1",
        "logits",
    ] {
        assert!(out.contains(needle), "missing {needle}");
    }
}

#[test]
fn bare_mladb_runs_the_default_demo() {
    let o = mladb(&[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("glm5-tiny"));
}

#[test]
fn json_output_is_one_object_per_op_then_a_summary() {
    let o = mladb(&[
        "run",
        "--layout",
        "deepseek-v3-tiny",
        "--tokens",
        "1,2,3,4",
        "--prefill",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let (summary, ops) = lines.split_last().unwrap();
    assert_eq!(summary["type"], "summary");
    assert_eq!(summary["events"].as_u64().unwrap() as usize, ops.len());
    assert!(ops.iter().all(|op| op["type"] == "op"));
    for (i, op) in ops.iter().enumerate() {
        assert_eq!(op["index"].as_u64().unwrap() as usize, i);
        assert!(op["stats"]["l2"].is_number());
        assert!(op["output"]["id"].is_number());
    }
    // Two prompt tokens prefilled, two decoded (decode.0 and decode.1).
    assert!(ops.iter().any(|op| op["phase"] == "decode.1"));
    assert_eq!(ops[0]["phase"], "prefill");
}

#[test]
fn dump_writes_phase_slash_op_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.safetensors");
    let o = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--tokens",
        "5,6,7",
        "--decode",
        "1",
        "--dump",
        path.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let logits = st.tensor("prefill/logits").unwrap();
    assert_eq!(logits.shape(), &[3, 2048]);
    assert_eq!(logits.dtype(), safetensors::Dtype::F32);
    assert_eq!(
        st.tensor("prefill/model.layers.2").unwrap().shape(),
        &[3, 256]
    );
    assert_eq!(st.tensor("decode.0/logits").unwrap().shape(), &[1, 2048]);
    assert!(st
        .tensor("decode.0/model.layers.0.self_attn.attn_latent")
        .is_ok());
}

#[test]
fn prefill_zero_feeds_the_whole_prompt_through_decode() {
    let o = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--tokens",
        "1,2,3",
        "--prefill",
        "0",
        "--json",
        "--device",
        "auto",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("using the CPU"),
        "auto says why it fell back"
    );
    let out = stdout(&o);
    assert!(!out.contains("\"phase\":\"prefill\""));
    assert!(out.contains("\"phase\":\"decode.2\""));
}

#[test]
fn layers_option_runs_a_slice_of_the_model() {
    let o = mladb(&["run", "--layout", "glm5-tiny", "--layers", "1..3", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("model.layers.1.") && out.contains("model.layers.2."));
    assert!(!out.contains("model.layers.0.") && !out.contains("model.layers.3."));
}

#[test]
fn runs_an_hf_checkpoint_directory() {
    let o = mladb(&[
        "run",
        "--model",
        fixture("glm5-sparse").to_str().unwrap(),
        "--decode",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("model.layers.3.self_attn.indexer.topk"));
}

#[test]
fn layout_commands() {
    let o = mladb(&["layout", "list"]);
    assert!(o.status.success());
    assert!(stdout(&o).contains("glm5-tiny") && stdout(&o).contains("deepseek-v3"));
    assert!(!stdout(&o).contains("DeepseekV3"), "{}", stdout(&o));
    assert!(stdout(&o).contains("DeepSeek-V3"));
    // A plain summary by default, in the README's words, with no Rust names in it.
    let o = mladb(&["layout", "show", "deepseek-v3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    for want in [
        "deepseek-v3: DeepSeek-V3 (HF model_type deepseek_v3)",
        "61 layers · hidden 7168",
        "MLA, 128 heads · latent (kv_lora_rank) 512 · per head qk 192 (128 + 64 rope), v 128",
        "dense (width 18432) in layers 0-2, MoE in 3-60",
        "256 routed experts, 8 per token, 8 groups of which 4 may be chosen, 1 shared",
        "indexer    none (dense attention)",
        "YaRN: factor 40 over 4096 original positions, beta fast 32 / slow 1, mscale 1",
        "RMSNorm eps 1e-6",
    ] {
        assert!(text.contains(want), "{want:?} in\n{text}");
    }
    let text = stdout(&mladb(&["layout", "show", "glm5"]));
    assert!(text.contains("keeps the top 2048 keys"), "{text}");
    assert!(
        text.contains("theta 1000000 · interleaved · no scaling"),
        "{text}"
    );
    for debug in ["r#None", "Glm5", "FirstDense", "Some("] {
        assert!(!text.contains(debug), "{debug} in\n{text}");
    }
    let config = fixture("deepseek-v3-yarn").join("config.json");
    let o = mladb(&["layout", "import", config.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("Yarn"));
}

#[test]
fn layout_show_ron_loads_back_as_the_same_layout() {
    let dir = tempfile::tempdir().unwrap();
    for name in mladb::model::Layout::builtin_names() {
        let o = mladb(&["layout", "show", name, "--ron"]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(stdout(&o).contains("kv_lora_rank:"), "{}", stdout(&o));
        let file = dir.path().join(format!("{name}.ron"));
        std::fs::write(&file, stdout(&o)).unwrap();
        assert_eq!(
            mladb::model::Layout::resolve(file.to_str().unwrap()).unwrap(),
            mladb::model::Layout::resolve(name).unwrap(),
            "{name}"
        );
        // The file and the name describe one layout.
        let plain = |l: &str| stdout(&mladb(&["layout", "show", l]));
        assert_eq!(plain(file.to_str().unwrap()), plain(name));
    }
    // And runs through --layout FILE.
    let file = dir.path().join("glm5-tiny.ron");
    let o = mladb(&["run", "--layout", file.to_str().unwrap(), "--decode", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn check_names_the_flags_in_the_readme_words() {
    let o = mladb(&["check", "--layout", "glm5-tiny", "--decode", "2"]);
    let text = stdout(&o);
    assert!(
        text.contains("flags: mla-disable off · prefill naive · decode absorbed · force-dequant off · cpu · f32 · inject none"),
        "{text}"
    );
    let o = mladb(&[
        "check",
        "--layout",
        "glm5-tiny",
        "--decode",
        "2",
        "--mla-disable",
    ]);
    assert!(
        stdout(&o).contains("prefill naive · decode naive"),
        "{}",
        stdout(&o)
    );
    for debug in ["Naive", "Absorbed", "Cpu", "F32"] {
        assert!(!text.contains(debug), "{debug} in\n{text}");
    }
}

/// `--inject`'s help names every fault of the catalogue, so a fault added to the engine cannot
/// stay unknown to the user reading `--help` (nine of nineteen were, until 2026-12-07).
#[test]
fn inject_help_names_every_fault() {
    for command in ["run", "check"] {
        let o = mladb(&[command, "--help"]);
        // The help may wrap its lines (on a terminal); join them before looking names up.
        let text: String = stdout(&o)
            .lines()
            .map(str::trim)
            .collect::<Vec<_>>()
            .join(" ");
        for fault in mladb::engine::Fault::ALL {
            assert!(
                text.contains(fault.name()),
                "`mladb {command} --help` does not name {}",
                fault.name()
            );
        }
    }
}

/// `tools/noise_sweep.py --faults` plants every fault of the catalogue (the fast kernels' with
/// `--device cuda`), so a new fault cannot be left out of the sweep unseen.
#[test]
fn the_noise_sweep_names_every_fault() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/noise_sweep.py");
    let text = std::fs::read_to_string(&path).expect("tools/noise_sweep.py");
    for fault in mladb::engine::Fault::ALL {
        assert!(
            text.contains(&format!("\"{}\"", fault.name())),
            "tools/noise_sweep.py does not name {}",
            fault.name()
        );
    }
}

/// `mladb kernels` where NVRTC cannot be loaded: the header, then one `error:` line and exit 2
/// (it used to print FAILED and the same reason for every file, and exit 1).
#[test]
fn kernels_without_nvrtc_is_one_error_line() {
    let o = Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(["kernels", "--arch", "sm_90,sm_120"])
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("the mladb binary runs");
    if !stdout(&o).contains("NVRTC not found") {
        eprintln!("skipped: NVRTC loads on this machine without LD_LIBRARY_PATH, so its absence cannot be tried");
        return;
    }
    assert_clean_error(&o, "NVRTC (libnvrtc.so) is not on the library path");
    assert!(!stdout(&o).contains("FAILED"), "{}", stdout(&o));
}

#[test]
fn bad_input_is_one_error_line_and_exit_2() {
    assert_clean_error(
        &mladb(&["run", "--layout", "glm6"]),
        "unknown layout 'glm6'",
    );
    assert_clean_error(
        &mladb(&["run", "--layout", "glm5-tiny", "--tokens", "3,99999"]),
        "token id 99999",
    );
    assert_clean_error(
        &mladb(&["run", "--layout", "glm5-tiny", "--tokens", "3,x"]),
        "'x' is not a token id",
    );
    assert_clean_error(
        &mladb(&["run", "--layout", "glm5-tiny", "--layers", "3..9"]),
        "--layers 3..9",
    );
    // The attention kernel flags (meaningful on the GPU, checked everywhere).
    assert_clean_error(
        &mladb(&["run", "--attn-kernel", "slow"]),
        "--attn-kernel: attn-kernel 'slow' is not fast or reference",
    );
    assert_clean_error(
        &mladb(&["run", "--decode-variant", "t8"]),
        "decode variant 't8' is not one of wgmma, kt3, ks3, ks2, kt16, t32, t16",
    );
    assert_clean_error(
        &mladb(&["check", "--prefill-variant", "r32"]),
        "prefill variant 'r32' is not one of",
    );
    // Flags that clap itself checks are one line too (its usage and hint lines left out): the
    // bench's forced split count is bounded as the decode's scratch is (1 to 256).
    for bad in ["0", "257"] {
        assert_clean_error(&mladb(&["bench", "--decode-splits", bad]), "1..=256");
    }
    assert_clean_error(&mladb(&["bench", "--prompt", "x"]), "--prompt");
    // The kernel-grid flags on the CPU (the default device) are refused, not ignored.
    for flags in [
        &["--decode-heads", "16"][..],
        &["--quick"],
        &["--decode-shapes", "1:1024"],
        &["--decode-splits", "4"],
        &["--no-layers"],
    ] {
        let o = mladb(&[&["bench"][..], flags].concat());
        assert_clean_error(&o, flags[0]);
        assert!(stderr(&o).contains("needs --device cuda"), "{}", stderr(&o));
    }
    // The attach benches read few flags: the rest are refused beside them, not ignored (the
    // GPU grid's flags used to pass silently with --attach-verdict).
    for mode in ["--attach-verdict", "--attach-ingest"] {
        let o = mladb(&["bench", mode, "--device", "cuda"]);
        assert_clean_error(&o, "measures on the CPU: it takes no --device cuda");
    }
    for (mode, flags) in [
        ("--attach-verdict", &["--quick"][..]),
        ("--attach-verdict", &["--decode-heads", "16"]),
        ("--attach-verdict", &["--tp", "2"]),
        ("--attach-ingest", &["--layout", "glm5-tiny"]),
        ("--attach-ingest", &["--decode-shapes", "1:1024"]),
        ("--attach-ingest", &["--attach-verdict"]),
    ] {
        let o = mladb(&[&["bench", mode][..], flags].concat());
        assert_clean_error(&o, flags[0]);
        assert!(stderr(&o).contains("cannot be used with"), "{}", stderr(&o));
    }
    assert_clean_error(&mladb(&["run", "--no-such-flag"]), "--no-such-flag");
    assert_clean_error(&mladb(&["no-such-command"]), "no-such-command");
    // Help is not an error: it goes to stdout with exit 0.
    let help = mladb(&["bench", "--help"]);
    assert_eq!(help.status.code(), Some(0));
    assert!(stdout(&help).contains("--decode-splits"));
    if mladb::backend::cuda::probe().is_err() {
        assert_clean_error(&mladb(&["run", "--device", "cuda"]), "--device cuda: ");
    }
    assert_clean_error(
        &mladb(&["run", "--model", "/nonexistent/dir"]),
        "/nonexistent/dir",
    );

    let dir = tempfile::tempdir().unwrap();
    let ron = dir.path().join("broken.ron");
    std::fs::write(&ron, "(name: \"x\", family: Glm5, vocab_size: 12,,)").unwrap();
    assert_clean_error(
        &mladb(&["run", "--layout", ron.to_str().unwrap()]),
        "broken.ron: line 1",
    );
    let huge = dir.path().join("huge.ron");
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("layouts/glm5-tiny.ron"),
    )
    .unwrap()
    .replace("vocab_size: 2048", "vocab_size: 1000000000000");
    std::fs::write(&huge, text).unwrap();
    assert_clean_error(
        &mladb(&["run", "--layout", huge.to_str().unwrap()]),
        "vocab_size",
    );

    // A checkpoint with a malformed config, an unknown model type, and a truncated shard.
    let src = fixture("deepseek-v3-plain");
    let ckpt = dir.path().join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), ckpt.join(f)).unwrap();
    }
    let ckpt_arg = ckpt.to_str().unwrap();
    let weights = std::fs::read(ckpt.join("model.safetensors")).unwrap();
    std::fs::write(
        ckpt.join("model.safetensors"),
        &weights[..weights.len() - 100],
    )
    .unwrap();
    assert_clean_error(
        &mladb(&["run", "--model", ckpt_arg]),
        "model.safetensors: not a valid safetensors file",
    );
    std::fs::write(ckpt.join("model.safetensors"), &weights).unwrap();
    let config = std::fs::read_to_string(ckpt.join("config.json")).unwrap();
    std::fs::write(ckpt.join("config.json"), &config[..config.len() / 2]).unwrap();
    assert_clean_error(
        &mladb(&["run", "--model", ckpt_arg]),
        "config.json: not valid JSON",
    );
    std::fs::write(
        ckpt.join("config.json"),
        config.replace("deepseek_v3", "llama"),
    )
    .unwrap();
    assert_clean_error(
        &mladb(&["run", "--model", ckpt_arg]),
        "unsupported model_type 'llama'",
    );
    // A shard without one tensor, and a directory without any shard.
    std::fs::write(ckpt.join("config.json"), &config).unwrap();
    let st = safetensors::SafeTensors::deserialize(&weights).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != "model.layers.1.self_attn.kv_b_proj.weight")
        .collect();
    std::fs::write(
        ckpt.join("model.safetensors"),
        safetensors::serialize(kept, None).unwrap(),
    )
    .unwrap();
    assert_clean_error(
        &mladb(&["run", "--model", ckpt_arg]),
        "tensor model.layers.1.self_attn.kv_b_proj.weight is missing",
    );
    std::fs::remove_file(ckpt.join("model.safetensors")).unwrap();
    assert_clean_error(
        &mladb(&["run", "--model", ckpt_arg]),
        "no *.safetensors files",
    );
    std::fs::write(ckpt.join("model.safetensors"), &weights).unwrap();
    // A config that disagrees with the weights names the tensor and both shapes.
    let mut v: serde_json::Value = serde_json::from_str(&config).unwrap();
    v["kv_lora_rank"] = serde_json::json!(16);
    std::fs::write(ckpt.join("config.json"), v.to_string()).unwrap();
    assert_clean_error(&mladb(&["run", "--model", ckpt_arg]), "expected shape");
}

#[test]
fn check_exits_0_clean_1_with_findings_and_prints_json_findings() {
    let clean = mladb(&[
        "check",
        "--layout",
        "glm5-tiny",
        "--prefill",
        "9",
        "--decode",
        "2",
    ]);
    assert_eq!(
        clean.status.code(),
        Some(0),
        "{}{}",
        stdout(&clean),
        stderr(&clean)
    );
    assert!(stdout(&clean).contains("no findings"));
    let bad = mladb(&[
        "check",
        "--layout",
        "glm5-tiny",
        "--prefill",
        "9",
        "--decode",
        "2",
        "--inject",
        "output-buffer-disconnect",
        "--json",
    ]);
    assert_eq!(bad.status.code(), Some(1), "{}", stderr(&bad));
    let lines: Vec<serde_json::Value> = stdout(&bad)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let (summary, findings) = lines.split_last().unwrap();
    assert_eq!(summary["type"], "summary");
    let kinds: Vec<&str> = findings
        .iter()
        .map(|f| f["kind"].as_str().unwrap())
        .collect();
    assert!(
        kinds.contains(&"buffer-disconnect") && kinds.contains(&"unwritten"),
        "{kinds:?}"
    );
    for f in findings {
        for key in ["kind", "op", "phase", "detail"] {
            assert!(f[key].is_string(), "{key} in {f}");
        }
    }
    let disconnect = findings
        .iter()
        .find(|f| f["kind"] == "buffer-disconnect")
        .unwrap();
    assert_eq!(disconnect["op"], "model.layers.0.self_attn.attn_output");
    assert_eq!(disconnect["phase"], "prefill");
    // MLA disabled routes around the broken backend: the same fault finds nothing.
    let routed = mladb(&[
        "check",
        "--layout",
        "glm5-tiny",
        "--prefill",
        "9",
        "--decode",
        "2",
        "--inject",
        "output-buffer-disconnect",
        "--mla-disable",
    ]);
    assert_eq!(routed.status.code(), Some(0), "{}", stdout(&routed));
}

#[test]
fn check_against_a_reference_dump_from_run() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("clean.safetensors");
    let dump_arg = dump.to_str().unwrap();
    let o = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--prefill",
        "9",
        "--decode",
        "2",
        "--dump",
        dump_arg,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let same = mladb(&[
        "check",
        "--layout",
        "glm5-tiny",
        "--prefill",
        "9",
        "--decode",
        "2",
        "--reference",
        dump_arg,
    ]);
    assert_eq!(same.status.code(), Some(0), "{}", stdout(&same));
    let rope = mladb(&[
        "check",
        "--layout",
        "glm5-tiny",
        "--prefill",
        "9",
        "--decode",
        "2",
        "--reference",
        dump_arg,
        "--inject",
        "rope-noninterleaved",
        "--json",
    ]);
    assert_eq!(rope.status.code(), Some(1));
    let first: serde_json::Value =
        serde_json::from_str(stdout(&rope).lines().next().unwrap()).unwrap();
    assert_eq!(first["kind"], "reference-mismatch");
    assert_eq!(first["op"], "model.layers.0.self_attn.q_rope");
    assert_clean_error(
        &mladb(&[
            "check",
            "--layout",
            "glm5-tiny",
            "--reference",
            "/nonexistent.safetensors",
        ]),
        "/nonexistent.safetensors",
    );
    assert_clean_error(
        &mladb(&["check", "--layout", "glm5-tiny", "--inject", "gremlins"]),
        "unknown injection 'gremlins'",
    );
}

/// An f32 run against a bf16 one differs by bf16's rounding at every op: judged by bf16's
/// tolerances, whichever side is bf16, it is no divergence; a fault planted on the bf16 side
/// still is. (The f32 table was used before, and the embedding was "first divergent".)
#[test]
fn bisect_across_dtypes_is_judged_by_the_bf16_tolerances() {
    let bisect = |a: &str, b: &str| {
        mladb(&[
            "bisect",
            "--layout",
            "glm5-tiny",
            "--decode",
            "2",
            "--a",
            a,
            "--b",
            b,
        ])
    };
    for (a, b) in [("", "dtype=bf16"), ("dtype=bf16", "")] {
        let o = bisect(a, b);
        assert_eq!(
            o.status.code(),
            Some(0),
            "--a '{a}' --b '{b}': {}",
            stdout(&o)
        );
        assert!(stdout(&o).contains("(bf16 table)"), "{}", stdout(&o));
    }
    let o = bisect("", "dtype=bf16,inject=softmax-scale-latent");
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("first divergent:") && stdout(&o).contains("self_attn.attn_probs"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn bisect_names_the_first_divergent_op() {
    let o = mladb(&[
        "bisect",
        "--layout",
        "glm5-tiny",
        "--prefill",
        "9",
        "--decode",
        "2",
        "--a",
        "inject=softmax-scale-latent",
        "--b",
        "",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["first"]["name"], "model.layers.0.self_attn.attn_probs");
    assert_eq!(v["first"]["phase"], "decode.0");
    assert!(v["first"]["diff"]["Ok"]["rel_l2"].as_f64().unwrap() > 1e-3);
    let same = mladb(&[
        "bisect",
        "--layout",
        "glm5-tiny",
        "--decode",
        "1",
        "--a",
        "",
        "--b",
        "decode-path=naive",
    ]);
    assert_eq!(
        same.status.code(),
        Some(0),
        "absorbed and naive agree: {}",
        stdout(&same)
    );
    assert_clean_error(
        &mladb(&[
            "bisect",
            "--layout",
            "glm5-tiny",
            "--a",
            "dtype=f64",
            "--b",
            "",
        ]),
        "--a",
    );
}

/// `bench --op-times` on the CPU: every op of a decode step by name (the layer's prefix taken
/// off), the host's time between passes (sampling the last token) in a row of its own instead
/// of charged to the embedding, and no driver columns where there is no device.
#[test]
fn bench_op_times_charges_the_time_between_passes_to_no_op() {
    let o = mladb(&[
        "bench",
        "--layout",
        "glm5-tiny",
        "--prompt",
        "4",
        "--decode",
        "2",
        "--op-times",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let decode = out
        .split("ops of a decode step")
        .nth(1)
        .unwrap_or_else(|| panic!("no decode table:\n{out}"));
    for needle in [
        "(between passes: sampling, set-up)",
        "model.embed_tokens",
        "self_attn.q_a_proj",
        "host ms",
    ] {
        assert!(decode.contains(needle), "{needle} missing:\n{decode}");
    }
    assert!(!out.contains("driver calls"), "{out}");
    assert!(
        decode.lines().any(|l| l.starts_with("self_attn.q_a_proj ")),
        "the layer's prefix kept:\n{decode}"
    );
}
