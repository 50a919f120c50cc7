//! The real binary under tmux: start the debugger, step, search, toggle MLA disable, open the
//! Learn view, quit; and follow a shipped session's tour from note to note. The screen is
//! checked at each stage with capture-pane. Skips (with the reason printed)
//! where tmux is not installed; .ci/run installs it.

use std::process::Command;
use std::time::{Duration, Instant};

struct Tmux {
    session: String,
}

impl Tmux {
    fn available() -> bool {
        Command::new("tmux")
            .arg("-V")
            .output()
            .is_ok_and(|o| o.status.success())
    }

    /// A tmux session of its own (`tag` tells tests of one process apart).
    fn start(tag: &str, command: &str, w: u16, h: u16) -> Tmux {
        let session = format!("mladb-e2e-{}-{tag}", std::process::id());
        let status = Command::new("tmux")
            .args([
                "new-session",
                "-d",
                "-s",
                &session,
                "-x",
                &w.to_string(),
                "-y",
                &h.to_string(),
                command,
            ])
            .env("NO_COLOR", "1")
            .status()
            .expect("tmux starts");
        assert!(status.success());
        Tmux { session }
    }

    fn keys(&self, keys: &[&str]) {
        for k in keys {
            let ok = Command::new("tmux")
                .args(["send-keys", "-t", &self.session, k])
                .status()
                .unwrap();
            assert!(ok.success());
            // Separate keys, so that Esc followed by a key is not read as Alt-key.
            std::thread::sleep(Duration::from_millis(60));
        }
    }

    fn screen(&self) -> String {
        let out = Command::new("tmux")
            .args(["capture-pane", "-p", "-t", &self.session])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits (up to 20 s) until the screen shows `text`; returns the screen.
    fn wait_for(&self, text: &str) -> String {
        let start = Instant::now();
        loop {
            let screen = self.screen();
            if screen.contains(text) {
                return screen;
            }
            if start.elapsed() > Duration::from_secs(20) {
                panic!("timed out waiting for {text:?}; the screen shows:\n{screen}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.session])
            .status();
    }
}

#[test]
fn a_newcomer_session_under_tmux() {
    if !Tmux::available() {
        eprintln!("skipped: tmux is not installed (.ci/run installs it)");
        return;
    }
    let bin = env!("CARGO_BIN_EXE_mladb");
    let log = std::env::temp_dir().join(format!("mladb-e2e-{}.log", std::process::id()));
    // The session is saved on quit to a file of the test's own (not the user's state folder).
    let saved = std::env::temp_dir().join(format!("mladb-e2e-{}.ron", std::process::id()));
    let tmux = Tmux::start(
        "newcomer",
        &format!(
            "MLADB_LOG={} MLADB_AUTOSAVE={} {bin} tui --layout glm5-tiny --prefill 9 --decode 2; echo MLADB-EXIT-$?; sleep 60",
            log.display(),
            saved.display()
        ),
        100,
        30,
    );
    // Paused at the first op.
    let screen = tmux.wait_for("#0 prefill model.embed_tokens");
    assert!(screen.contains(" paused "), "{screen}");
    assert!(screen.contains("MLA-disable off"));
    // Step through a layer.
    tmux.keys(&["s", "n"]);
    let screen = tmux.wait_for("L1 input_layernorm");
    // Layers start collapsed: layer 0, run through, is one row; layer 1, where the run stands,
    // is open.
    assert!(
        screen.contains("▸  layer 0")
            && screen.contains("▾  layer 1")
            && !screen.contains("mlp.down_proj"),
        "layer 0 is collapsed:\n{screen}"
    );
    // A search opens layer 0 at its match.
    tmux.keys(&["/", "kv_b_proj", "Enter"]);
    let screen = tmux.wait_for("/kv_b_proj: match 1 of 1, wrapped");
    assert!(
        screen.contains("▾  layer 0") && screen.contains("self_attn.kv_b_proj"),
        "layer 0 is open at the match:\n{screen}"
    );
    // Run to the end, toggle MLA disable, see the comparison.
    tmux.keys(&["c"]);
    tmux.wait_for("finished");
    tmux.keys(&["m"]);
    let screen = tmux.wait_for("(vs 0)");
    assert!(screen.contains("MLA-disable on"), "{screen}");
    assert!(screen.contains("mla-disable off → on"), "{screen}");
    assert!(screen.contains("re-executed from op #149"), "{screen}");
    // The Learn view, and back.
    tmux.keys(&["l"]);
    let screen = tmux.wait_for("MLA weight absorption");
    assert!(screen.contains("W_UK"), "{screen}");
    tmux.keys(&["Escape"]);
    tmux.wait_for("execution");
    // Help, then quit: the terminal is restored and the program exits 0.
    tmux.keys(&["?"]);
    tmux.wait_for("toggle MLA disable");
    tmux.keys(&["Escape"]);
    tmux.keys(&["q"]);
    let screen = tmux.wait_for("MLADB-EXIT-");
    assert!(screen.contains("MLADB-EXIT-0"), "{screen}");
    assert!(
        !screen.contains("execution ·"),
        "the alternate screen is gone:\n{screen}"
    );
    // The line says where the session went, and it is there.
    assert!(
        screen.contains(&format!("session saved to {}", saved.display())),
        "{screen}"
    );
    let session = std::fs::read_to_string(&saved).unwrap_or_default();
    let _ = std::fs::remove_file(&saved);
    assert!(
        session.contains("glm5-tiny"),
        "the saved session:\n{session}"
    );
    // Logs went to the file, not the screen.
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(logged.contains("re-executed from op #149"), "{logged}");
    let _ = std::fs::remove_file(&log);
}

#[test]
fn a_tour_of_the_garbage_output_hunt_under_tmux() {
    if !Tmux::available() {
        eprintln!("skipped: tmux is not installed (.ci/run installs it)");
        return;
    }
    let bin = env!("CARGO_BIN_EXE_mladb");
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/sessions/output-buffer-disconnect.ron"
    );
    let log = std::env::temp_dir().join(format!("mladb-e2e-tour-{}.log", std::process::id()));
    let tmux = Tmux::start(
        "tour",
        &format!(
            "MLADB_LOG={} {bin} replay {file} --tour; echo MLADB-EXIT-$?; sleep 60",
            log.display()
        ),
        100,
        30,
    );
    // Opens at the first note, the pane open, the note whole.
    let screen = tmux.wait_for("note 1 of 7");
    assert!(screen.contains("The hunt for garbage output"), "{screen}");
    assert!(screen.contains("} next · { previous"), "{screen}");
    // Each stop: its note, its op in the right pane's title, its pane.
    let stops = [
        (
            "note 2 of 7",
            "Prefill is right",
            "prefill · logits",
            "nan 0",
        ),
        (
            "note 3 of 7",
            "Decode is garbage",
            "decode.0 · logits",
            "nan 2048",
        ),
        (
            "note 4 of 7",
            "MLA disable on",
            "decode.0 · logits",
            "vs run 0",
        ),
        (
            "note 5 of 7",
            "MLA disable off again",
            "self_attn.attn_output",
            "whole prefill",
        ),
        (
            "note 6 of 7",
            "The Buffers pane",
            "self_attn.attn_latent",
            "DISCONNECTED",
        ),
    ];
    for (title, text, op, pane) in stops {
        tmux.keys(&["}"]);
        let screen = tmux.wait_for(title);
        for want in [text, op, pane] {
            assert!(screen.contains(want), "{title}: no {want:?} in\n{screen}");
        }
    }
    // And back one: the Compare pane again.
    tmux.keys(&["{"]);
    let screen = tmux.wait_for("note 5 of 7");
    assert!(screen.contains("whole prefill"), "{screen}");
    tmux.keys(&["q"]);
    let screen = tmux.wait_for("MLADB-EXIT-");
    assert!(screen.contains("MLADB-EXIT-0"), "{screen}");
    let _ = std::fs::remove_file(&log);
}

#[test]
fn quitting_prints_where_the_session_was_saved() {
    if !Tmux::available() {
        eprintln!("skipped: tmux is not installed (.ci/run installs it)");
        return;
    }
    let bin = env!("CARGO_BIN_EXE_mladb");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state").join("autosave.ron");
    let log = dir.path().join("mladb.log");
    let run = |tag: &str, autosave: &str| {
        let tmux = Tmux::start(
            tag,
            &format!(
                "MLADB_LOG={} MLADB_AUTOSAVE={autosave} {bin} tui --layout glm5-tiny --prefill 9 --decode 2; echo MLADB-EXIT-$?; sleep 60",
                log.display()
            ),
            120,
            30,
        );
        tmux.wait_for("#0 prefill model.embed_tokens");
        tmux.keys(&["s"]);
        tmux.wait_for("L0 input_layernorm");
        tmux.keys(&["q"]);
        let screen = tmux.wait_for("MLADB-EXIT-");
        assert!(screen.contains("MLADB-EXIT-0"), "{screen}");
        screen
    };
    let screen = run("autosave", &path.display().to_string());
    let p = path.display();
    assert!(
        screen.contains(&format!("session saved to {p} (mladb replay {p})")),
        "{screen}"
    );
    let session = mladb::session::Session::load(&path).unwrap();
    assert_eq!(session.cursor.unwrap().op, "model.layers.0.input_layernorm");
    let screen = run("autosave-off", "off");
    assert!(
        screen.contains("session not saved: autosave is off (MLADB_AUTOSAVE=off)"),
        "{screen}"
    );
}
