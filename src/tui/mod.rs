//! The interactive terminal debugger: ratatui + crossterm over the debugger service
//! ([`crate::service`]).
//!
//! * [`driver`]: where the service runs (a worker thread, or inline for tests and replays);
//! * [`app`]: the UI state machine; [`keys`]: bindings; [`ui`]: drawing; [`term`]: the event loop
//!   and terminal hygiene; [`theme`]: colours and `NO_COLOR`; [`logfile`]: the log file.
//!
//! The TUI knows nothing of the command line: `cli` turns its options into [`TuiArgs`].

pub mod app;
pub mod driver;
pub mod keys;
pub mod logfile;
pub mod term;
pub mod theme;
pub mod ui;

/// The debugger service under the name the UI gave it before it moved below the UI.
pub mod host {
    pub use crate::service::*;
}

/// Replays under the names the UI gave them before the replay host moved below the UI.
pub mod replay {
    pub use super::driver::ReplayDriver;
    pub use crate::service::ReplayHost;
}

use crate::error::Result;
use crate::service::HostSpec;
use crate::setup::{FlagOptions, RunSpec};
use std::path::PathBuf;

/// What the debugger is opened on: the run, its flags, and the key bindings to override.
#[derive(Debug, Clone)]
pub struct TuiArgs {
    pub setup: RunSpec,
    pub flags: FlagOptions,
    /// Key bindings to override, as RON (default: $MLADB_KEYS or ~/.config/mladb/keys.ron).
    pub keys: Option<PathBuf>,
    /// A reference dump every run is compared with (another engine's tensors), and the name
    /// map of its names.
    pub reference: Option<PathBuf>,
    pub name_map: Option<String>,
}

impl TuiArgs {
    /// What a bare `mladb` opens: glm5-tiny with the default schedule.
    pub fn default_demo() -> TuiArgs {
        TuiArgs {
            setup: RunSpec::with_layout(crate::setup::DEFAULT_LAYOUT),
            flags: FlagOptions::default(),
            keys: None,
            reference: None,
            name_map: None,
        }
    }

    /// Loads everything the TUI needs; errors here end the program before the screen changes.
    pub fn spec(&self) -> Result<HostSpec> {
        let Some(path) = &self.reference else {
            return HostSpec::prepare(&self.setup, &self.flags);
        };
        let dump = crate::debug::external::ExternalDump::load_reference(
            path,
            self.name_map.as_deref(),
            self.setup.max_memory_gb,
        )?;
        let mut spec = HostSpec::prepare(&self.setup.against(&dump)?, &self.flags)?;
        spec.reference = Some(std::sync::Arc::new(dump));
        Ok(spec)
    }

    pub fn keymap(&self) -> Result<keys::Keymap> {
        match self.keys.clone().or_else(keys::Keymap::default_path) {
            Some(path) => keys::Keymap::with_overrides(&path),
            None => Ok(keys::Keymap::default()),
        }
    }
}

/// `mladb tui`.
pub fn run(args: &TuiArgs) -> Result<()> {
    let spec = args.spec()?;
    let from_env = spec.flags.mla_disable && crate::setup::vllm_mla_disable()?;
    let keymap = args.keymap()?;
    let log = logfile::init();
    let driver = driver::ThreadDriver::start(spec)?;
    let mut app = app::App::new(Box::new(driver), keymap, theme::Theme::from_env());
    app.say(log_line(log));
    if from_env {
        app.mla_disable_env = true;
        app.say(format!("note: {}", crate::setup::VLLM_MLA_DISABLE_NOTE));
    }
    app.autosave = app::Autosave::from_env();
    if app.autosave.is_none() {
        app.autosave_off = Some(app::Autosave::why_off());
    }
    term::run_terminal(app)
}

/// `mladb replay FILE [--tour]`: the recorded session in the debugger, with no model and no
/// computation; a tour of a session without notes is refused before the screen changes.
pub fn run_replay(path: &std::path::Path, keys: Option<PathBuf>, tour: bool) -> Result<()> {
    let session = crate::session::Session::load(path)?;
    if tour && session.annotations.is_empty() {
        return Err(crate::Error::parse(
            path,
            "--tour: no notes are placed in this session's timeline, so there is nothing to tour \
             (open it without --tour; in the debugger :note TEXT places one, :save FILE keeps it)",
        ));
    }
    let driver = driver::ReplayDriver::new(session, path)?;
    let keymap = match keys.or_else(keys::Keymap::default_path) {
        Some(path) => keys::Keymap::with_overrides(&path)?,
        None => keys::Keymap::default(),
    };
    let log = logfile::init();
    let mut app = app::App::new(Box::new(driver), keymap, theme::Theme::from_env());
    app.say(log_line(log));
    term::run_terminal(app)
}

/// The first line of the debugger's log: where the log file is, or why there is none.
fn log_line(log: std::result::Result<PathBuf, String>) -> String {
    match log {
        Ok(path) => format!("log file: {} · ? for keys", path.display()),
        Err(why) => format!("no log file ({why}) · ? for keys"),
    }
}
