//! `mladb gguf`, run as the real binary, on the gguf-py fixture and on hostile files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn mladb(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(args)
        .output()
        .expect("the mladb binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exit code 2 and exactly one `error:` line containing every needle; never a panic.
#[track_caller]
fn assert_clean_error(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "exit code; stderr: {err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    for n in needles {
        assert!(err.contains(n), "expected '{n}' in: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/quant_types.gguf")
}

fn fixture_str() -> String {
    fixture().to_string_lossy().into_owned()
}

#[test]
fn lists_metadata_and_tensors() {
    let o = mladb(&["gguf", &fixture_str()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in [
        "GGUF v3, 14 tensors, 21 metadata entries, alignment 64",
        "general.architecture",
        "\"glm-dsa\"",
        "test.f64",
        "-2.5e300",
        "[u16; 3]",
        "[1, 2, 65535]",
        "[[1, 2], [3]]",
        // 100 tokens: the first few, then the length
        "[\"tok0\", \"tok1\", \"tok2\", \"tok3\", \"tok4\", \"tok5\", … (100 string items)]",
        "quant.Q4_K",
        "Q4_K",
        "[4, 256]",
        "576",
        // GGUF stores [64, 3, 2]; the listing is row-major
        "shape.q8_0_3d",
        "[2, 3, 64]",
        "14 tensors, 13696 values, 15272 bytes",
    ] {
        assert!(out.contains(needle), "missing {needle} in:\n{out}");
    }
    assert!(!out.contains("tok99"), "long arrays are abbreviated");
}

#[test]
fn one_tensor_and_its_stats() {
    let o = mladb(&["gguf", &fixture_str(), "--tensor", "quant.Q6_K"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("quant.Q6_K") && out.contains("840"), "{out}");
    assert!(
        !out.contains("quant.Q4_K") && !out.contains("metadata"),
        "{out}"
    );

    let o = mladb(&["gguf", &fixture_str(), "--stats"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let f16 = out.lines().find(|l| l.contains("quant.F16 ")).unwrap();
    // the fixture's F16 tensor holds +Inf, -Inf and 65504
    assert!(
        f16.contains("65504.00000") && f16.trim_end().ends_with("1/1"),
        "{f16}"
    );
    for t in ["quant.Q2_K", "quant.Q3_K", "quant.Q5_K", "shape.q8_0_3d"] {
        assert!(out.contains(t), "{t} in {out}");
    }
}

#[test]
fn dumps_a_tensor_dequantized_with_its_row_major_shape() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.safetensors");
    let o = mladb(&[
        "gguf",
        &fixture_str(),
        "--tensor",
        "shape.q8_0_3d",
        "--dump",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("shape.q8_0_3d").unwrap();
    assert_eq!(
        (t.dtype(), t.shape()),
        (safetensors::Dtype::F32, &[2usize, 3, 64][..])
    );
    let refs = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/gguf/quant_types.ref.safetensors"),
    )
    .unwrap();
    let refs = safetensors::SafeTensors::deserialize(&refs).unwrap();
    assert_eq!(t.data(), refs.tensor("shape.q8_0_3d").unwrap().data());
}

#[test]
fn errors_are_one_line_with_exit_code_2() {
    let o = mladb(&["gguf", &fixture_str(), "--tensor", "quant.q4_k"]);
    assert_clean_error(
        &o,
        &["'quant.q4_k' is missing", "did you mean 'quant.Q4_K'"],
    );

    let o = mladb(&["gguf", "/nonexistent/model.gguf"]);
    assert_clean_error(&o, &["/nonexistent/model.gguf"]);

    let dir = tempfile::tempdir().unwrap();
    let hostile = dir.path().join("hostile.gguf");
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&(1u64 << 62).to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    std::fs::write(&hostile, &b).unwrap();
    let o = mladb(&["gguf", hostile.to_str().unwrap(), "--stats"]);
    assert_clean_error(&o, &["hostile.gguf", "claims 4611686018427387904 tensors"]);

    // a valid header whose only tensor runs past the end of the file
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.push(b'w');
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&1024u64.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.resize(64 + 100, 0);
    std::fs::write(&hostile, &b).unwrap();
    let o = mladb(&["gguf", hostile.to_str().unwrap()]);
    assert_clean_error(&o, &["hostile.gguf", "tensor 'w'", "past the end"]);

    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let o = mladb(&["gguf", empty.to_str().unwrap()]);
    assert_clean_error(&o, &["empty.gguf", "truncated"]);
}

#[test]
fn bench_dequant_reports_every_type() {
    let o = mladb(&[
        "gguf",
        "--bench-dequant",
        "--bench-mb",
        "1",
        "--bench-reps",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for ty in [
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
        "Q5_K", "Q6_K",
    ] {
        assert!(
            out.lines()
                .any(|l| l.trim_start().starts_with(&format!("{ty} ")) && l.contains("GB/s")),
            "{ty} in {out}"
        );
    }
}
