//! Hostile inputs (issue 13): special files, oversized and mismatched files, output targets that
//! are not regular files, prompts too long for memory. Each case must end with one `error:` line
//! and exit code 2 within seconds, or run; never a panic, a hang or an unbounded allocation, and
//! never damage a file mladb did not create.

mod common;

use common::{assert_clean_error, stderr};

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The binary with `args`, killed after `secs` (a hang is a failure, not a stuck test), its
/// address space capped at `mem_gib` so a runaway allocation fails instead of eating the machine.
fn mladb_bounded(args: &[&str], secs: u64, mem_gib: u64) -> Output {
    let limit = mem_gib << 30;
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!("ulimit -v {} && exec \"$0\" \"$@\"", limit >> 10))
        .arg(env!("CARGO_BIN_EXE_mladb"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("the mladb binary runs");
    // Drained as it runs, so a long output cannot fill the pipe and stall the child.
    let drain = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Output {
                status,
                stdout: out.join().unwrap(),
                stderr: err.join().unwrap(),
            };
        }
        if start.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "mladb {args:?} still running after {secs} s; stderr: {}",
                String::from_utf8_lossy(&err.join().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn mladb(args: &[&str]) -> Output {
    mladb_bounded(args, 20, 4)
}

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(case)
}

/// Makes a FIFO at `path`; false (and says so) where mkfifo is absent.
fn mkfifo(path: &Path) -> bool {
    match Command::new("mkfifo").arg(path).status() {
        Ok(s) if s.success() => true,
        _ => {
            eprintln!("FIFO case skipped: mkfifo is not available");
            false
        }
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A copy of the glm5-sparse checkpoint's config.json (and weights, linked) in a fresh folder.
fn checkpoint_copy(dir: &Path) -> PathBuf {
    let model = dir.join("model");
    std::fs::create_dir(&model).unwrap();
    let src = fixture("glm5-sparse");
    std::fs::copy(src.join("config.json"), model.join("config.json")).unwrap();
    std::os::unix::fs::symlink(
        src.join("model.safetensors"),
        model.join("model.safetensors"),
    )
    .unwrap();
    model
}

#[test]
fn short_mlp_layer_types_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let model = checkpoint_copy(dir.path());
    let config = model.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    c["mlp_layer_types"] = serde_json::json!(["dense"]);
    std::fs::write(&config, c.to_string()).unwrap();
    assert_clean_error(&mladb(&["layout", "import", s(&config)]), "mlp_layer_types");
    assert_clean_error(
        &mladb(&["run", "--model", s(&model), "--decode", "0"]),
        "mlp_layer_types",
    );
}

#[test]
fn special_files_are_refused_before_they_are_read() {
    // Devices: /dev/zero would never end.
    assert_clean_error(
        &mladb(&["layout", "import", "/dev/zero"]),
        "not a regular file",
    );
    assert_clean_error(
        &mladb(&["run", "--layout", "/dev/zero", "--decode", "0"]),
        "not a regular file",
    );
    let dir = tempfile::tempdir().unwrap();
    // A shard that is a device.
    let model = checkpoint_copy(dir.path());
    std::fs::remove_file(model.join("model.safetensors")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", model.join("model.safetensors")).unwrap();
    assert_clean_error(
        &mladb(&["run", "--model", s(&model), "--decode", "0"]),
        "not a regular file",
    );
    // FIFOs would block forever on open.
    let fifo = dir.path().join("layout.ron");
    if !mkfifo(&fifo) {
        return;
    }
    assert_clean_error(
        &mladb(&["layout", "import", s(&fifo)]),
        "not a regular file",
    );
    assert_clean_error(
        &mladb(&["run", "--layout", s(&fifo), "--decode", "0"]),
        "not a regular file",
    );
    let model2 = dir.path().join("fifo-model");
    std::fs::create_dir(&model2).unwrap();
    assert!(mkfifo(&model2.join("config.json")));
    assert_clean_error(
        &mladb(&["run", "--model", s(&model2), "--decode", "0"]),
        "not a regular file",
    );
    // An index that is a FIFO.
    let model3 = checkpoint_copy(&dir.path().join("m3").tap_mkdir());
    std::fs::remove_file(model3.join("model.safetensors")).unwrap();
    assert!(mkfifo(&model3.join("model.safetensors.index.json")));
    assert_clean_error(
        &mladb(&["run", "--model", s(&model3), "--decode", "0"]),
        "not a regular file",
    );
}

trait TapMkdir {
    fn tap_mkdir(self) -> Self;
}

impl TapMkdir for PathBuf {
    fn tap_mkdir(self) -> Self {
        std::fs::create_dir_all(&self).unwrap();
        self
    }
}

#[test]
fn an_oversized_config_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    let f = std::fs::File::create(&config).unwrap();
    f.set_len(1 << 30).unwrap(); // sparse: no disk used
    assert_clean_error(&mladb(&["layout", "import", s(&config)]), "larger than");
}

/// Records a small session (glm5-tiny, prompt 1,2,3, `decode` steps, no tensors) at `path`.
fn record_plain(path: &Path, decode: usize) {
    let decode = decode.to_string();
    let o = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--tokens",
        "1,2,3",
        "--decode",
        &decode,
        "--record",
        s(path),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Records a small session (with tensors) at `path`.
fn record(path: &Path, seed: &str) {
    let o = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--seed",
        seed,
        "--tokens",
        "1,2,3",
        "--decode",
        "1",
        "--record",
        s(path),
        "--record-tensors",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn a_session_s_tensors_must_lie_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let session = dir.path().join("s.ron");
    record(&session, "0");
    let text = std::fs::read_to_string(&session).unwrap();
    assert!(text.contains("tensors: Some(\"s.tensors.safetensors\")"));
    for bad in [
        "../../../../dev/zero",
        "/dev/zero",
        "sub/s.tensors.safetensors",
    ] {
        std::fs::write(
            &session,
            text.replace("\"s.tensors.safetensors\"", &format!("{bad:?}")),
        )
        .unwrap();
        let out = dir.path().join("out.safetensors");
        assert_clean_error(
            &mladb(&["replay", s(&session), "--dump", s(&out)]),
            "beside the session",
        );
    }
}

#[test]
fn a_huge_session_of_nuls_is_refused_without_a_huge_allocation() {
    let dir = tempfile::tempdir().unwrap();
    let session = dir.path().join("nul.ron");
    let f = std::fs::File::create(&session).unwrap();
    f.set_len(512 << 20).unwrap(); // sparse
                                   // 2 GiB of address space: the text itself fits, a list of its characters (4 bytes each)
                                   // does not.
    let o = mladb_bounded(&["replay", s(&session), "--json"], 20, 2);
    assert_clean_error(&o, "nul.ron");
}

#[test]
fn the_memory_a_long_prompt_needs_is_checked_before_the_run() {
    let tokens: Vec<String> = (0..20000).map(|i| (i % 100).to_string()).collect();
    let tokens = tokens.join(",");
    let o = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--tokens",
        &tokens,
        "--decode",
        "0",
        "--max-memory-gb",
        "2",
    ]);
    assert_clean_error(&o, "--max-memory-gb");
    assert!(stderr(&o).contains("GB"), "{}", stderr(&o));
    // A short prompt runs under the same limit.
    let o = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--tokens",
        "1,2,3",
        "--decode",
        "1",
        "--max-memory-gb",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn outputs_onto_special_files_are_refused_before_the_run() {
    let base = [
        "run",
        "--layout",
        "glm5-tiny",
        "--tokens",
        "1,2,3",
        "--decode",
        "0",
    ];
    let dir = tempfile::tempdir().unwrap();
    // A device: never a real one (as root, a build that replaced it would destroy /dev/null),
    // but a null device node of our own where mknod is allowed (root); else a FIFO stands in.
    let device = dir.path().join("null");
    let made = Command::new("mknod")
        .args([s(&device), "c", "1", "3"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|st| st.success());
    if !made {
        eprintln!("device case skipped: mknod is not allowed here");
    }
    for flag in ["--dump", "--record"] {
        if !made {
            break;
        }
        let mut args = base.to_vec();
        args.extend([flag, s(&device)]);
        let o = mladb(&args);
        assert_clean_error(&o, "not a regular file");
        assert!(o.stdout.is_empty(), "checked before the run");
        assert!(std::fs::metadata(&device)
            .unwrap()
            .file_type()
            .is_char_device());
    }
    // A read-only file is not replaced, and keeps its mode.
    let ro = dir.path().join("ro.safetensors");
    std::fs::write(&ro, b"keep").unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o444)).unwrap();
    let mut args = base.to_vec();
    args.extend(["--dump", s(&ro)]);
    assert_clean_error(&mladb(&args), "read-only");
    assert_eq!(std::fs::read(&ro).unwrap(), b"keep");
    assert_eq!(
        std::fs::metadata(&ro).unwrap().permissions().mode() & 0o777,
        0o444
    );
    // A symlink is not replaced.
    let target = dir.path().join("target.safetensors");
    std::fs::write(&target, b"keep").unwrap();
    let link = dir.path().join("link.safetensors");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let mut args = base.to_vec();
    args.extend(["--dump", s(&link)]);
    assert_clean_error(&mladb(&args), "symbolic link");
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    // A FIFO stays a FIFO.
    let fifo = dir.path().join("fifo.safetensors");
    if mkfifo(&fifo) {
        let mut args = base.to_vec();
        args.extend(["--dump", s(&fifo)]);
        assert_clean_error(&mladb(&args), "not a regular file");
        assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    }
}

#[test]
fn kernels_out_onto_a_file_is_refused_before_compiling() {
    // Checked before NVRTC is looked for, so this holds on a machine without it as well.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-folder");
    std::fs::write(&file, b"keep").unwrap();
    let o = mladb(&["kernels", "--arch", "sm_90", "--out", s(&file)]);
    assert_clean_error(&o, "not a directory");
    assert!(o.stdout.is_empty(), "refused before anything compiled");
    assert_eq!(std::fs::read(&file).unwrap(), b"keep");
}

#[test]
fn stale_temporaries_of_dead_processes_are_removed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    // PIDs never exceed 2^22 on Linux: this process is dead.
    let stale = dir.path().join(".out.safetensors.mladb-tmp-99999999");
    std::fs::write(&stale, b"half").unwrap();
    let other = dir.path().join(".other.safetensors.mladb-tmp-99999999");
    std::fs::write(&other, b"not ours").unwrap();
    let o = mladb(&[
        "run",
        "--layout",
        "glm5-tiny",
        "--tokens",
        "1,2",
        "--decode",
        "0",
        "--dump",
        s(&out),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.exists());
    assert!(!stale.exists(), "the stale temporary is removed");
    assert!(other.exists(), "another target's temporary is left alone");
}

#[test]
fn a_session_with_another_runs_tensors_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.ron");
    let b = dir.path().join("b.ron");
    record(&a, "0");
    record(&b, "1");
    // What a kill between the two renames of a save leaves: the old session, new tensors.
    std::fs::copy(
        dir.path().join("b.tensors.safetensors"),
        dir.path().join("a.tensors.safetensors"),
    )
    .unwrap();
    let out = dir.path().join("out.safetensors");
    assert_clean_error(
        &mladb(&["replay", s(&a), "--dump", s(&out)]),
        "does not match",
    );
    assert!(!out.exists());
    assert_clean_error(&mladb(&["replay", s(&a), "--bench"]), "does not match");
    // The untouched pair still replays.
    let o = mladb(&["replay", s(&b), "--dump", s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn control_characters_in_errors_are_escaped() {
    let o = mladb(&["run", "--layout", "no\x1b[31msuch\x07.ron", "--decode", "0"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(!err.contains('\x1b') && !err.contains('\x07'), "{err:?}");
    assert!(err.contains("\\u{1b}"), "{err:?}");
}

#[test]
fn a_negative_routed_scaling_factor_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = checkpoint_copy(dir.path());
    let config = model.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    c["routed_scaling_factor"] = serde_json::json!(-2.5);
    std::fs::write(&config, c.to_string()).unwrap();
    assert_clean_error(
        &mladb(&["layout", "import", s(&config)]),
        "routed_scaling_factor",
    );
}

#[test]
fn a_keys_file_cannot_make_the_debugger_impossible_to_quit() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.ron");
    for (text, needle) in [
        (r#"{ "quit": [] }"#, "quit: no keys"),
        (r#"{ "quit": ["j"] }"#, "j is bound to both down and quit"),
        (r#"{ "step": ["ctrl-c"] }"#, "Ctrl-C is bound to step"),
        (r#"{ "step": ["x"], "step": ["y"] }"#, "named twice"),
    ] {
        std::fs::write(&keys, text).unwrap();
        let o = mladb(&["tui", "--layout", "glm5-tiny", "--keys", s(&keys)]);
        assert_clean_error(&o, needle);
    }
}

/// tmux's view of a pane: alternate screen, cursor shown, mouse tracking.
fn pane_modes(session: &str) -> String {
    let o = Command::new("tmux")
        .args([
            "display-message",
            "-p",
            "-t",
            session,
            "#{alternate_on} #{cursor_flag} #{mouse_any_flag}#{mouse_standard_flag}#{mouse_button_flag}",
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

fn pane_text(session: &str) -> String {
    let o = Command::new("tmux")
        .args(["capture-pane", "-p", "-t", session])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn a_signal_restores_the_terminal_as_q_does() {
    if !Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        eprintln!("signal test skipped: tmux is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for (n, (sig, number)) in [("TERM", 15), ("HUP", 1), ("INT", 2)]
        .into_iter()
        .enumerate()
    {
        let session = format!("mladb-sig-{}-{n}", std::process::id());
        let pidfile = dir.path().join(format!("pid{n}"));
        // The shell stays after mladb ends (tmux hides the cursor of a dead pane), and says
        // how it ended.
        let command = format!(
            "sh -c 'echo $$ > {}; exec env NO_COLOR=1 MLADB_AUTOSAVE=off {} tui --layout glm5-tiny'; echo EXITED $?; sleep 60",
            s(&pidfile),
            env!("CARGO_BIN_EXE_mladb")
        );
        // tmux's server may be starting for another test at the same moment: try again.
        let mut started = None;
        for _ in 0..5 {
            let o = Command::new("tmux")
                .args(["new-session", "-d", "-s", &session, "-x", "100", "-y", "30"])
                .arg(&command)
                .output()
                .unwrap();
            if o.status.success() {
                started = Some(());
                break;
            }
            eprintln!("tmux new-session: {}", String::from_utf8_lossy(&o.stderr));
            std::thread::sleep(Duration::from_millis(300));
        }
        assert!(started.is_some(), "tmux would not start a session");
        let _kill = KillSession(session.clone());
        // Up and drawing: alternate screen on, cursor hidden, mouse tracked.
        let start = Instant::now();
        while !pane_modes(&session).starts_with("1 0 ") || !pidfile.exists() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the debugger did not start: {}",
                pane_modes(&session)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let pid = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .to_string();
        assert!(Command::new("kill")
            .args([&format!("-{sig}"), &pid])
            .status()
            .unwrap()
            .success());
        let start = Instant::now();
        loop {
            let text = pane_text(&session);
            if let Some(rest) = text.split("EXITED ").nth(1) {
                let status = rest.split_whitespace().next().unwrap_or("").to_string();
                assert_eq!(status, (128 + number).to_string(), "SIG{sig}: {text}");
                assert_eq!(
                    pane_modes(&session),
                    "0 1 000",
                    "SIG{sig}: alternate screen, cursor, mouse after the exit"
                );
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "SIG{sig}: still running: {text}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

struct KillSession(String);

impl Drop for KillSession {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.0])
            .status();
    }
}

/// The glm5-sparse GGUF fixture with one metadata value replaced.
fn gguf_with(key: &str, value: mladb::gguf::Value) -> (tempfile::TempDir, PathBuf) {
    gguf_with_all("glm5-sparse-q.gguf", &[(key, value)], 0)
}

/// The GGUF fixture `name` with the metadata values `changes` in place of its own, and
/// `fillers` more tensors of one f32 each under long names no model has.
fn gguf_with_all(
    name: &str,
    changes: &[(&str, mladb::gguf::Value)],
    fillers: usize,
) -> (tempfile::TempDir, PathBuf) {
    use mladb::gguf::{GgufFile, GgufWriter};
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name);
    let file = GgufFile::open(&src).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        if k != "general.alignment" {
            let v = match changes.iter().find(|(key, _)| key == k) {
                Some((_, value)) => value.clone(),
                None => v.clone(),
            };
            w.metadata(k.clone(), v).unwrap();
        }
    }
    for (key, _) in changes {
        assert!(file.get(key).is_some(), "the fixture has {key}");
    }
    for t in file.tensors() {
        w.tensor(
            t.name.clone(),
            t.ty,
            &t.shape(),
            file.tensor_data(t).to_vec(),
        )
        .unwrap();
    }
    for i in 0..fillers {
        let name = format!("filler.{i:05}.{}", "x".repeat(180));
        w.tensor(name, mladb::gguf::GgmlType::F32, &[1], vec![0; 4])
            .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    w.write(&path).unwrap();
    (dir, path)
}

#[test]
fn non_finite_and_wrong_typed_gguf_metadata_are_refused() {
    use mladb::gguf::Value;
    for (key, value, needle) in [
        (
            "glm-dsa.rope.freq_base",
            Value::F32(f32::INFINITY),
            "not a finite number",
        ),
        (
            "glm-dsa.attention.layer_norm_rms_epsilon",
            Value::F32(f32::NAN),
            "not a finite number",
        ),
        (
            "glm-dsa.expert_weights_norm",
            Value::U32(1),
            "expected a bool",
        ),
    ] {
        let (_d, path) = gguf_with(key, value);
        let o = mladb(&["run", "--model", s(&path), "--decode", "0"]);
        assert_clean_error(&o, needle);
        assert!(stderr(&o).contains(key), "{}", stderr(&o));
    }
}

#[test]
fn verify_notices_tampered_indices_layers_positions_and_byte_counts() {
    let dir = tempfile::tempdir().unwrap();
    let session = dir.path().join("s.ron");
    record_plain(&session, 1);
    let o = mladb(&["replay", s(&session), "--verify"]);
    assert_eq!(o.status.code(), Some(0), "untouched: {}", stderr(&o));
    let text = std::fs::read_to_string(&session).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("event: (index: 7, phase: \"prefill\", layer: Some(0)"))
        .expect("op 7 of layer 0")
        .to_string();
    let bytes = line
        .split("bytes: ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .unwrap()
        .to_string();
    for (from, to) in [
        ("index: 7,", "index: 70,".to_string()),
        ("layer: Some(0)", "layer: Some(1)".to_string()),
        ("positions: (0, 3)", "positions: (1, 3)".to_string()),
        (
            &format!("bytes: {bytes},")[..],
            format!("bytes: {},", bytes.parse::<u64>().unwrap() + 4),
        ),
    ] {
        assert!(line.contains(from), "{from} in {line}");
        let tampered = text.replace(&line, &line.replacen(from, &to, 1));
        std::fs::write(&session, tampered).unwrap();
        let o = mladb(&["replay", s(&session), "--verify"]);
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(o.status.code(), Some(1), "{from}: {out} {}", stderr(&o));
        assert!(out.contains("mismatch: run 0, op #7"), "{from}: {out}");
    }
}

#[test]
fn an_unreadable_tensor_type_is_found_at_load_not_mid_run() {
    let dir = tempfile::tempdir().unwrap();
    let model = checkpoint_copy(dir.path());
    let src = std::fs::read(fixture("glm5-sparse").join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&src).unwrap();
    // lm_head, the last weight a run reads, stored as I32.
    let owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| {
            let dtype = if name == "lm_head.weight" {
                safetensors::Dtype::I32
            } else {
                v.dtype()
            };
            (name, dtype, v.shape().to_vec(), v.data().to_vec())
        })
        .collect();
    let views = owned.iter().map(|(n, d, s, b)| {
        (
            n.clone(),
            safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
        )
    });
    std::fs::remove_file(model.join("model.safetensors")).unwrap();
    std::fs::write(
        model.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    let o = mladb(&["run", "--model", s(&model), "--decode", "0"]);
    assert_clean_error(&o, "lm_head.weight is stored as I32");
    assert!(
        o.stdout.is_empty(),
        "refused before the run: {}",
        String::from_utf8_lossy(&o.stdout)
    );
}

#[test]
fn a_shared_indexer_with_no_earlier_layer_says_it_runs_dense() {
    let dir = tempfile::tempdir().unwrap();
    let model = checkpoint_copy(dir.path());
    let config = model.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    // Layer 0 shared (its indexer weights, still in the file, go unused).
    assert_eq!(c["indexer_types"][0], "full");
    c["indexer_types"][0] = serde_json::json!("shared");
    std::fs::write(&config, c.to_string()).unwrap();
    let o = mladb(&["run", "--model", s(&model), "--decode", "0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o)
            .contains("note: layer 0 shares the DSA top-k of an earlier layer, and there is none"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn verify_checks_the_memory_a_recomputation_needs() {
    let dir = tempfile::tempdir().unwrap();
    let session = dir.path().join("s.ron");
    record_plain(&session, 1);
    let o = mladb(&[
        "replay",
        s(&session),
        "--verify",
        "--max-memory-gb",
        "0.001",
    ]);
    assert_clean_error(&o, "above the limit of 1.00 MB (--max-memory-gb)");
    let o = mladb(&["replay", s(&session), "--verify", "--max-memory-gb", "2"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn a_layout_too_large_for_memory_is_refused_with_the_figure() {
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("wide.ron");
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("layouts/glm5-tiny.ron"),
    )
    .unwrap();
    // The largest hidden size a layout may have.
    std::fs::write(
        &layout,
        text.replace("hidden_size: 256,", "hidden_size: 1048576,"),
    )
    .unwrap();
    let o = mladb(&[
        "run",
        "--layout",
        s(&layout),
        "--decode",
        "0",
        "--max-memory-gb",
        "4",
    ]);
    assert_clean_error(&o, "(weights 17.");
    assert!(o.stdout.is_empty());
}

#[test]
fn a_session_s_recorded_layout_is_validated() {
    let dir = tempfile::tempdir().unwrap();
    let session = dir.path().join("s.ron");
    record_plain(&session, 0);
    let text = std::fs::read_to_string(&session).unwrap();
    assert!(text.contains("hidden_size: 256,"));
    std::fs::write(
        &session,
        text.replacen("hidden_size: 256,", "hidden_size: 18446744073709551615,", 1),
    )
    .unwrap();
    assert_clean_error(
        &mladb(&["replay", s(&session), "--json"]),
        "layout: hidden_size",
    );
}

#[test]
fn the_debugger_refuses_a_prompt_too_long_for_memory() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut app = common::tiny_app("");
        // 300,000 tokens: attention over them needs terabytes.
        let line = format!("set tokens {}", vec!["1"; 300_000].join(","));
        common::command(&mut app, &line);
        let _ = tx.send(app.log.join("\n"));
    });
    let log = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("answered in time");
    assert!(
        log.contains("refusing to allocate"),
        "{}",
        &log[log.len().saturating_sub(2000)..]
    );
}

#[test]
fn esc_cancels_a_long_load_in_the_debugger() {
    use mladb::tui::{app::App, driver::ThreadDriver, keys::Keymap, theme::Theme};
    use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small.ron");
    record_plain(&small, 1);
    // A large session: its one run repeated until the file takes seconds to parse.
    let text = std::fs::read_to_string(&small).unwrap();
    let start = text.find("    runs: [\n").unwrap() + "    runs: [\n".len();
    let end = text.rfind("    ],\n").unwrap();
    let run = &text[start..end];
    let big = dir.path().join("big.ron");
    std::fs::write(
        &big,
        format!("{}{}{}", &text[..start], run.repeat(200), &text[end..]),
    )
    .unwrap();
    assert!(std::fs::metadata(&big).unwrap().len() > 40 << 20);

    let spec = common::live_spec("glm5-tiny", "", 3, 3, 1);
    let mut app = App::new(
        Box::new(ThreadDriver::start(spec).unwrap()),
        Keymap::default(),
        Theme::plain(),
    );
    let key = |app: &mut App, code| app.on_key(KeyEvent::new(code, KeyModifiers::NONE));
    common::command(&mut app, &format!("load {}", s(&big)));
    let t = Instant::now();
    while app.mirror.busy.is_none() {
        app.tick();
        assert!(t.elapsed() < Duration::from_secs(10), "the load started");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(200));
    key(&mut app, KeyCode::Esc);
    let t = Instant::now();
    loop {
        app.tick();
        if app.log.iter().any(|l| l.contains("cancelled")) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "Esc did not cancel the load: {:?}",
            &app.log[app.log.len().saturating_sub(5)..]
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        app.mirror.busy.is_none() || {
            std::thread::sleep(Duration::from_millis(100));
            app.tick();
            app.mirror.busy.is_none()
        }
    );
}

#[test]
fn a_huge_session_of_blanks_is_refused_without_a_list_of_its_characters() {
    let dir = tempfile::tempdir().unwrap();
    let session = dir.path().join("blank.ron");
    // 256 MiB of blanks: valid text, so the error (at its end) is where the field path is
    // looked up; a list of its characters would take 1 GiB more.
    {
        use std::io::Write;
        let mut f = std::io::BufWriter::new(std::fs::File::create(&session).unwrap());
        let line = [b' '; 1 << 20];
        for _ in 0..256 {
            f.write_all(&line).unwrap();
        }
    }
    let o = mladb_bounded(&["replay", s(&session), "--json"], 30, 1);
    let err = stderr(&o);
    assert_clean_error(&o, "blank.ron");
    assert!(err.contains("line 1"), "{err}");
}

#[test]
fn the_debugger_refuses_to_load_a_session_too_long_for_memory() {
    let dir = tempfile::tempdir().unwrap();
    let session = dir.path().join("s.ron");
    record_plain(&session, 0);
    // A version 1 session (nothing recorded) whose prompt has 300,000 tokens.
    let text = std::fs::read_to_string(&session).unwrap();
    let start = text.find("    prompt: [").unwrap();
    let end = start + text[start..].find("],").unwrap() + 2;
    let head = text[..start].replace("version: 2,", "version: 1,");
    let rest = &text[end..];
    let rest = &rest[..rest.find("    layout: Some(").unwrap()];
    let long = format!(
        "{head}    prompt: [{}],\n    prefill: 300000,{})\n",
        vec!["1"; 300_000].join(","),
        rest.replacen("    prefill: 3,", "", 1)
    );
    std::fs::write(&session, long).unwrap();
    let path = s(&session).to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut app = common::tiny_app("");
        common::command(&mut app, &format!("load {path}"));
        let _ = tx.send(app.log.join("\n"));
    });
    let log = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("answered in time");
    assert!(log.contains("refusing to allocate"), "{log}");
}

#[test]
fn save_in_the_debugger_refuses_what_it_must_not_replace() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.ron");
    let ro = dir.path().join("ro.ron");
    std::fs::write(&ro, b"keep").unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o444)).unwrap();
    let mut targets = vec![(ro.clone(), "read-only")];
    if mkfifo(&fifo) {
        targets.push((fifo.clone(), "not a regular file"));
    }
    let mut app = common::tiny_app("");
    for (target, needle) in targets {
        let line = format!("save {}", s(&target));
        common::command(&mut app, &line);
        let log = app.log.join("\n");
        assert!(log.contains(needle), "{needle}: {log}");
    }
    assert_eq!(std::fs::read(&ro).unwrap(), b"keep");
    assert_eq!(
        std::fs::metadata(&ro).unwrap().permissions().mode() & 0o777,
        0o444
    );
    if fifo.exists() {
        assert!(std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo());
    }
}

/// `--max-memory-gb` holds the debugger's later runs too: a prompt set with `:set tokens` that
/// fits the machine but not the limit given is refused, with the limit; without one it runs.
#[test]
fn the_debugger_holds_set_tokens_to_max_memory_gb() {
    use mladb::tui::{app::App, driver::InlineDriver, keys::Keymap, theme::Theme};
    let answer = |limit: Option<f64>| {
        let mut spec = common::live_spec("glm5-tiny", "", 3, 3, 1);
        spec.max_memory_gb = limit;
        let mut app = App::new(
            Box::new(InlineDriver::new(spec).unwrap()),
            Keymap::default(),
            Theme::plain(),
        );
        let line = format!("set tokens {}", vec!["1"; 64].join(","));
        common::command(&mut app, &line);
        app.log.join("\n")
    };
    let held = answer(Some(1e-6));
    assert!(
        held.contains("refusing to allocate") && held.contains("--max-memory-gb"),
        "{held}"
    );
    let free = answer(None);
    assert!(!free.contains("refusing to allocate"), "{free}");
}

/// A GGUF whose metadata claims far more layers and experts than it holds tensors for (found by
/// the `gguf_model` fuzz target): mapping the catalogue onto the file looked each missing
/// tensor up through the lookup whose error suggests close names, weighing every name of the
/// table (2000 long ones here) for each of the catalogue's misses (1000 layers, 64 experts),
/// which took minutes. Now it is an error at once.
#[test]
fn a_gguf_claiming_layers_and_experts_it_lacks_is_refused_promptly() {
    use mladb::gguf::Value;
    let (_dir, path) = gguf_with_all(
        "deepseek-v3-plain-split.gguf",
        &[
            ("deepseek2.block_count", Value::U32(1000)),
            ("deepseek2.expert_count", Value::U32(64)),
        ],
        2000,
    );
    let out = mladb_bounded(
        &[
            "run",
            "--model",
            path.to_str().unwrap(),
            "--tokens",
            "1",
            "--decode",
            "0",
        ],
        30,
        4,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.starts_with("error: "), "{err}");
}

/// A config (or GGUF metadata) claiming 2^32 - 1 layers, with no per-layer lists to bound it
/// (found by the `gguf_model` fuzz target): the indexer's per-layer modes were made for every
/// claimed layer, a 4 GB allocation, before the layer count was checked. Now the count is
/// checked first: one error line, within a 2 GB address space.
#[test]
fn a_config_claiming_billions_of_layers_is_refused_before_per_layer_lists() {
    let src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/glm5-sparse/config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src).unwrap()).unwrap();
    let map = config.as_object_mut().unwrap();
    for key in ["indexer_types", "layer_types", "mlp_layer_types"] {
        map.remove(key);
    }
    map.insert("num_hidden_layers".into(), serde_json::json!(u32::MAX));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let out = mladb_bounded(&["layout", "import", path.to_str().unwrap()], 20, 2);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("error: ") && err.contains("num_layers"),
        "{err}"
    );
}

/// A reference dump whose header claims more values than memory holds (a sparse file of 1 TiB
/// that occupies no disk) is refused before any is read (before, its bytes were read into memory
/// until an allocation failed, or, with no limit on the address space, the machine's memory ran out).
#[test]
fn a_reference_dump_too_large_for_memory_is_refused_before_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = sparse_reference_dump(dir.path(), 1 << 38);
    let o = mladb(&["check", "--layout", "glm5-tiny", "--reference", s(&path)]);
    assert_clean_error(&o, "refusing to allocate");
}

/// `--max-memory-gb` bounds the reference dump's values too (before, only the run's buffers
/// were held to it and a dump was read as long as the machine's memory held it): a 4.3 GB dump
/// is refused under a limit of 1 GB that the glm5-tiny run itself fits in.
#[test]
fn max_memory_gb_bounds_the_reference_dump() {
    let dir = tempfile::tempdir().unwrap();
    let path = sparse_reference_dump(dir.path(), 1 << 30);
    let o = check_against_dump_within(&path, "1");
    assert_clean_error(&o, "refusing to allocate");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--max-memory-gb") && err.contains("4.29 GB"),
        "{err}"
    );
}

/// The dump and the run must fit `--max-memory-gb` together: a 16 MB dump beside glm5-tiny's
/// 19 MB run over its three tokens is refused under 30 MB, though each alone fits; under 40 MB
/// the run starts.
#[test]
fn max_memory_gb_bounds_the_reference_dump_and_the_run_together() {
    let dir = tempfile::tempdir().unwrap();
    let path = sparse_reference_dump(dir.path(), 4_000_000);
    let o = check_against_dump_within(&path, "0.03");
    assert_clean_error(&o, "refusing to allocate");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("the reference dump's values already held 16.00 MB")
            && err.contains("limit of 30.00 MB"),
        "{err}"
    );
    let o = check_against_dump_within(&path, "0.04");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("refusing to allocate"), "{err}");
}

/// `mladb check` of glm5-tiny against the dump at `path` under `--max-memory-gb gb`.
fn check_against_dump_within(path: &Path, gb: &str) -> Output {
    mladb(&[
        "check",
        "--layout",
        "glm5-tiny",
        "--reference",
        s(path),
        "--max-memory-gb",
        gb,
    ])
}

/// A dump whose one tensor (`prefill/logits`) holds `values` f32 zeros in a sparse file, which
/// occupies no disk.
fn sparse_reference_dump(dir: &Path, values: u64) -> PathBuf {
    let path = dir.join("huge.safetensors");
    let header = format!(
        r#"{{"__metadata__":{{"dump_format":"1","tokens":"[1,2,3]","prefill":"3","decode":"0","producer":"mladb test"}},"prefill/logits":{{"dtype":"F32","shape":[{values}],"data_offsets":[0,{}]}}}}"#,
        4 * values
    );
    let mut text = header.into_bytes();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&text);
    std::fs::write(&path, &bytes).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(bytes.len() as u64 + 4 * values).unwrap();
    path
}
