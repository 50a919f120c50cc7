//! `check --reference` and `bisect --reference` never pass a comparison that compared the wrong
//! thing: a dump of other tokens or other shapes is an error, the dump's own tokens are used when
//! none are given, and ops the dump lacks are listed as not compared.

mod common;

use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use std::collections::HashMap;
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

/// Exit code 2 and one `error:` line holding every needle.
fn assert_error(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "exit code; stdout: {}", stdout(o));
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    for needle in needles {
        assert!(err.contains(needle), "expected '{needle}' in: {err}");
    }
}

/// The JSON summary line of `check --json`.
fn summary(o: &Output) -> serde_json::Value {
    let out = stdout(o);
    let last = out.lines().last().expect("a summary line");
    let v: serde_json::Value = serde_json::from_str(last).unwrap();
    assert_eq!(v["type"], "summary", "{out}");
    v
}

fn hf_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/glm5-sparse")
}

/// `mladb run --dump` of glm5-tiny with these extra arguments.
fn dump_of(path: &Path, extra: &[&str]) {
    let mut args = vec![
        "run",
        "--layout",
        "glm5-tiny",
        "--dump",
        path.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    if !extra.contains(&"--decode") {
        args.extend_from_slice(&["--decode", "0"]);
    }
    let o = mladb(&args);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Rewrites a safetensors file keeping the tensors `keep` accepts, with `metadata`.
fn rewrite(path: &Path, keep: impl Fn(&str) -> bool, metadata: Option<HashMap<String, String>>) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter(|(name, _)| keep(name))
        .collect();
    let out = safetensors::serialize(views, metadata).unwrap();
    std::fs::write(path, out).unwrap();
}

fn metadata(path: &Path) -> HashMap<String, String> {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    meta.metadata().clone().unwrap_or_default()
}

const TWELVE: &str = "1,2,3,4,5,6,7,8,9,10,11,12";

#[test]
fn a_run_of_other_tokens_than_the_dump_is_an_error_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("three.safetensors");
    let d = dump.to_str().unwrap();
    dump_of(&dump, &["--tokens", "3,141,59"]);
    let meta = metadata(&dump);
    assert_eq!(meta.get("tokens").map(String::as_str), Some("[3,141,59]"));
    assert_eq!(meta.get("prefill").map(String::as_str), Some("3"));
    assert_eq!(meta.get("decode").map(String::as_str), Some("0"));

    let twelve = [
        "--layout",
        "glm5-tiny",
        "--tokens",
        TWELVE,
        "--reference",
        d,
    ];
    assert_error(
        &mladb(&[&["check"][..], &twelve[..]].concat()),
        &["3,141,59", TWELVE],
    );
    assert_error(
        &mladb(&[&["bisect"][..], &twelve[..]].concat()),
        &["3,141,59", TWELVE],
    );
    let other_decode = [
        "check",
        "--layout",
        "glm5-tiny",
        "--decode",
        "2",
        "--reference",
        d,
    ];
    assert_error(&mladb(&other_decode), &["--decode 2", "0"]);
    let other_prefill = [
        "check",
        "--layout",
        "glm5-tiny",
        "--prefill",
        "1",
        "--reference",
        d,
    ];
    assert_error(&mladb(&other_prefill), &["--prefill 1", "3"]);

    // Without --tokens the dump's own are used, and every op is compared.
    let o = mladb(&["check", "--layout", "glm5-tiny", "--reference", d, "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    let s = summary(&o);
    assert_eq!(s["reference"]["compared"], s["ops"], "{s}");
    assert_eq!(s["reference"]["not_compared"].as_array().unwrap().len(), 0);
    let o = mladb(&["bisect", "--layout", "glm5-tiny", "--reference", d]);
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains("130 of 130 ops compared"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn a_dump_without_metadata_still_loads_but_any_shape_difference_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("old.safetensors");
    let d = dump.to_str().unwrap();
    dump_of(&dump, &["--tokens", "3,141,59"]);
    rewrite(&dump, |_| true, None);
    assert!(metadata(&dump).is_empty());

    let o = mladb(&[
        "check",
        "--layout",
        "glm5-tiny",
        "--tokens",
        TWELVE,
        "--reference",
        d,
    ]);
    assert_error(&o, &["model.embed_tokens", "[12, 256]", "[3, 256]"]);
    // The default schedule prefills 6 of its 12 tokens.
    let o = mladb(&["bisect", "--layout", "glm5-tiny", "--reference", d]);
    assert_error(&o, &["[6, 256]", "[3, 256]"]);

    let o = mladb(&[
        "check",
        "--layout",
        "glm5-tiny",
        "--tokens",
        "3,141,59",
        "--reference",
        d,
    ]);
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains("tokens could not be checked"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn ops_the_dump_lacks_are_listed_as_not_compared() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("partial.safetensors");
    let d = dump.to_str().unwrap();
    dump_of(&dump, &["--tokens", "3,141,59"]);
    let meta = metadata(&dump);
    let gone = "prefill/model.layers.1.self_attn.q_a_proj";
    rewrite(&dump, |name| name != gone, Some(meta));

    let o = mladb(&["check", "--layout", "glm5-tiny", "--reference", d, "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    let s = summary(&o);
    assert_eq!(s["reference"]["not_compared"], serde_json::json!([gone]));
    assert_eq!(
        s["reference"]["compared"].as_u64().unwrap() + 1,
        s["ops"].as_u64().unwrap()
    );
    let o = mladb(&["check", "--layout", "glm5-tiny", "--reference", d]);
    let out = stdout(&o);
    assert!(out.contains("compared 129 of 130 ops"), "{out}");
    assert!(
        out.contains("1 not compared") && out.contains(gone),
        "{out}"
    );
    let o = mladb(&[
        "bisect",
        "--layout",
        "glm5-tiny",
        "--reference",
        d,
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["not_compared"], serde_json::json!([gone]));
    assert_eq!(v["compared"], 129);
}

/// The shipped HF fixture dump, run without --tokens: the tokens, prefill and decode count come
/// from the dump and every mapped module output agrees (as tests/hf_parity.rs finds with them
/// given); a planted fault still shows.
#[test]
fn the_hf_fixture_dump_supplies_its_own_tokens() {
    let model = hf_fixture();
    let dump = model.join("hf-dump.safetensors");
    let (m, d) = (model.to_str().unwrap(), dump.to_str().unwrap());
    let meta = metadata(&dump);
    assert_eq!(meta.get("dump_format").map(String::as_str), Some("1"));
    assert_eq!(meta.get("prefill").map(String::as_str), Some("6"));
    assert_eq!(meta.get("decode").map(String::as_str), Some("3"));

    let o = mladb(&["check", "--model", m, "--reference", d, "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    let s = summary(&o);
    assert_eq!(s["findings"], 0);
    let compared = s["reference"]["compared"].as_u64().unwrap();
    assert!(compared > 500, "{s}");
    assert!(compared < s["ops"].as_u64().unwrap(), "{s}");

    let o = mladb(&["bisect", "--model", m, "--reference", d]);
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains(&format!("{compared} of ")),
        "{}",
        stdout(&o)
    );

    let o = mladb(&[
        "check",
        "--model",
        m,
        "--reference",
        d,
        "--inject",
        "rope-noninterleaved",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let first: serde_json::Value =
        serde_json::from_str(stdout(&o).lines().next().unwrap()).unwrap();
    assert_eq!(first["kind"], "reference-mismatch");
    assert_eq!(first["op"], "model.layers.0.self_attn.o_proj");
    // The indexer's RoPE in the wrong layout: every path shares the indexer, so only the
    // reference sees the keys it then chooses; without one, check says so.
    let inject = ["--inject", "indexer-rope-layout", "--json"];
    let o = mladb(&[&["check", "--model", m, "--reference", d][..], &inject].concat());
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let first: serde_json::Value =
        serde_json::from_str(stdout(&o).lines().next().unwrap()).unwrap();
    assert_eq!(first["kind"], "reference-mismatch");
    let o = mladb(&[&["check", "--model", m][..], &inject].concat());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("indexer-rope-layout: only a reference dump shows it"),
        "{}",
        stdout(&o)
    );
    assert_error(
        &mladb(&["check", "--model", m, "--tokens", "1,2,3", "--reference", d]),
        &["1,2,3", "244,20,135"],
    );
}

/// A glm5-tiny run recorded with `run_args` in `dir`, then dumped by `replay --dump`.
fn replayed_dump(dir: &Path, run_args: &[&str]) -> PathBuf {
    let session = dir.join("s.ron");
    let dump = dir.join("replayed.safetensors");
    let mut args = vec![
        "run",
        "--layout",
        "glm5-tiny",
        "--record",
        session.to_str().unwrap(),
    ];
    args.extend_from_slice(run_args);
    let o = mladb(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = mladb(&[
        "replay",
        session.to_str().unwrap(),
        "--dump",
        dump.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    dump
}

/// `replay --dump` writes the same metadata, from the session.
#[test]
fn replay_dumps_carry_the_sessions_run() {
    let dir = tempfile::tempdir().unwrap();
    let dump = replayed_dump(
        dir.path(),
        &["--tokens", "3,141,59", "--prefill", "2", "--decode", "1"],
    );
    let meta = metadata(&dump);
    for (key, want) in [
        ("dump_format", "1"),
        ("tokens", "[3,141,59]"),
        ("prefill", "2"),
        ("decode", "1"),
        ("model", "layout glm5-tiny, seed 0"),
    ] {
        assert_eq!(
            meta.get(key).map(String::as_str),
            Some(want),
            "{key}: {meta:?}"
        );
    }
    assert!(meta["producer"].starts_with("mladb "), "{meta:?}");
    assert!(meta["flags"].contains("inject none"), "{meta:?}");
}

/// A file that is not one run's `PHASE/NAME` dump is refused before its values are read, saying
/// what it is: a replayed session's `runN/PHASE/NAME` dump (before, the same "no PHASE/NAME
/// tensors" as any file, after reading it through), or a checkpoint's weights.
#[test]
fn a_file_that_is_not_a_runs_dump_is_refused_saying_what_it_holds() {
    let dir = tempfile::tempdir().unwrap();
    let replayed = replayed_dump(dir.path(), &["--decode", "1", "--record-tensors"]);
    let weights = hf_fixture().join("model.safetensors");
    let cases: [(&Path, &[&str]); 2] = [
        (
            &replayed,
            &["runN/PHASE/NAME", "first: run0/", "mladb run --dump"],
        ),
        (&weights, &["no PHASE/NAME tensors", "first: "]),
    ];
    for (file, needles) in cases {
        let file = file.to_str().unwrap();
        let o = mladb(&["check", "--layout", "glm5-tiny", "--reference", file]);
        assert_error(&o, needles);
    }
}

/// A bf16 run's dump records its dtype, so an f32 run checked against it is judged by bf16's
/// tolerances (the dump's values hold bf16's rounding: at f32's the clean pair was a finding at
/// the first op), while a dump of other weights is still a finding.
#[test]
fn a_bf16_runs_dump_judges_an_f32_run_by_bf16_tolerances() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("bf16.safetensors");
    dump_of(&dump, &["--dtype", "bf16", "--seed", "1"]);
    assert_eq!(
        metadata(&dump).get("dtype").map(String::as_str),
        Some("bf16")
    );
    let d = dump.to_str().unwrap();
    let check = |seed: &str| {
        mladb(&[
            "check",
            "--layout",
            "glm5-tiny",
            "--seed",
            seed,
            "--dtype",
            "f32",
            "--reference",
            d,
            "--json",
        ])
    };
    let same = check("1");
    assert_eq!(same.status.code(), Some(0), "{}", stdout(&same));
    assert!(summary(&same)["findings"] == 0, "{}", stdout(&same));
    let other = check("2");
    assert_eq!(other.status.code(), Some(1), "{}", stdout(&other));
    let first: serde_json::Value =
        serde_json::from_str(stdout(&other).lines().next().unwrap()).unwrap();
    assert_eq!(first["kind"], "reference-mismatch");
}

/// A dump whose tensors are stored in bf16 but whose metadata does not say so (another tool's)
/// is judged by bf16's tolerances too: its values hold bf16's rounding.
#[test]
fn a_dump_stored_in_bf16_is_judged_by_bf16_tolerances_without_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("bf16.safetensors");
    dump_of(&dump, &["--dtype", "bf16", "--seed", "1"]);
    let bytes = std::fs::read(&dump).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let as_bf16: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| {
            let halves = v
                .data()
                .chunks_exact(4)
                .flat_map(|b| {
                    let x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    half::bf16::from_f32(x).to_le_bytes()
                })
                .collect();
            (name, v.shape().to_vec(), halves)
        })
        .collect();
    let mut meta = metadata(&dump);
    meta.remove("dtype");
    let views = as_bf16.iter().map(|(name, shape, data)| {
        let view = TensorView::new(safetensors::Dtype::BF16, shape.clone(), data).unwrap();
        (name.clone(), view)
    });
    std::fs::write(&dump, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
    let d = dump.to_str().unwrap();
    let o = mladb(&[
        "check",
        "--layout",
        "glm5-tiny",
        "--seed",
        "1",
        "--dtype",
        "f32",
        "--reference",
        d,
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    // Every op compared: `compared N of N ops`.
    let out = stdout(&o);
    let counts: Vec<&str> = out
        .split("reference: compared ")
        .nth(1)
        .and_then(|rest| rest.split(" ops").next())
        .map(|c| c.split(" of ").collect())
        .unwrap_or_default();
    assert!(counts.len() == 2 && counts[0] == counts[1], "{out}");
}

/// HF's dump holds layer 0's attention output twice: as `self_attn` (the module's output) and
/// `self_attn.o_proj`, both mladb's `o_proj`. When the two disagree (as a wrapper that hands on
/// another buffer than its kernel wrote makes them), the run is compared with both and the
/// difference is found whichever of the two is wrong; the report says the dump's names differ.
/// The loader used to keep the last one read and compare nothing else.
#[test]
fn a_dump_whose_names_for_one_op_disagree_is_found_whichever_name_is_wrong() {
    let model = hf_fixture();
    let dump = model.join("hf-dump.safetensors");
    let m = model.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for key in [
        "prefill/model.layers.0.self_attn",
        "prefill/model.layers.0.self_attn.o_proj",
    ] {
        let wrong = dir.path().join("wrong.safetensors");
        common::scaled_copy(&dump, &wrong, key, 1.5);
        let o = mladb(&[
            "check",
            "--model",
            m,
            "--reference",
            wrong.to_str().unwrap(),
            "--json",
        ]);
        let out = stdout(&o);
        let head = &out[..out.len().min(1500)];
        assert_eq!(
            o.status.code(),
            Some(1),
            "{key} scaled: {head}{}",
            stderr(&o)
        );
        let first: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
        assert_eq!(first["kind"], "reference-mismatch", "{key}: {head}");
        assert_eq!(
            first["op"], "model.layers.0.self_attn.o_proj",
            "{key}: {head}"
        );
        assert_eq!(first["phase"], "prefill", "{key}: {head}");
        assert!(
            out.contains("the dump holds differing tensors under several names for 1 op ")
                && out.contains("prefill/model.layers.0.self_attn and prefill/model.layers.0.self_attn.o_proj differ"),
            "{key}: {head}"
        );
    }
}
