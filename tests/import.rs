//! `mladb import` of an SGLang dumper directory (tests/fixtures/sglang-dump: transformers' own
//! tensors of the glm5-sparse checkpoint, in the files SGLang's dumper writes), then `mladb
//! check --reference` of the dump it made: clean as it is; a divergence planted in one file is
//! found at its op and step; the wrong model is never an all-clear; broken files are one clear
//! error. The hook's frame files (several ranks) are tested in tests/attach_live.rs.

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

const MODEL: &str = "tests/fixtures/hf/glm5-sparse";
const DUMP_DIR: &str = "tests/fixtures/sglang-dump";

fn mladb(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(args)
        .output()
        .unwrap()
}

/// Imports `dir`; returns the dump's path (in `out`) and import's output.
fn import(dir: &Path, out: &Path) -> (PathBuf, std::process::Output) {
    let dump = out.join("sglang.safetensors");
    let o = mladb(&[
        "import",
        dir.to_str().unwrap(),
        "--model",
        MODEL,
        "--name-map",
        "hf",
        "--out",
        dump.to_str().unwrap(),
    ]);
    (dump, o)
}

fn check(model: &str, dump: &Path) -> std::process::Output {
    mladb(&[
        "check",
        "--model",
        model,
        "--reference",
        dump.to_str().unwrap(),
    ])
}

#[test]
fn an_sglang_dumper_directory_imports_and_checks_clean() {
    let tmp = tempfile::tempdir().unwrap();
    let (dump, o) = import(Path::new(DUMP_DIR), tmp.path());
    let text = common::stdout(&o);
    assert!(o.status.success(), "{text}{}", common::stderr(&o));
    assert!(
        text.contains("(sglang, 1 rank; a prefill of 6 tokens and 2 decode steps)"),
        "{text}"
    );
    let c = check(MODEL, &dump);
    let out = common::stdout(&c);
    assert_eq!(c.status.code(), Some(0), "{out}{}", common::stderr(&c));
    assert!(out.contains("no findings"), "{out}");
    assert!(out.contains("reference: compared 205 of 363 ops"), "{out}");
}

/// A copy of the fixture directory with every value of one file's tensor times `factor` (the
/// archive rewritten, stored, as torch writes it).
fn scaled_copy(into: &Path, file_name_part: &str, factor: f32) -> PathBuf {
    let src = Path::new(DUMP_DIR).join("dump_glm5_sparse");
    let dst = into.join("dump").join("dump_glm5_sparse");
    std::fs::create_dir_all(&dst).unwrap();
    let mut scaled = 0;
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let target = dst.join(path.file_name().unwrap());
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if !name.contains(file_name_part) {
            std::fs::copy(&path, &target).unwrap();
            continue;
        }
        scaled += 1;
        let mut archive = zip::ZipArchive::new(std::fs::File::open(&path).unwrap()).unwrap();
        let mut writer = zip::ZipWriter::new(std::fs::File::create(&target).unwrap());
        let stored = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        for i in 0..archive.len() {
            let mut e = archive.by_index(i).unwrap();
            let entry_name = e.name().unwrap().to_string();
            let mut bytes = Vec::new();
            e.read_to_end(&mut bytes).unwrap();
            if entry_name.ends_with("/data/0") {
                bytes = bytes
                    .chunks_exact(4)
                    .flat_map(|c| {
                        (f32::from_le_bytes(c.try_into().unwrap()) * factor).to_le_bytes()
                    })
                    .collect();
            }
            writer.start_file(entry_name, stored).unwrap();
            writer.write_all(&bytes).unwrap();
        }
        writer.finish().unwrap();
    }
    assert_eq!(scaled, 1, "one file holds {file_name_part}");
    into.join("dump")
}

/// Layer 2's attention module returns o_proj's output, and both map to o_proj. A divergence
/// planted in either file is found at its op and step: import keeps o_proj's as the op and the
/// module's beside it when the two differ, and check compares the run with both. (Import kept
/// o_proj's alone before, and the module's output 1% off passed the check.)
#[test]
fn a_divergence_planted_in_either_module_of_one_op_is_found_at_its_op_and_step() {
    for file in [
        "step=2___rank=0___dump_index=256___name=non_intrusive__model.layers.2.self_attn.o_proj.output",
        "step=2___rank=0___dump_index=252___name=non_intrusive__model.layers.2.self_attn.output",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = scaled_copy(tmp.path(), file, 1.01);
        let (dump, o) = import(&dir, tmp.path());
        let text = common::stdout(&o);
        assert!(o.status.success(), "{text}{}", common::stderr(&o));
        assert!(
            text.contains("decode.1/model.layers.2.self_attn.o_proj: model.layers.2.self_attn and model.layers.2.self_attn.o_proj both stand for it and differ")
                && text.contains("the dump holds both"),
            "{file}: {text}"
        );
        let c = check(MODEL, &dump);
        let out = common::stdout(&c);
        assert_eq!(c.status.code(), Some(1), "{file}: {out}{}", common::stderr(&c));
        let finding = out
            .lines()
            .find(|l| l.starts_with("reference-mismatch"))
            .unwrap_or_else(|| panic!("{file}: {out}"));
        assert!(
            finding.contains("decode.1") && finding.contains("model.layers.2.self_attn.o_proj"),
            "{file}: {finding}"
        );
        assert!(
            out.contains("the dump holds differing tensors under several names for 1 op"),
            "{file}: {out}"
        );
    }
}

#[test]
fn an_import_checked_against_another_model_is_never_clean() {
    let tmp = tempfile::tempdir().unwrap();
    let (dump, o) = import(Path::new(DUMP_DIR), tmp.path());
    assert!(o.status.success());
    let c = check("tests/fixtures/hf/deepseek-v3-plain", &dump);
    let out = common::stdout(&c) + &common::stderr(&c);
    assert_ne!(c.status.code(), Some(0), "{out}");
    assert!(!out.contains("no findings"), "{out}");
}

#[test]
fn broken_recordings_are_one_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    // A dumper file that is not a zip archive.
    let dir = tmp.path().join("bad").join("exp");
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(Path::new(DUMP_DIR).join("dump_glm5_sparse")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let victim = dir.join(
        "step=0___rank=0___dump_index=5___name=non_intrusive__model.embed_tokens.output___recompute_status=disabled.pt",
    );
    assert!(victim.exists());
    std::fs::write(&victim, b"garbage").unwrap();
    let (_, o) = import(&tmp.path().join("bad"), tmp.path());
    common::assert_clean_error(&o, "not a torch.save file");
    // A frame file cut inside a frame.
    let frames = tmp.path().join("cut.frames");
    std::fs::write(&frames, [0x4d, 0x4c, 0x41, 0x57, 0, 0]).unwrap();
    let (_, o) = import(&frames, tmp.path());
    assert_eq!(o.status.code(), Some(2), "{}", common::stderr(&o));
    // No model to cut fused outputs by.
    let o = mladb(&["import", DUMP_DIR, "--out", "/tmp/never.safetensors"]);
    common::assert_clean_error(&o, "needs the engine's model");
}
