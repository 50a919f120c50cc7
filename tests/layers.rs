//! The layers point one way (model → engine → debugger → sessions → setup → service → TUI →
//! command line): a source scan fails when a module names one above it, when clap appears
//! outside `src/cli/`, or when anything under `src/tui/` mentions the command line at all.

use std::path::{Path, PathBuf};

/// The layered modules, lowest first; each may use only those before it.
const LAYERS: &[&str] = &[
    "model", "engine", "debug", "session", "setup", "service", "tui", "cli",
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
