//! Quitting: the session is saved one last time where an autosave is set, and once the
//! terminal is restored one line says where it went (`session saved to PATH (mladb replay
//! PATH)`) or plainly why it was not saved.

use super::{App, Autosave};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

impl Autosave {
    /// Why [`Autosave::from_env`] found no place to save, for the line printed on quit.
    pub fn why_off() -> String {
        match std::env::var_os("MLADB_AUTOSAVE") {
            Some(v) => format!("autosave is off (MLADB_AUTOSAVE={})", v.to_string_lossy()),
            None => "autosave is off: neither $XDG_STATE_HOME nor $HOME is set".to_string(),
        }
    }
}

/// A path as a shell takes it: quoted where it holds anything but plain characters.
fn shell_word(path: &Path) -> String {
    let text = path.display().to_string();
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._-+=:,@%".contains(c);
    if !text.is_empty() && text.chars().all(plain) {
        text
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

/// The line for an autosave to `path` that ended with `result` (`None`: it did not finish).
pub fn saved_line(path: &Path, result: Option<&Result<PathBuf, String>>) -> String {
    match result {
        Some(Ok(p)) => format!(
            "session saved to {} (mladb replay {})",
            p.display(),
            shell_word(p)
        ),
        Some(Err(e)) => format!("session not saved: autosave failed: {e}"),
        None => format!(
            "session not saved: the autosave to {} did not finish",
            path.display()
        ),
    }
}

impl App {
    /// Takes in an autosave's result: logged, and kept for the line printed on quit.
    pub(super) fn autosaved(&mut self, result: Result<PathBuf, String>) {
        match &result {
            Ok(path) => tracing::info!("autosaved to {}", path.display()),
            Err(e) => self.say(format!("autosave failed: {e}")),
        }
        self.autosave_result = Some(result);
    }

    /// On quit: a command still running is cancelled, so that the save does not wait behind
    /// it, and the session is saved where an autosave is set.
    pub fn save_on_quit(&mut self) {
        if self.autosave.is_none() {
            return;
        }
        if self.mirror.busy.is_some() {
            self.driver.cancel();
        }
        self.autosave_now();
    }

    /// The line to print once the terminal is restored, waiting up to `wait` for the save to
    /// finish; `None` where there is nothing to say (a replay, which saves nothing unasked).
    pub fn quit_line(&mut self, wait: Duration) -> Option<String> {
        let Some(a) = &self.autosave else {
            return self
                .autosave_off
                .as_ref()
                .map(|why| format!("session not saved: {why} (:save FILE saves one)"));
        };
        let path = a.path.clone();
        let start = Instant::now();
        while self.autosave_result.is_none() && start.elapsed() < wait {
            if !self.tick() {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Some(saved_line(&path, self.autosave_result.as_ref()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quit_line_says_where_and_how_to_replay() {
        let p = Path::new("/tmp/state/autosave.ron");
        assert_eq!(
            saved_line(p, Some(&Ok(p.to_path_buf()))),
            "session saved to /tmp/state/autosave.ron (mladb replay /tmp/state/autosave.ron)"
        );
        let spaced = Path::new("/tmp/my state/it's.ron");
        assert_eq!(
            saved_line(spaced, Some(&Ok(spaced.to_path_buf()))),
            r"session saved to /tmp/my state/it's.ron (mladb replay '/tmp/my state/it'\''s.ron')"
        );
        assert_eq!(
            saved_line(p, Some(&Err("disk full".into()))),
            "session not saved: autosave failed: disk full"
        );
        assert_eq!(
            saved_line(p, None),
            "session not saved: the autosave to /tmp/state/autosave.ron did not finish"
        );
    }
}
