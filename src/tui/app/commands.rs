//! The command line (`:`) and the fault injection menu.

use super::{App, Overlay};
use crate::debug::breakpoint::Breakpoint;
use crate::engine::faults::{spec_of, Fault, Scope};
use crate::service::{cursor_of, Command, Goto};
use crate::tui::keys::Action;
use ratatui::crossterm::event::{KeyCode, KeyEvent};
use std::path::PathBuf;

impl App {
    /// The menu's scope for fault `i`: the phases it acts in, or its default scope when off.
    pub(super) fn menu_scope(&self, i: usize) -> Scope {
        let fault = Fault::ALL[i];
        self.mirror
            .flags
            .faults
            .scope(fault)
            .unwrap_or(fault.default_scope())
    }

    /// The fault menu: ↑/↓ choose a fault, ←/→ (or Tab) its scope, Enter injects it in that
    /// scope (or removes it, when it already acts there); other faults stay as they are.
    pub(super) fn inject_key(&mut self, key: KeyEvent, selected: usize, scope: Scope) {
        let n = Fault::ALL.len();
        let cycle = |by: usize| {
            let at = Scope::ALL.iter().position(|s| *s == scope).unwrap_or(0);
            Scope::ALL[(at + by) % Scope::ALL.len()]
        };
        match key.code {
            KeyCode::Right | KeyCode::Tab => {
                return self.overlay = Overlay::Inject {
                    selected,
                    scope: cycle(1),
                }
            }
            KeyCode::Left | KeyCode::BackTab => {
                return self.overlay = Overlay::Inject {
                    selected,
                    scope: cycle(Scope::ALL.len() - 1),
                }
            }
            _ => {}
        }
        let to = |app: &App, i: usize| Overlay::Inject {
            selected: i,
            scope: app.menu_scope(i),
        };
        match self.keymap.action(&key) {
            Some(Action::Down) => self.overlay = to(self, (selected + 1) % n),
            Some(Action::Up) => self.overlay = to(self, (selected + n - 1) % n),
            Some(Action::Expand) => {
                let fault = Fault::ALL[selected];
                let value = if self.mirror.flags.faults.scope(fault) == Some(scope) {
                    format!("-{}", fault.name())
                } else {
                    format!("+{}", spec_of(fault, scope))
                };
                self.follow = true;
                self.send(Command::SetFlag("inject".into(), value));
            }
            Some(Action::Cancel) | Some(Action::InjectMenu) | Some(Action::Quit) => {
                self.overlay = Overlay::None
            }
            _ => {}
        }
    }

    pub(super) fn command_key(&mut self, key: KeyEvent, mut input: String) {
        match key.code {
            KeyCode::Esc => {
                self.overlay = Overlay::None;
                self.back_to_learn();
            }
            KeyCode::Enter => {
                self.overlay = Overlay::None;
                self.execute(input.trim());
                self.back_to_learn();
            }
            KeyCode::Backspace => {
                input.pop();
                self.overlay = Overlay::Command { input };
            }
            KeyCode::Char(c) => {
                input.push(c);
                self.overlay = Overlay::Command { input };
            }
            _ => self.overlay = Overlay::Command { input },
        }
    }

    /// Runs a command-line command.
    pub fn execute(&mut self, line: &str) {
        if line.is_empty() {
            return;
        }
        self.say(format!(":{line}"));
        let (word, rest) = line
            .split_once(' ')
            .map_or((line, ""), |(w, r)| (w, r.trim()));
        match word {
            "break" | "b" => match Breakpoint::parse(rest) {
                Ok(bp) => self.send(Command::AddBreakpoint(bp)),
                Err(e) => self.say(format!("error: {e}")),
            },
            "delete" | "unbreak" if rest.is_empty() || rest == "all" => {
                self.send(Command::ClearBreakpoints)
            }
            "delete" | "unbreak" => match Breakpoint::parse(rest) {
                Ok(bp) => self.send(Command::RemoveBreakpoint(bp)),
                Err(e) => self.say(format!("error: {e}")),
            },
            "breakpoints" | "info" => self.list_breakpoints(),
            "goto" | "g" if rest == "layer" || rest.starts_with("layer ") => {
                self.goto_layer(&rest["layer".len()..])
            }
            "goto" | "g" => match parse_goto(rest) {
                Some(to) => self.send(Command::Goto(to)),
                None => self.say(GOTO_USAGE),
            },
            "run" | "continue" | "c" => self.run_command(Command::Continue),
            "step" | "s" => {
                let n: usize = rest.parse().unwrap_or(1).max(1);
                self.run_command(Command::Steps(n));
            }
            "next" | "n" => self.run_command(Command::NextLayer),
            "restart" => self.run_command(Command::Restart),
            "bisect" => self.send(Command::Bisect),
            "compare" => self.send(Command::Compare),
            "set" => match rest.split_once(' ') {
                Some((flag, value)) => {
                    self.follow = true;
                    self.send(Command::SetFlag(flag.trim().into(), value.trim().into()))
                }
                None => self.say(SET_USAGE),
            },
            "save" if !rest.is_empty() => {
                let (tensors, file) = match rest.strip_prefix("--tensors ") {
                    Some(f) => (true, f.trim()),
                    None => (false, rest),
                };
                let cursor = self.selected_op().map(|(_, e)| cursor_of(e));
                let notes = self.notes.clone();
                self.send(Command::Save {
                    path: PathBuf::from(file),
                    cursor,
                    notes,
                    tensors,
                    autosave: false,
                });
            }
            "load" if !rest.is_empty() => self.send(Command::Load(PathBuf::from(rest))),
            "note" if !rest.is_empty() => {
                self.notes.push(rest.to_string());
                // Where the user stands: the op selected and the pane shown, for a tour.
                let about = self.selected_op().map(|(_, e)| cursor_of(e));
                let pane = Some(self.pane_now());
                self.driver.send(Command::Note {
                    text: rest.to_string(),
                    about,
                    pane,
                });
                self.say(format!("noted: {rest}"));
            }
            "quit" | "q" => self.quit = true,
            "help" => self.overlay = Overlay::Help,
            _ => self.say(format!(
                "error: unknown command '{line}' (break SPEC, delete [SPEC], breakpoints, goto N|first-divergent|layer N, run, step [N], next, restart, bisect, compare, set KEY VALUE, save FILE, load FILE, note TEXT, quit)"
            )),
        }
    }

    /// `:breakpoints`: one log line per breakpoint.
    fn list_breakpoints(&mut self) {
        if self.mirror.breakpoints.is_empty() {
            return self.say("no breakpoints");
        }
        let lines: Vec<String> = self
            .mirror
            .breakpoints
            .iter()
            .enumerate()
            .map(|(i, bp)| format!("breakpoint {}: {bp}", i + 1))
            .collect();
        for line in lines {
            self.say(line);
        }
    }
}

/// What `:set` says when it is not given a key and a value.
pub const SET_USAGE: &str = "usage: set KEY VALUE (flags: mla-disable, prefill-path, \
     decode-path, force-dequant, device, dtype, inject NAME[@prefill|@decode|@both] (replaces; \
     +NAME adds, -NAME removes, none clears); schedule: tokens 3,141,59, prefill K, decode N)";

/// What `:goto` says when it cannot tell where to go.
pub const GOTO_USAGE: &str =
    "usage: goto N (an op index), goto first-divergent or goto layer N (a layer of this phase)";

/// `N`, `#N` or `first-divergent`.
fn parse_goto(text: &str) -> Option<Goto> {
    match text {
        "first-divergent" | "divergent" => Some(Goto::FirstDivergent),
        _ => text.trim_start_matches('#').parse().ok().map(Goto::Op),
    }
}
