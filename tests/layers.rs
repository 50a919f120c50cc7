//! The layers point one way (model → ops → backends → engine → debugger → sessions → setup →
//! service → TUI → command line): a source scan fails when a module names one above it, when
//! clap appears outside `src/cli/`, or when anything under `src/tui/` mentions the command line
//! at all. And the rules inside the lower layers: backends never import the engine (op-level
//! types live in `src/ops`, below both), `src/ops` imports neither, and `unsafe` in the CUDA
//! backend stays inside `backend/cuda/device`.

use std::path::{Path, PathBuf};

/// The layered modules, lowest first; each may use only those before it.
const LAYERS: &[&str] = &[
    "model", "ops", "backend", "engine", "debug", "session", "setup", "service", "tui", "cli",
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The files of a top-level module: `src/NAME.rs` and everything under `src/NAME/`.
fn files_of(module: &str) -> Vec<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    let file = src.join(format!("{module}.rs"));
    if file.exists() {
        files.push(file);
    }
    let dir = src.join(module);
    if dir.is_dir() {
        sources(&dir, &mut files);
    }
    assert!(!files.is_empty(), "no sources for {module}");
    files
}

/// The lines of code, comments left out (they may name what a module stays away from).
fn code(path: &Path) -> Vec<(usize, String)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
        .map(|(i, l)| (i + 1, l.to_string()))
        .collect()
}

#[test]
fn no_module_uses_one_above_it() {
    let mut wrong = Vec::new();
    for (rank, module) in LAYERS.iter().enumerate() {
        for path in files_of(module) {
            for (n, line) in code(&path) {
                for above in &LAYERS[rank + 1..] {
                    if line.contains(&format!("crate::{above}::"))
                        || line.contains(&format!("crate::{above};"))
                        || line.contains(&format!("crate::{above} "))
                    {
                        wrong.push(format!("{}:{n}: {module} uses {above}", path.display()));
                    }
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn clap_stays_in_the_command_line() {
    let mut wrong = Vec::new();
    for module in &LAYERS[..LAYERS.len() - 1] {
        for path in files_of(module) {
            for (n, line) in code(&path) {
                if line.contains("clap") || line.contains("#[arg(") || line.contains("#[command(") {
                    wrong.push(format!("{}:{n}: {line}", path.display()));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_tui_never_mentions_the_command_line() {
    for path in files_of("tui") {
        let text = std::fs::read_to_string(&path).unwrap();
        for needle in ["crate::cli", "clap"] {
            assert!(
                !text.contains(needle),
                "{} mentions {needle}",
                path.display()
            );
        }
    }
}

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
    for file in rust_files(&root.join("src")) {
        let lines = std::fs::read_to_string(&file).unwrap().lines().count();
        if lines > 650 {
            long.push(format!("{} ({lines} lines)", file.display()));
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
