//! The layering rules, read from the sources: backends never import the engine (op-level types
//! live in `src/ops`, below both), `src/ops` imports neither, and `unsafe` in the CUDA backend
//! stays inside `backend/cuda/device`.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out
}

/// (file, line number, line) of every non-comment line under `dir` that contains `needle`.
fn mentions(dir: &str, needle: &str) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let files = rust_files(&root);
    assert!(!files.is_empty(), "no sources under {}", root.display());
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if code.contains(needle) {
                found.push(format!("{}:{}: {}", file.display(), i + 1, line.trim()));
            }
        }
    }
    found
}

#[test]
fn backends_do_not_import_the_engine() {
    for needle in ["crate::engine", "mladb::engine", "super::super::engine"] {
        let found = mentions("src/backend", needle);
        assert!(
            found.is_empty(),
            "{needle} in the backends:\n{}",
            found.join("\n")
        );
    }
}

#[test]
fn ops_import_neither_engine_nor_backend() {
    for needle in ["crate::engine", "crate::backend", "crate::debug"] {
        let found = mentions("src/ops", needle);
        assert!(
            found.is_empty(),
            "{needle} in src/ops:\n{}",
            found.join("\n")
        );
    }
}

#[test]
fn unsafe_in_the_cuda_backend_stays_in_its_device_module() {
    let found: Vec<String> = mentions("src/backend", "unsafe")
        .into_iter()
        .filter(|l| !l.contains("src/backend/cuda/device/"))
        .filter(|l| !l.contains("unsafe_code"))
        .collect();
    assert!(
        found.is_empty(),
        "unsafe outside cuda/device:\n{}",
        found.join("\n")
    );
}

#[test]
fn no_source_file_is_over_about_600_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut long = Vec::new();
    for dir in ["src/backend", "src/ops"] {
        for file in rust_files(&root.join(dir)) {
            let lines = std::fs::read_to_string(&file).unwrap().lines().count();
            if lines > 650 {
                long.push(format!("{} ({lines} lines)", file.display()));
            }
        }
    }
    for entry in std::fs::read_dir(root.join("kernels")).unwrap() {
        let file = entry.unwrap().path();
        let lines = std::fs::read_to_string(&file).unwrap().lines().count();
        if lines > 650 {
            long.push(format!("{} ({lines} lines)", file.display()));
        }
    }
    assert!(long.is_empty(), "files to split: {}", long.join(", "));
}
