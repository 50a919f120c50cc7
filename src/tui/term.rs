//! The terminal side: the event loop (generic over the ratatui backend, so tests drive it with a
//! `TestBackend`), and setting up and restoring a real terminal on quit, on error and on panic.

use super::app::App;
use super::ui;
use crate::error::{Error, Result};
use ratatui::backend::Backend;
use ratatui::crossterm::event::{
    self, DisableMouseCapture, EnableMouseCapture, Event, KeyEventKind,
};
use ratatui::crossterm::execute;
use ratatui::Terminal;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The termination signal received (SIGTERM, SIGHUP or SIGINT), 0 while none: the loop ends on
/// it as on `q`, and the terminal is restored.
static SIGNAL: std::sync::OnceLock<Arc<AtomicUsize>> = std::sync::OnceLock::new();

fn signal_received() -> usize {
    SIGNAL.get().map_or(0, |s| s.load(Ordering::Relaxed))
}

/// Catches SIGTERM, SIGHUP and SIGINT: the first sets [`SIGNAL`] (the loop quits within one
/// input wait and restores the terminal); a second of the same kind ends the process at once.
fn catch_signals() {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let flag = SIGNAL.get_or_init(|| Arc::new(AtomicUsize::new(0))).clone();
    for sig in [SIGTERM, SIGHUP, SIGINT] {
        let caught = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let _ = signal_hook::flag::register_conditional_shutdown(sig, 128 + sig, caught.clone());
        let _ = signal_hook::flag::register(sig, caught);
        let _ = signal_hook::flag::register_usize(sig, flag.clone(), sig as usize);
    }
}

/// Where input comes from.
pub trait EventSource {
    /// The next event, waiting at most `timeout`.
    fn next(&mut self, timeout: Duration) -> Result<Option<Event>>;
}

/// Input from the real terminal.
pub struct CrosstermEvents;

impl EventSource for CrosstermEvents {
    fn next(&mut self, timeout: Duration) -> Result<Option<Event>> {
        let io = |e: std::io::Error| Error::io("terminal", e);
        if event::poll(timeout).map_err(io)? {
            Ok(Some(event::read().map_err(io)?))
        } else {
            Ok(None)
        }
    }
}

/// Draws and handles input until the app quits. Redraws only when something changed, at most
/// once per input wait, so a stream of op events cannot flood the terminal.
pub fn run_loop<B: Backend, E: EventSource>(
    terminal: &mut Terminal<B>,
    app: &mut App,
    events: &mut E,
) -> Result<()> {
    let draw_err = |e: B::Error| Error::invalid(format!("drawing failed: {e}"));
    let mut dirty = true;
    while !app.quit {
        if signal_received() != 0 {
            break;
        }
        if app.tick() {
            dirty = true;
        }
        app.autosave_if_due();
        if dirty {
            terminal.draw(|f| ui::draw(f, app)).map_err(draw_err)?;
            dirty = false;
        }
        let wait = if app.mirror.busy.is_some() { 30 } else { 100 };
        match events.next(Duration::from_millis(wait))? {
            Some(Event::Key(k)) if k.kind == KeyEventKind::Press => app.on_key(k),
            Some(Event::Mouse(m)) => app.on_mouse(m),
            Some(Event::Resize(..)) => terminal.autoresize().map_err(draw_err)?,
            Some(_) => continue,
            None => continue,
        }
        // The update step for what the input changed (the selection, the tab).
        app.refresh_comparisons();
        dirty = true;
    }
    // On quit, the session is saved unasked too (when an autosave is set).
    app.save_on_quit();
    Ok(())
}

/// Runs the app on the real terminal: raw mode, alternate screen and mouse capture on, and all
/// three off again however the loop ends (a panic included).
pub fn run_terminal(mut app: App) -> Result<()> {
    let io = |e: std::io::Error| Error::io("terminal", e);
    catch_signals();
    let mut terminal = ratatui::try_init().map_err(io)?;
    // ratatui's hook restores raw mode and the screen; this one, installed after it and so run
    // first, also gives the mouse back.
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let _ = execute!(std::io::stdout(), DisableMouseCapture);
        previous(info);
    }));
    let result = execute!(std::io::stdout(), EnableMouseCapture)
        .map_err(io)
        .and_then(|_| run_loop(&mut terminal, &mut app, &mut CrosstermEvents));
    let _ = execute!(std::io::stdout(), DisableMouseCapture);
    ratatui::restore();
    // The cursor too (leaving the alternate screen does not show it again in every terminal).
    let _ = execute!(std::io::stdout(), ratatui::crossterm::cursor::Show);
    // Where the session went, on the restored terminal (the save may still be finishing).
    if let Some(line) = app.quit_line(Duration::from_secs(120)) {
        eprintln!("{line}");
    }
    // Ended by a signal: the terminal is restored and the session saved as on `q`; the exit
    // status says which signal, as the shell's would.
    let sig = signal_received();
    if sig != 0 {
        drop(terminal);
        result?;
        std::process::exit(128 + sig as i32);
    }
    result
}
