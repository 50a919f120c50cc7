//! Key bindings: defaults in code, any of them overridable from a RON file, and the help screen
//! made from the same table.

use crate::error::{Error, Result};
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use std::path::Path;

/// Everything a key can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Action {
    Up,
    Down,
    PageUp,
    PageDown,
    Top,
    Bottom,
    Expand,
    Step,
    NextLayer,
    Continue,
    Restart,
    ToggleBreakpoint,
    ToggleMla,
    ToggleForceDequant,
    InjectMenu,
    Compare,
    Learn,
    Command,
    Search,
    SearchNext,
    SearchPrevious,
    NextTab,
    NextHead,
    NextRank,
    NextNote,
    PreviousNote,
    Notes,
    NotesDown,
    NotesUp,
    PaneDown,
    PaneUp,
    Follow,
    Narrower,
    Wider,
    Help,
    Cancel,
    Quit,
}

impl Action {
    pub const ALL: [Action; 37] = [
        Action::Up,
        Action::Down,
        Action::PageUp,
        Action::PageDown,
        Action::Top,
        Action::Bottom,
        Action::Expand,
        Action::Step,
        Action::NextLayer,
        Action::Continue,
        Action::Restart,
        Action::ToggleBreakpoint,
        Action::ToggleMla,
        Action::ToggleForceDequant,
        Action::InjectMenu,
        Action::Compare,
        Action::Learn,
        Action::Command,
        Action::Search,
        Action::SearchNext,
        Action::SearchPrevious,
        Action::NextTab,
        Action::NextHead,
        Action::NextRank,
        Action::NextNote,
        Action::PreviousNote,
        Action::Notes,
        Action::NotesDown,
        Action::NotesUp,
        Action::PaneDown,
        Action::PaneUp,
        Action::Follow,
        Action::Narrower,
        Action::Wider,
        Action::Help,
        Action::Cancel,
        Action::Quit,
    ];

    /// The action's name in key files (`next-layer`).
    pub fn name(self) -> String {
        format!("{self:?}")
            .chars()
            .enumerate()
            .flat_map(|(i, c)| {
                let lower = c.to_ascii_lowercase();
                if c.is_ascii_uppercase() && i > 0 {
                    vec!['-', lower]
                } else {
                    vec![lower]
                }
            })
            .collect()
    }

    pub fn from_name(name: &str) -> Option<Action> {
        Action::ALL.into_iter().find(|a| a.name() == name)
    }

    pub fn names() -> Vec<String> {
        Action::ALL.iter().map(|a| a.name()).collect()
    }

    pub fn description(self) -> &'static str {
        match self {
            Action::Up => "move up",
            Action::Down => "move down",
            Action::PageUp => "page up",
            Action::PageDown => "page down",
            Action::Top => "first row",
            Action::Bottom => "last row",
            Action::Expand => "expand / collapse a phase or layer",
            Action::Step => "step one op",
            Action::NextLayer => "step to the next layer",
            Action::Continue => "continue to a breakpoint or the end",
            Action::Restart => "restart the run",
            Action::ToggleBreakpoint => "toggle a breakpoint on the selected op or layer",
            Action::ToggleMla => "toggle MLA disable (re-executes, compares)",
            Action::ToggleForceDequant => "toggle force-dequantize",
            Action::InjectMenu => "fault injection menu (in prefill, decode or both)",
            Action::Compare => "comparison of the selected op",
            Action::Learn => "Learn view: weight absorption on this layer (n / p walk it)",
            Action::Command => "command line (break, goto, run, step, bisect, set, save, load)",
            Action::Search => "search op names: Enter selects the next op whose name has it",
            Action::SearchNext => "next op matching the last search",
            Action::SearchPrevious => "previous op matching the last search",
            Action::NextTab => "next pane: tensor / buffers / compare",
            Action::NextHead => "next attention head in the heat map",
            Action::NextRank => "tree shows one tensor-parallel rank, the next, then all",
            Action::NextNote => "replay: next note (moves to its op and pane, shows it whole)",
            Action::PreviousNote => "replay: previous note",
            Action::Notes => "show / hide the notes pane",
            Action::NotesDown => "scroll the notes pane down",
            Action::NotesUp => "scroll the notes pane up",
            Action::PaneDown => "scroll the right pane (tensor / buffers / compare) down",
            Action::PaneUp => "scroll the right pane up",
            Action::Follow => "jump to the execution position",
            Action::Narrower => "narrower execution tree",
            Action::Wider => "wider execution tree",
            Action::Help => "this help",
            Action::Cancel => "close a view; cancel a running command",
            Action::Quit => "quit",
        }
    }

    fn default_keys(self) -> &'static [&'static str] {
        match self {
            Action::Up => &["k", "up"],
            Action::Down => &["j", "down"],
            Action::PageUp => &["pageup", "ctrl-u"],
            Action::PageDown => &["pagedown", "ctrl-d"],
            Action::Top => &["g", "home"],
            Action::Bottom => &["G", "end"],
            Action::Expand => &["enter", "space"],
            Action::Step => &["s"],
            Action::NextLayer => &["n"],
            Action::Continue => &["c"],
            Action::Restart => &["R"],
            Action::ToggleBreakpoint => &["b"],
            Action::ToggleMla => &["m"],
            Action::ToggleForceDequant => &["f"],
            Action::InjectMenu => &["i"],
            Action::Compare => &["d"],
            Action::Learn => &["l"],
            Action::Command => &[":"],
            Action::Search => &["/"],
            Action::SearchNext => &["N"],
            Action::SearchPrevious => &["P"],
            Action::NextTab => &["tab"],
            Action::NextHead => &["h"],
            Action::NextRank => &["r"],
            Action::NextNote => &["}"],
            Action::PreviousNote => &["{"],
            Action::Notes => &["o"],
            Action::NotesDown => &["J"],
            Action::NotesUp => &["K"],
            Action::PaneDown => &[">"],
            Action::PaneUp => &["<"],
            Action::Follow => &["."],
            Action::Narrower => &["["],
            Action::Wider => &["]"],
            Action::Help => &["?"],
            Action::Cancel => &["esc"],
            Action::Quit => &["q", "ctrl-c"],
        }
    }
}

/// One key with its modifiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    code: KeyCode,
    ctrl: bool,
}

impl Key {
    /// `j`, `G`, `?`, `enter`, `esc`, `tab`, `space`, `up`, `pageup`, `home`, `f5`, `ctrl-c`.
    pub fn parse(text: &str) -> Result<Key> {
        let (ctrl, name) = match text.strip_prefix("ctrl-") {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let code = match name {
            "enter" => KeyCode::Enter,
            "esc" => KeyCode::Esc,
            "tab" => KeyCode::Tab,
            "space" => KeyCode::Char(' '),
            "up" => KeyCode::Up,
            "down" => KeyCode::Down,
            "left" => KeyCode::Left,
            "right" => KeyCode::Right,
            "pageup" => KeyCode::PageUp,
            "pagedown" => KeyCode::PageDown,
            "home" => KeyCode::Home,
            "end" => KeyCode::End,
            "backspace" => KeyCode::Backspace,
            f if f.len() > 1 && f.starts_with('f') && f[1..].parse::<u8>().is_ok() => {
                KeyCode::F(f[1..].parse().expect("checked"))
            }
            c if c.chars().count() == 1 => KeyCode::Char(c.chars().next().expect("one char")),
            other => return Err(Error::invalid(format!("unknown key '{other}'"))),
        };
        Ok(Key { code, ctrl })
    }

    fn matches(&self, event: &KeyEvent) -> bool {
        let ctrl = event.modifiers.contains(KeyModifiers::CONTROL);
        ctrl == self.ctrl && self.code == event.code
    }

    pub fn label(&self) -> String {
        let name = match self.code {
            KeyCode::Enter => "Enter".to_string(),
            KeyCode::Esc => "Esc".to_string(),
            KeyCode::Tab => "Tab".to_string(),
            KeyCode::Char(' ') => "Space".to_string(),
            KeyCode::Up => "↑".to_string(),
            KeyCode::Down => "↓".to_string(),
            KeyCode::Left => "←".to_string(),
            KeyCode::Right => "→".to_string(),
            KeyCode::PageUp => "PgUp".to_string(),
            KeyCode::PageDown => "PgDn".to_string(),
            KeyCode::Home => "Home".to_string(),
            KeyCode::End => "End".to_string(),
            KeyCode::F(n) => format!("F{n}"),
            KeyCode::Char(c) => c.to_string(),
            other => format!("{other:?}"),
        };
        if self.ctrl {
            format!("Ctrl-{name}")
        } else {
            name
        }
    }
}

/// A key file's map, in its order, refusing an action named twice (RON maps would keep the last
/// silently).
struct Overrides(Vec<(String, Vec<String>)>);

impl<'de> serde::Deserialize<'de> for Overrides {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Overrides;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map of action names to lists of keys")
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(
                self,
                mut m: M,
            ) -> std::result::Result<Overrides, M::Error> {
                let mut out: Vec<(String, Vec<String>)> = Vec::new();
                while let Some((name, keys)) = m.next_entry::<String, Vec<String>>()? {
                    if out.iter().any(|(n, _)| *n == name) {
                        return Err(serde::de::Error::custom(format!(
                            "action '{name}' is named twice"
                        )));
                    }
                    out.push((name, keys));
                }
                Ok(Overrides(out))
            }
        }
        d.deserialize_map(Visitor)
    }
}

#[derive(Debug, Clone)]
pub struct Keymap {
    bindings: Vec<(Action, Vec<Key>)>,
}

impl Default for Keymap {
    fn default() -> Keymap {
        Keymap {
            bindings: Action::ALL
                .iter()
                .map(|&a| {
                    (
                        a,
                        a.default_keys()
                            .iter()
                            .map(|k| Key::parse(k).expect("default keys parse"))
                            .collect(),
                    )
                })
                .collect(),
        }
    }
}

impl Keymap {
    /// The defaults with the actions a RON file names rebound, e.g.
    /// `{ "step": ["s", "f10"], "next-layer": ["f11"] }`.
    pub fn with_overrides(path: &Path) -> Result<Keymap> {
        let text = crate::input::read_text_capped(path, crate::input::MAX_KEYS_BYTES)?;
        let overrides: Overrides = ron::from_str(&text).map_err(|e| Error::ron(path, e))?;
        let mut map = Keymap::default();
        for (name, keys) in overrides.0 {
            let action = Action::from_name(&name).ok_or_else(|| {
                Error::parse(
                    path,
                    format!(
                        "unknown action '{name}' (actions: {})",
                        Action::names().join(", ")
                    ),
                )
            })?;
            let keys = keys
                .iter()
                .map(|k| {
                    Key::parse(k).map_err(|e| Error::parse(path, format!("{}: {e}", action.name())))
                })
                .collect::<Result<Vec<Key>>>()?;
            if keys.is_empty() {
                return Err(Error::parse(
                    path,
                    format!("{}: no keys (every action needs one)", action.name()),
                ));
            }
            if let Some(slot) = map.bindings.iter_mut().find(|(a, _)| *a == action) {
                slot.1 = keys;
            }
        }
        map.conflicts().map_err(|e| Error::parse(path, e))?;
        Ok(map)
    }

    /// A key bound to two actions, or Ctrl-C bound to anything but quit, named with both.
    fn conflicts(&self) -> std::result::Result<(), String> {
        let ctrl_c = Key {
            code: KeyCode::Char('c'),
            ctrl: true,
        };
        for (i, (a, keys)) in self.bindings.iter().enumerate() {
            for k in keys {
                if *k == ctrl_c && *a != Action::Quit {
                    return Err(format!("Ctrl-C is bound to {} but always quits", a.name()));
                }
                if let Some((b, _)) = self.bindings[i + 1..]
                    .iter()
                    .find(|(_, other)| other.contains(k))
                {
                    return Err(format!(
                        "{} is bound to both {} and {}",
                        k.label(),
                        a.name(),
                        b.name()
                    ));
                }
            }
        }
        Ok(())
    }

    /// The key file to use: `$MLADB_KEYS`, else `~/.config/mladb/keys.ron` when it exists.
    pub fn default_path() -> Option<std::path::PathBuf> {
        if let Some(p) = std::env::var_os("MLADB_KEYS") {
            return Some(p.into());
        }
        let config = std::env::var_os("XDG_CONFIG_HOME")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".config"))
            })?;
        let path = config.join("mladb").join("keys.ron");
        path.exists().then_some(path)
    }

    pub fn action(&self, event: &KeyEvent) -> Option<Action> {
        // Ctrl-C always quits, whatever a key file says.
        if event.code == KeyCode::Char('c') && event.modifiers.contains(KeyModifiers::CONTROL) {
            return Some(Action::Quit);
        }
        self.bindings
            .iter()
            .find(|(_, keys)| keys.iter().any(|k| k.matches(event)))
            .map(|(a, _)| *a)
    }

    /// The first key of an action, for hints ("press d").
    pub fn key_of(&self, action: Action) -> String {
        self.bindings
            .iter()
            .find(|(a, _)| *a == action)
            .and_then(|(_, k)| k.first())
            .map(Key::label)
            .unwrap_or_else(|| "?".into())
    }

    /// (keys, description) of every action, for the help screen.
    pub fn help(&self) -> Vec<(String, &'static str)> {
        self.bindings
            .iter()
            .map(|(a, keys)| {
                (
                    keys.iter().map(Key::label).collect::<Vec<_>>().join(" "),
                    a.description(),
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(c: KeyCode, m: KeyModifiers) -> KeyEvent {
        KeyEvent::new(c, m)
    }

    #[test]
    fn defaults_and_overrides() {
        let map = Keymap::default();
        assert_eq!(
            map.action(&key(KeyCode::Char('s'), KeyModifiers::NONE)),
            Some(Action::Step)
        );
        assert_eq!(
            map.action(&key(KeyCode::Char('c'), KeyModifiers::CONTROL)),
            Some(Action::Quit)
        );
        assert_eq!(
            map.action(&key(KeyCode::Down, KeyModifiers::NONE)),
            Some(Action::Down)
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.ron");
        std::fs::write(&path, r#"{ "step": ["f10"], "quit": ["x", "ctrl-q"] }"#).unwrap();
        let map = Keymap::with_overrides(&path).unwrap();
        assert_eq!(
            map.action(&key(KeyCode::F(10), KeyModifiers::NONE)),
            Some(Action::Step)
        );
        assert_eq!(
            map.action(&key(KeyCode::Char('s'), KeyModifiers::NONE)),
            None
        );
        assert_eq!(
            map.action(&key(KeyCode::Char('q'), KeyModifiers::CONTROL)),
            Some(Action::Quit)
        );
        assert_eq!(map.key_of(Action::Step), "F10");
        std::fs::write(&path, r#"{ "jump": ["j"] }"#).unwrap();
        assert!(Keymap::with_overrides(&path)
            .unwrap_err()
            .to_string()
            .contains("keys.ron"));
        std::fs::write(&path, r#"{ "step": ["hyper-s"] }"#).unwrap();
        assert!(Keymap::with_overrides(&path).is_err());
    }

    #[test]
    fn the_debugger_can_always_be_quit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.ron");
        let err = |text: &str| {
            std::fs::write(&path, text).unwrap();
            Keymap::with_overrides(&path).unwrap_err().to_string()
        };
        assert!(err(r#"{ "quit": [] }"#).contains("quit: no keys"));
        let e = err(r#"{ "quit": ["j"] }"#);
        assert!(e.contains("j is bound to both down and quit"), "{e}");
        let e = err(r#"{ "step": ["ctrl-c"] }"#);
        assert!(e.contains("Ctrl-C is bound to step"), "{e}");
        let e = err(r#"{ "step": ["x"], "step": ["y"] }"#);
        assert!(e.contains("'step' is named twice"), "{e}");
        // Ctrl-C quits even when the file rebinds quit to other keys.
        std::fs::write(&path, r#"{ "quit": ["x"] }"#).unwrap();
        let map = Keymap::with_overrides(&path).unwrap();
        assert_eq!(
            map.action(&key(KeyCode::Char('c'), KeyModifiers::CONTROL)),
            Some(Action::Quit)
        );
        assert!(Keymap::default().conflicts().is_ok());
    }
}
