//! Finding ops in a long trace: `/` searches op names, `:goto layer N` opens a layer. Both only
//! move the selection over what the UI already holds; nothing is computed.

use super::{App, Node, Overlay};
use ratatui::crossterm::event::{KeyCode, KeyEvent};

impl App {
    /// Keys typed into the search prompt: Enter searches, Esc closes it.
    pub(super) fn search_key(&mut self, key: KeyEvent, mut input: String) {
        match key.code {
            KeyCode::Esc => self.overlay = Overlay::None,
            KeyCode::Enter => {
                self.overlay = Overlay::None;
                self.search(input.trim().to_string());
            }
            KeyCode::Backspace => {
                input.pop();
                self.overlay = Overlay::Search { input };
            }
            KeyCode::Char(c) => {
                input.push(c);
                self.overlay = Overlay::Search { input };
            }
            _ => self.overlay = Overlay::Search { input },
        }
    }

    /// Searches for `text` from the selection on; it becomes the text `N` and `P` repeat.
    pub fn search(&mut self, text: String) {
        if text.is_empty() {
            return self.tell("search: type part of an op name after /");
        }
        self.last_search = Some(text);
        self.search_again(true);
    }

    /// The next (or previous) op after the selection whose name contains the last search,
    /// wrapping at the end of the run; its phase and layer open.
    pub fn search_again(&mut self, forward: bool) {
        let Some(text) = self.last_search.clone() else {
            let key = self.keymap.key_of(crate::tui::keys::Action::Search);
            return self.tell(format!(
                "no search yet: press {key} and type part of an op name"
            ));
        };
        let needle = text.to_lowercase();
        let Some(run) = self.mirror.current().filter(|r| !r.is_empty()) else {
            return self.tell(format!("/{text}: no ops to search yet"));
        };
        let n = run.len();
        let matches: Vec<usize> = (0..n)
            .filter(|&i| {
                let e = &run.events[i];
                self.shows_rank(e.rank) && e.name.to_lowercase().contains(&needle)
            })
            .collect();
        if matches.is_empty() {
            return self.tell(format!(
                "/{text}: no op name contains it ({n} ops searched)"
            ));
        }
        let (before, after) = self.search_start();
        // The first match after the selection, or the last before it; else wrap around.
        let found = if forward {
            matches.iter().position(|&i| i >= after)
        } else {
            matches.iter().rposition(|&i| i < before)
        };
        let (k, wrapped) = match found {
            Some(k) => (k, false),
            None if forward => (0, true),
            None => (matches.len() - 1, true),
        };
        let i = matches[k];
        self.follow = false;
        self.select(Node::Op(i));
        let wrapped = if wrapped { ", wrapped" } else { "" };
        self.notice = Some(format!(
            "/{text}: match {} of {}{wrapped}",
            k + 1,
            matches.len()
        ));
    }

    /// Where a search starts from the selection: ops before `.0` come before it, ops from `.1`
    /// on after it (a phase or layer row comes just before its first op).
    fn search_start(&self) -> (usize, usize) {
        let Some(run) = self.mirror.current() else {
            return (0, 0);
        };
        let first = |f: &dyn Fn(&crate::engine::trace::OpEvent) -> bool| {
            run.events.iter().position(f).unwrap_or(0)
        };
        match self.selected {
            Some(Node::Op(i)) => (i, i + 1),
            Some(Node::Layer(p, l)) => {
                let i = first(&|e| e.phase == p && e.layer == Some(l));
                (i, i)
            }
            Some(Node::Phase(p)) => {
                let i = first(&|e| e.phase == p);
                (i, i)
            }
            None => (0, 0),
        }
    }

    /// `:goto layer N`: selects layer N of the phase of the selection (else of the execution
    /// position) and opens it.
    pub(super) fn goto_layer(&mut self, text: &str) {
        let Some(info) = self.mirror.info.as_ref() else {
            return self.tell("goto layer: no model loaded yet");
        };
        let range = info.layers.clone();
        let usage = format!("usage: goto layer N (this run has layers {range:?})");
        let Ok(layer) = text.trim().parse::<usize>() else {
            return self.tell(usage);
        };
        let phase = match self.selected {
            Some(Node::Phase(p) | Node::Layer(p, _)) => Some(p),
            Some(Node::Op(_)) => self.selected_op().map(|(_, e)| e.phase),
            None => None,
        }
        .or_else(|| self.mirror.position().map(|e| e.phase));
        let Some(phase) = phase else {
            return self.tell("goto layer: no ops yet");
        };
        if !range.contains(&layer) {
            return self.tell(format!(
                "goto layer: layer {layer} is not in the run (layers {range:?})"
            ));
        }
        let ran = self.mirror.current().is_some_and(|r| {
            r.events
                .iter()
                .any(|e| e.phase == phase && e.layer == Some(layer))
        });
        if !ran {
            return self.tell(format!(
                "goto layer: layer {layer} of {phase} has not run yet"
            ));
        }
        let node = Node::Layer(phase, layer);
        self.follow = false;
        self.expanded.insert(Node::Phase(phase));
        self.auto_open = Some(node);
        self.selected = Some(node);
        self.notice = Some(format!("layer {layer} of {phase}"));
    }

    /// Why a search or jump went nowhere: on the status line until the next key, and in the
    /// log.
    pub(super) fn tell(&mut self, line: impl Into<String>) {
        let line = line.into();
        self.say(line.clone());
        self.notice = Some(line);
    }
}
