//! What the random-input property test (tests/keys_prop.rs) found, each pinned down.

mod common;

use common::command;

use mladb::tui::app::App;
use mladb::tui::keys::Keymap;
use mladb::tui::replay::ReplayDriver;
use mladb::tui::theme::Theme;
use std::path::Path;
use std::sync::mpsc::channel;
use std::time::Duration;

/// Runs `f` on its own thread; fails when it takes longer than `limit` (a hang).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .expect("finished in time (or panicked)")
}

fn shipped(name: &str) -> App {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("sessions")
        .join(name);
    App::new(
        Box::new(ReplayDriver::open(&path).unwrap()),
        Keymap::default(),
        Theme::plain(),
    )
}

/// `:step N` sent N step commands, one by one: `:step 18446744073709551615` never ended (and
/// queued without bound on the debugger thread). It is one command now, which stops at the end
/// of the run (live) or of the recording (replay).
#[test]
fn step_with_a_huge_count_ends() {
    let (ops, end) = within(Duration::from_secs(60), || {
        let mut app = common::tiny_app("");
        command(&mut app, "step 18446744073709551615");
        let run = app.mirror.current().unwrap();
        (run.len(), run.finished())
    });
    assert!(end && ops > 100, "ran to the end: {ops} ops");
    let (run, finished) = within(Duration::from_secs(60), || {
        let mut app = shipped("output-buffer-disconnect.ron");
        app.act(mladb::tui::keys::Action::Restart);
        command(&mut app, "step 18446744073709551615");
        let m = &app.mirror;
        (m.current_number(), m.current().unwrap().finished())
    });
    assert_eq!((run, finished), (2, true), "through every recorded run");
    // And a count still steps exactly that many ops.
    let mut app = common::tiny_app("");
    let before = app.mirror.current().unwrap().len();
    command(&mut app, "step 5");
    assert_eq!(app.mirror.current().unwrap().len(), before + 5);
}

/// `:load /dev/zero` read without end (memory grew until the machine ran out); a directory, a
/// device or a FIFO is refused with one line, and the debugger goes on.
#[test]
fn load_refuses_what_is_not_a_session_file() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    let mut paths = vec!["/dev/zero".to_string(), dir.path().display().to_string()];
    match made {
        Ok(s) if s.success() => paths.push(fifo.display().to_string()),
        other => eprintln!("FIFO case skipped: mkfifo failed: {other:?}"),
    }
    for path in paths {
        let log = within(Duration::from_secs(30), move || {
            let mut app = common::tiny_app("");
            command(&mut app, &format!("load {path}"));
            assert!(app.mirror.current().is_some(), "still debugging");
            app.log.join("\n")
        });
        assert!(log.contains("not a regular file"), "{log}");
    }
    // And the command line says the same, exit 2.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mladb"))
        .args(["replay", "/dev/zero", "--json"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim(), "error: /dev/zero: not a regular file");
}
