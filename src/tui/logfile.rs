//! The TUI's log goes to a file, never to the screen (the screen belongs to the TUI):
//! `$MLADB_LOG`, else `mladb.log` in the system's temporary folder. Lines go through `tracing`
//! to a subscriber holding the file, opened once in append mode; before `init` (and in the
//! commands, which print to the terminal) nothing is written.

use std::path::PathBuf;
use std::sync::Mutex;

/// Starts logging to the log file; returns its path, or why it cannot be written.
pub fn init() -> Result<PathBuf, String> {
    let path = std::env::var_os("MLADB_LOG")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("mladb.log"));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    // A second start in one process (tests) keeps the first subscriber.
    let _ = tracing_subscriber::fmt()
        .with_writer(Mutex::new(file))
        .with_ansi(false)
        .with_target(false)
        .try_init();
    tracing::info!("mladb started");
    Ok(path)
}
