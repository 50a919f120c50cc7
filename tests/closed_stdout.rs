//! A closed stdout (`mladb check | head -1`) ends every command quietly with status 0, as Unix
//! tools do; any other write error is one `error:` line and exit 2.
//!
//! Each test runs the real binary with its stdout the write end of a pipe whose read end was
//! closed before the child started, so the child's first write fails with EPIPE whatever the
//! size of its output (deterministic, unlike `| head`, which may close only after the child
//! wrote everything into the pipe's buffer).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// Runs mladb with its stdout already closed by the reader.
fn with_closed_stdout(args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(args)
        .env("MLADB_AUTOSAVE", "off")
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("the mladb binary runs")
}

/// Status 0 and nothing on stderr.
#[track_caller]
fn assert_quiet_success(args: &[&str]) {
    let o = with_closed_stdout(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "mladb {args:?}: stderr: {err}");
    assert!(err.is_empty(), "mladb {args:?}: stderr: {err}");
}

const TINY_RUN: [&str; 6] = [
    "--layout",
    "glm5-tiny",
    "--tokens",
    "3,141,59",
    "--decode",
    "1",
];

fn with_tiny(command: &[&str], extra: &[&str]) -> Vec<String> {
    command
        .iter()
        .chain(TINY_RUN.iter())
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
}

#[track_caller]
fn assert_quiet(args: Vec<String>) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_quiet_success(&args);
}

#[test]
fn run() {
    assert_quiet(with_tiny(&["run"], &[]));
    assert_quiet(with_tiny(&["run"], &["--json"]));
}

/// What `mladb run | head -1` does: the reader takes one line and goes. The op table is far
/// larger than a pipe's buffer, so the child is still writing when the reader leaves.
#[test]
fn run_into_head() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(["run", "--layout", "glm5-tiny", "--decode", "4"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the mladb binary runs");
    let mut first = String::new();
    BufReader::new(child.stdout.take().expect("piped"))
        .read_line(&mut first)
        .expect("one line");
    assert!(first.starts_with("mladb run: glm5-tiny"), "{first}");
    let o = child.wait_with_output().expect("mladb ends");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "stderr: {err}");
    assert!(err.is_empty(), "stderr: {err}");
}

#[test]
fn bare_mladb_without_a_terminal() {
    assert_quiet_success(&[]);
}

#[test]
fn check() {
    assert_quiet(with_tiny(&["check"], &[]));
    assert_quiet(with_tiny(&["check"], &["--json"]));
    // With findings (exit 1 when printed): a closed stdout still ends with 0.
    assert_quiet(with_tiny(
        &["check"],
        &["--inject", "output-buffer-disconnect"],
    ));
}

#[test]
fn bisect() {
    let args = ["--a", "inject=softmax-scale-latent", "--b", ""];
    assert_quiet(with_tiny(&["bisect"], &args));
    assert_quiet(with_tiny(&["bisect"], &[&args[..], &["--json"]].concat()));
}

#[test]
fn layout() {
    let config = root().join("tests/fixtures/hf/glm5-sparse/config.json");
    assert_quiet_success(&["layout", "list"]);
    assert_quiet_success(&["layout", "show", "glm5"]);
    assert_quiet_success(&["layout", "import", &path_str(&config)]);
}

#[test]
fn gguf() {
    let file = path_str(&root().join("tests/fixtures/gguf/quant_types.gguf"));
    assert_quiet_success(&["gguf", &file]);
    assert_quiet_success(&["gguf", &file, "--stats"]);
    let dir = tempfile::tempdir().unwrap();
    let out = path_str(&dir.path().join("t.safetensors"));
    let name = "quant.Q4_K";
    assert_quiet_success(&["gguf", &file, "--tensor", name, "--dump", &out]);
    assert_quiet_success(&[
        "gguf",
        "--bench-dequant",
        "--bench-mb",
        "1",
        "--bench-reps",
        "1",
    ]);
}

#[test]
fn replay() {
    let dir = tempfile::tempdir().unwrap();
    let session = path_str(&dir.path().join("s.ron"));
    let o = Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(with_tiny(&["run"], &["--record", &session]))
        .output()
        .expect("the mladb binary runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_quiet_success(&["replay", &session, "--json"]);
    assert_quiet_success(&["replay", &session, "--bench"]);
    assert_quiet_success(&["replay", &session, "--verify"]);
    let shipped = root().join("sessions/output-buffer-disconnect.ron");
    assert_quiet_success(&["replay", &path_str(&shipped), "--json"]);
}

#[test]
fn bench() {
    assert_quiet_success(&[
        "bench",
        "--layout",
        "glm5-tiny",
        "--prompt",
        "2",
        "--decode",
        "1",
    ]);
}

#[test]
fn kernels() {
    // The first line (the NVRTC version, or that there is none) comes before any compiling.
    assert_quiet_success(&["kernels", "--arch", "sm_90"]);
}

#[test]
fn help_and_version() {
    assert_quiet_success(&["--help"]);
    assert_quiet_success(&["-h"]);
    assert_quiet_success(&["--version"]);
    assert_quiet_success(&["help", "run"]);
    assert_quiet_success(&["check", "--help"]);
}

/// Another write error (a full disk) is not a reader going away: one `error:` line, exit 2.
#[cfg(target_os = "linux")]
#[test]
fn other_write_errors_are_one_error_line() {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full on Linux");
    let run = with_tiny(&["run"], &[]);
    let layout_list = ["layout", "list"].map(String::from).to_vec();
    for args in [layout_list, run] {
        let o = Command::new(env!("CARGO_BIN_EXE_mladb"))
            .args(&args)
            .stdout(full.try_clone().unwrap())
            .output()
            .expect("the mladb binary runs");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.starts_with("error: stdout: "), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}
