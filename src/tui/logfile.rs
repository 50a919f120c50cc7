//! The TUI's log goes to a file, never to the screen (the screen belongs to the TUI):
//! `$MLADB_LOG`, else `mladb.log` in the system's temporary folder.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

static LOG: Mutex<Option<PathBuf>> = Mutex::new(None);

/// Starts logging to the default file; returns its path.
pub fn init() -> PathBuf {
    let path = std::env::var_os("MLADB_LOG")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("mladb.log"));
    *LOG.lock().unwrap_or_else(|p| p.into_inner()) = Some(path.clone());
    write("mladb started");
    path
}

/// Appends a line with a timestamp (seconds since the epoch); does nothing before `init`.
pub fn write(line: &str) {
    let guard = LOG.lock().unwrap_or_else(|p| p.into_inner());
    let Some(path) = guard.as_ref() else { return };
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let _ = writeln!(f, "{t:.3} {line}");
    }
}
