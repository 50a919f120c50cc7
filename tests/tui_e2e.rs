//! The real binary under tmux: start the debugger, step, search, toggle MLA disable, open the
//! Learn view, quit, and check the screen at each stage with capture-pane. Skips (with the reason printed)
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

    fn start(command: &str, w: u16, h: u16) -> Tmux {
        let session = format!("mladb-e2e-{}", std::process::id());
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
    let tmux = Tmux::start(
        &format!("MLADB_LOG={} {bin} tui --layout glm5-tiny --prefill 9 --decode 2; echo MLADB-EXIT-$?; sleep 60", log.display()),
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
    // Logs went to the file, not the screen.
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(logged.contains("re-executed from op #149"), "{logged}");
    let _ = std::fs::remove_file(&log);
}
