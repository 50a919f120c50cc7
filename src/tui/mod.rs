//! The interactive terminal debugger: ratatui + crossterm over the debugger core.
//!
//! * [`host`]: the debugger core as the UI drives it (commands in, updates out);
//! * [`driver`]: where the host runs (a worker thread, or inline for tests);
//! * [`app`]: the UI state machine; [`keys`]: bindings; [`ui`]: drawing; [`term`]: the event loop
//!   and terminal hygiene; [`theme`]: colours and `NO_COLOR`; [`logfile`]: the log file.

pub mod app;
pub mod driver;
pub mod host;
pub mod keys;
pub mod logfile;
pub mod replay;
pub mod term;
pub mod theme;
pub mod ui;

use crate::cli::args::{FlagArgs, RunSetup};
use crate::error::Result;
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args, Debug, Clone)]
pub struct TuiArgs {
    #[command(flatten)]
    pub setup: RunSetup,
    #[command(flatten)]
    pub flags: FlagArgs,
    /// Key bindings to override, as RON (default: $MLADB_KEYS or ~/.config/mladb/keys.ron).
    #[arg(long)]
    pub keys: Option<PathBuf>,
}

impl TuiArgs {
    /// What a bare `mladb` opens: glm5-tiny with the default schedule.
    pub fn default_demo() -> TuiArgs {
        TuiArgs {
            setup: RunSetup::with_layout("glm5-tiny"),
            flags: FlagArgs::default(),
            keys: None,
        }
    }

    /// Loads everything the TUI needs; errors here end the program before the screen changes.
    pub fn spec(&self) -> Result<host::HostSpec> {
        let flags = self.flags.flags(self.setup.device)?;
        let p = self.setup.prepare(&flags)?;
        let source = self.setup.source()?;
        flags.engine_options(p.layers.clone(), true)?;
        Ok(host::HostSpec {
            model: Arc::new(p.model),
            source,
            backend: Arc::from(p.backend),
            schedule: p.schedule,
            layers: p.layers,
            flags,
        })
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
    let from_env = spec.flags.mla_disable && crate::cli::args::vllm_mla_disable()?;
    let keymap = args.keymap()?;
    let log = logfile::init();
    let driver = driver::ThreadDriver::start(spec)?;
    let mut app = app::App::new(Box::new(driver), keymap, theme::Theme::from_env());
    app.say(format!("log file: {} · ? for keys", log.display()));
    if from_env {
        app.mla_disable_env = true;
        app.say(format!("note: {}", crate::cli::args::VLLM_MLA_DISABLE_NOTE));
    }
    app.autosave = app::Autosave::from_env();
    term::run_terminal(app)
}

/// `mladb replay FILE`: the recorded session in the debugger, with no model and no computation.
pub fn run_replay(path: &std::path::Path, keys: Option<PathBuf>) -> Result<()> {
    let driver = replay::ReplayDriver::open(path)?;
    let keymap = match keys.or_else(keys::Keymap::default_path) {
        Some(path) => keys::Keymap::with_overrides(&path)?,
        None => keys::Keymap::default(),
    };
    let log = logfile::init();
    let mut app = app::App::new(Box::new(driver), keymap, theme::Theme::from_env());
    app.say(format!("log file: {} · ? for keys", log.display()));
    term::run_terminal(app)
}
