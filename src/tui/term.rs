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
use std::time::Duration;

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
    app.autosave_now();
    Ok(())
}

/// Runs the app on the real terminal: raw mode, alternate screen and mouse capture on, and all
/// three off again however the loop ends (a panic included).
pub fn run_terminal(mut app: App) -> Result<()> {
    let io = |e: std::io::Error| Error::io("terminal", e);
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
    result
}
