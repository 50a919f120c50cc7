//! The TUI's state and how input changes it. Everything the screen shows is derived from here;
//! the only way in is [`App::on_key`], [`App::on_mouse`] and [`App::tick`] (updates from the
//! debugger), so the state machine can be driven synchronously in tests.

use super::driver::Driver;
use super::keys::{Action, Keymap};
use super::theme::Theme;
use crate::debug::breakpoint::Breakpoint;
use crate::debug::controller::Stop;
use crate::debug::idle::Idle;
use crate::debug::{Flags, RunRecord};
use crate::engine::faults::Scope;
use crate::engine::trace::{OpEvent, Phase};
use crate::service::{cursor_of, AuxKind, Command, Info, Update};
use ratatui::crossterm::event::KeyEvent;
use ratatui::layout::Rect;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

mod commands;
mod derived;
mod navigation;
mod pane;
mod progress;
mod quit;
mod search;
mod summary;
mod tour;
mod walk;

pub use derived::{Against, Divergence, Marks};
pub use pane::PaneScroll;
pub use progress::{system_clock, Clock, Started};
pub use summary::{op_health, Health, LayerSummary, Summaries};
pub use tour::{Tour, NO_NOTES};
pub use walk::{WalkStep, WalkTarget, WALK};

/// The right-hand pane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tab {
    Tensor,
    Buffers,
    Compare,
}

impl Tab {
    pub const ALL: [Tab; 3] = [Tab::Tensor, Tab::Buffers, Tab::Compare];

    pub fn title(self) -> &'static str {
        match self {
            Tab::Tensor => "Tensor",
            Tab::Buffers => "Buffers",
            Tab::Compare => "Compare",
        }
    }
}

/// A view over the main screen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Overlay {
    None,
    Help,
    Learn {
        scroll: u16,
    },
    /// The fault menu: the row selected and the scope Enter would inject it in.
    Inject {
        selected: usize,
        scope: Scope,
    },
    Command {
        input: String,
    },
    /// The search prompt (`/`): part of an op name.
    Search {
        input: String,
    },
}

/// A row of the execution tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Node {
    Phase(Phase),
    Layer(Phase, usize),
    Op(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    pub node: Node,
    pub depth: u8,
}

/// The debugger's state as the UI knows it, built from updates.
#[derive(Default)]
pub struct Mirror {
    pub info: Option<Info>,
    /// Runs by number; the last is the current one.
    pub runs: Vec<RunRecord>,
    pub comparison: Option<usize>,
    pub aux: HashMap<(usize, AuxKind), Arc<RunRecord>>,
    pub breakpoints: Vec<Breakpoint>,
    pub flags: Flags,
    pub busy: Option<String>,
    pub last_stop: Option<Stop>,
    /// Flags and faults that had nothing to act on (shown as such in the header).
    pub idle: Vec<Idle>,
}

impl Mirror {
    pub fn current(&self) -> Option<&RunRecord> {
        self.runs.last()
    }

    pub fn current_number(&self) -> usize {
        self.runs.len().saturating_sub(1)
    }

    pub fn comparison_run(&self) -> Option<&RunRecord> {
        self.comparison.and_then(|i| self.runs.get(i))
    }

    pub fn aux(&self, kind: AuxKind) -> Option<&RunRecord> {
        self.aux.get(&(self.current_number(), kind)).map(|r| &**r)
    }

    /// The last op executed in the current run.
    pub fn position(&self) -> Option<&OpEvent> {
        self.current().and_then(|r| r.events.last())
    }

    pub fn layout(&self) -> Option<&crate::model::Layout> {
        self.info.as_ref().map(|i| &i.layout)
    }
}

pub struct App {
    driver: Box<dyn Driver>,
    pub mirror: Mirror,
    pub keymap: Keymap,
    pub theme: Theme,
    pub tab: Tab,
    pub overlay: Overlay,
    pub selected: Option<Node>,
    /// Phases and layers the user opened (phases also open as the selection reaches them).
    pub expanded: HashSet<Node>,
    /// The layer holding the op a step, search or jump selected last: open while it is, so
    /// that the tree shows where the selection is and every other layer stays collapsed.
    pub auto_open: Option<Node>,
    /// The text `N`/`P` search for again.
    pub last_search: Option<String>,
    /// A line for the status line until the next key (a search's result, say).
    pub notice: Option<String>,
    /// Where the time comes from (the ETA of a long command); tests set their own.
    pub clock: Clock,
    /// When the running command started, for its ETA.
    pub started: Option<Started>,
    /// First line of the help shown (it scrolls where the screen is too small for it).
    pub help_scroll: u16,
    /// First tree row shown.
    pub scroll: usize,
    /// How far the right pane is scrolled.
    pub pane_scroll: PaneScroll,
    /// The selection follows the execution position.
    pub follow: bool,
    /// Attention head shown in heat maps and per-head figures.
    pub head: usize,
    /// Width of the execution tree, in percent of the screen.
    pub tree_percent: u16,
    pub log: Vec<String>,
    pub notes: Vec<String>,
    pub quit: bool,
    /// Screen areas of the last draw, for the mouse.
    pub areas: Areas,
    /// First divergent op per (run, ops so far, comparison), so whole-run comparisons are
    /// computed once per change rather than once per frame (see [`App::refresh_comparisons`]).
    pub divergence_cache: HashMap<(usize, usize, Against), Divergence>,
    /// Per (run, comparison run): each op's verdict against the comparison so far, judged in
    /// execution order (see [`Marks`]).
    pub mark_cache: HashMap<(usize, usize), Marks>,
    /// Per run: each op's verdict against the reference dump (`--reference`), as for
    /// `mark_cache`.
    pub reference_marks: HashMap<usize, Marks>,
    /// Per (run, comparison run): each layer's summary for its tree row (see [`Summaries`]).
    pub summary_cache: HashMap<(usize, Option<usize>), Summaries>,
    /// Where and how often the session is saved unasked (and on quit); `None`: never.
    pub autosave: Option<Autosave>,
    /// Why a live session has no autosave, said on quit (`None` in replays: nothing to say).
    pub autosave_off: Option<String>,
    /// The last autosave's result, once the debugger reported it.
    pub autosave_result: Option<Result<PathBuf, String>>,
    /// MLA disable came on from `VLLM_MLA_DISABLE` (the header says so).
    pub mla_disable_env: bool,
    /// The tensor-parallel rank whose ops the tree shows; `None`: every rank's.
    pub rank_view: Option<usize>,
    /// The Learn view's walk step (`n` / `p`), once started.
    pub learn_step: Option<usize>,
    /// The phase the walk's last step moved the selection from.
    pub learn_from: Option<Phase>,
    /// The notes pane and where a replay's tour stands.
    pub tour: Tour,
}

/// The autosave: a path, an interval, and when it last ran.
#[derive(Debug, Clone)]
pub struct Autosave {
    pub path: PathBuf,
    pub every: std::time::Duration,
    pub last: std::time::Instant,
}

impl Autosave {
    /// `$MLADB_AUTOSAVE` (a path; `off` disables), else `$XDG_STATE_HOME/mladb/autosave.ron`,
    /// else `~/.local/state/mladb/autosave.ron`; every five minutes and on quit.
    pub fn from_env() -> Option<Autosave> {
        let path = match std::env::var_os("MLADB_AUTOSAVE") {
            Some(p) if p == "off" || p.is_empty() => return None,
            Some(p) => PathBuf::from(p),
            None => std::env::var_os("XDG_STATE_HOME")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local").join("state"))
                })?
                .join("mladb")
                .join("autosave.ron"),
        };
        Some(Autosave {
            path,
            every: std::time::Duration::from_secs(300),
            last: std::time::Instant::now(),
        })
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Areas {
    pub tree: Rect,
    pub tabs: Rect,
    /// The right pane's body (the mouse wheel scrolls it there).
    pub pane: Rect,
}

impl App {
    pub fn new(driver: Box<dyn Driver>, keymap: Keymap, theme: Theme) -> App {
        let mut app = App {
            driver,
            mirror: Mirror::default(),
            keymap,
            theme,
            tab: Tab::Tensor,
            overlay: Overlay::None,
            selected: None,
            expanded: HashSet::new(),
            auto_open: None,
            last_search: None,
            notice: None,
            clock: system_clock(),
            started: None,
            help_scroll: 0,
            scroll: 0,
            pane_scroll: PaneScroll::default(),
            follow: true,
            head: 0,
            tree_percent: 40,
            log: Vec::new(),
            notes: Vec::new(),
            quit: false,
            areas: Areas::default(),
            divergence_cache: HashMap::new(),
            mark_cache: HashMap::new(),
            reference_marks: HashMap::new(),
            summary_cache: HashMap::new(),
            autosave: None,
            autosave_off: None,
            autosave_result: None,
            mla_disable_env: false,
            rank_view: None,
            learn_step: None,
            learn_from: None,
            tour: Tour::default(),
        };
        app.tick();
        app
    }

    /// Saves the session to the autosave location now (failures are logged, never raised).
    pub fn autosave_now(&mut self) {
        let Some(a) = &mut self.autosave else { return };
        a.last = std::time::Instant::now();
        let path = a.path.clone();
        self.autosave_result = None;
        if let Some(dir) = path.parent() {
            if let Err(e) = std::fs::create_dir_all(dir) {
                self.autosaved(Err(format!("{}: {e}", dir.display())));
                return;
            }
        }
        let cursor = self.selected_op().map(|(_, e)| cursor_of(e));
        let notes = self.notes.clone();
        self.send(Command::Save {
            path,
            cursor,
            notes,
            tensors: false,
            autosave: true,
        });
    }

    /// Autosaves when the interval has passed and the debugger is idle.
    pub fn autosave_if_due(&mut self) {
        let due = self
            .autosave
            .as_ref()
            .is_some_and(|a| a.last.elapsed() >= a.every);
        if due && self.mirror.busy.is_none() {
            self.autosave_now();
        }
    }

    fn send(&mut self, command: Command) {
        self.driver.send(command);
        self.tick();
    }

    pub fn say(&mut self, line: impl Into<String>) {
        let line = line.into();
        tracing::info!("{line}");
        self.log.push(line);
        if self.log.len() > 500 {
            self.log.drain(..100);
        }
    }

    /// Takes in what the debugger reported. Returns whether anything changed.
    pub fn tick(&mut self) -> bool {
        let updates = self.driver.poll();
        let changed = !updates.is_empty();
        for u in updates {
            self.apply(u);
        }
        if changed {
            self.refresh_comparisons();
        }
        changed
    }

    fn apply(&mut self, update: Update) {
        let m = &mut self.mirror;
        match update {
            Update::Loaded(info) => {
                self.say(format!(
                    "loaded {} ({} layers, {}) from {}",
                    info.layout.name,
                    info.layout.num_layers,
                    info.layout.family.hf_model_type(),
                    info.source
                ));
                self.divergence_cache.clear();
                self.mark_cache.clear();
                self.reference_marks.clear();
                self.summary_cache.clear();
                self.auto_open = None;
                let m = &mut self.mirror;
                m.info = Some(*info);
                m.runs.clear();
                m.aux.clear();
                m.comparison = None;
                self.selected = None;
                self.follow = true;
                self.tour_reset();
            }
            Update::Op {
                run,
                flags,
                event,
                output,
            } => {
                while m.runs.len() <= run {
                    m.runs.push(RunRecord::new(flags));
                }
                m.runs[run].push(*event, output);
                self.progress_op();
                if self.follow {
                    self.select_position();
                }
            }
            Update::Recomputed { run, event, output } => {
                if let Some(r) = m.runs.get_mut(run) {
                    r.replace(event.index, *event, output);
                }
                // What was judged of the run from its old values is judged again.
                self.mark_cache.retain(|k, _| k.0 != run);
                self.reference_marks.remove(&run);
                self.divergence_cache.retain(|k, _| k.0 != run);
                self.summary_cache.retain(|k, _| k.0 != run);
            }
            Update::Comparison(c) => m.comparison = c,
            Update::Finished {
                run,
                outcome,
                error,
                text,
            } => {
                if let Some(r) = m.runs.get_mut(run) {
                    r.outcome = outcome.clone();
                    r.error = error.clone();
                }
                match (outcome, error) {
                    (Some(o), _) => self.say(format!(
                        "run {run} finished: generated {}{}, next token {}",
                        o.generated_text(),
                        text.as_ref().map_or(String::new(), |t| format!(
                            " ({})",
                            t.iter()
                                .map(|g| crate::model::tokenizer::shown(g))
                                .collect::<Vec<_>>()
                                .join(" ")
                        )),
                        o.next_text()
                    )),
                    (_, Some(e)) => self.say(format!("run {run} failed: {e}")),
                    _ => {}
                }
            }
            Update::Stopped(stop) => {
                if let Stop::Failed(e) = &stop {
                    self.say(format!("engine error: {e}"));
                }
                if stop == Stop::Cancelled {
                    self.say("cancelled");
                }
                self.mirror.last_stop = Some(stop);
                if self.follow {
                    self.select_position();
                }
            }
            Update::Breakpoints(b) => m.breakpoints = b,
            Update::Flags(f) => m.flags = f,
            Update::Schedule(s) => {
                if let Some(info) = &mut m.info {
                    info.schedule = s;
                }
            }
            Update::Idle(idle) => m.idle = idle,
            Update::Aux { run, kind, record } => {
                m.aux.insert((run, kind), record);
            }
            Update::Select(index) => {
                self.follow = false;
                self.select(Node::Op(index));
            }
            Update::Log(line) => self.say(line),
            Update::Autosaved(result) => self.autosaved(result),
            Update::Notes(notes) => self.notes = notes,
            u @ (Update::Tour(_) | Update::NoteReached { .. }) => self.tour_update(u),
            Update::Error(e) => self.say(format!("error: {e}")),
            Update::Busy(b) => {
                m.busy = b;
                self.busy_changed(self.mirror.busy.is_some());
            }
        }
    }

    pub fn on_key(&mut self, key: KeyEvent) {
        self.notice = None;
        // Ctrl-C quits from the prompts too, which otherwise take every key as text.
        if let Overlay::Command { .. } | Overlay::Search { .. } = self.overlay {
            if self.keymap.action(&key) == Some(Action::Quit)
                && key
                    .modifiers
                    .contains(ratatui::crossterm::event::KeyModifiers::CONTROL)
            {
                self.quit = true;
                return;
            }
        }
        match self.overlay.clone() {
            Overlay::Command { input } => return self.command_key(key, input),
            Overlay::Search { input } => return self.search_key(key, input),
            Overlay::Inject { selected, scope } => return self.inject_key(key, selected, scope),
            Overlay::Help => {
                // j/k and the page keys scroll a help taller than the screen; any other key
                // closes it (quit quits).
                let s = self.help_scroll;
                match self.keymap.action(&key) {
                    Some(Action::Down) => self.help_scroll = s.saturating_add(1),
                    Some(Action::Up) => self.help_scroll = s.saturating_sub(1),
                    Some(Action::PageDown) => self.help_scroll = s.saturating_add(10),
                    Some(Action::PageUp) => self.help_scroll = s.saturating_sub(10),
                    other => {
                        self.overlay = Overlay::None;
                        self.quit = other == Some(Action::Quit);
                    }
                }
                return;
            }
            Overlay::Learn { scroll } => return self.learn_key(key, scroll),
            Overlay::None => {}
        }
        if let Some(action) = self.keymap.action(&key) {
            self.act(action);
        }
    }

    pub fn act(&mut self, action: Action) {
        match action {
            Action::Up => self.move_selection(-1),
            Action::Down => self.move_selection(1),
            Action::PageUp => self.move_selection(-10),
            Action::PageDown => self.move_selection(10),
            Action::Top => self.move_selection(isize::MIN / 2),
            Action::Bottom => self.move_selection(isize::MAX / 2),
            Action::Expand => self.toggle_expand(),
            Action::Step => self.run_command(Command::Step),
            Action::NextLayer => self.run_command(Command::NextLayer),
            Action::Continue => self.run_command(Command::Continue),
            Action::Restart => self.run_command(Command::Restart),
            Action::ToggleBreakpoint => {
                let bp = match self.selected {
                    Some(Node::Op(_)) => self
                        .selected_op()
                        .map(|(_, e)| Breakpoint::Op(e.name.clone())),
                    Some(Node::Layer(_, l)) => Some(Breakpoint::Layer(l)),
                    _ => None,
                };
                match bp {
                    Some(bp) => self.send(Command::ToggleBreakpoint(bp)),
                    None => self.say("select an op or a layer to set a breakpoint"),
                }
            }
            Action::ToggleMla => {
                let on = !self.mirror.flags.mla_disable;
                self.follow = true;
                self.send(Command::SetFlag(
                    "mla-disable".into(),
                    if on { "on" } else { "off" }.into(),
                ));
                self.tab = Tab::Compare;
            }
            Action::ToggleForceDequant => {
                let on = !self.mirror.flags.force_dequant;
                self.send(Command::SetFlag(
                    "force-dequant".into(),
                    if on { "on" } else { "off" }.into(),
                ));
            }
            Action::InjectMenu => {
                self.overlay = Overlay::Inject {
                    selected: 0,
                    scope: self.menu_scope(0),
                }
            }
            Action::Compare => {
                self.tab = Tab::Compare;
                let finished = self.mirror.current().is_some_and(|r| r.finished());
                if finished && self.mirror.aux(AuxKind::OtherPath).is_none() {
                    self.send(Command::Compare);
                } else if !finished {
                    self.say(format!(
                        "absorbed vs naive and prefill vs decode need a finished run: press {} to continue",
                        self.keymap.key_of(Action::Continue)
                    ));
                }
            }
            Action::Learn => {
                self.overlay = Overlay::Learn { scroll: 0 };
                let finished = self.mirror.current().is_some_and(|r| r.finished());
                if finished && self.mirror.aux(AuxKind::OtherPath).is_none() {
                    self.send(Command::Compare);
                }
            }
            Action::Command => {
                self.overlay = Overlay::Command {
                    input: String::new(),
                }
            }
            Action::Search => {
                self.overlay = Overlay::Search {
                    input: String::new(),
                }
            }
            Action::SearchNext => self.search_again(true),
            Action::SearchPrevious => self.search_again(false),
            Action::NextTab => {
                let i = Tab::ALL.iter().position(|t| *t == self.tab).unwrap_or(0);
                self.tab = Tab::ALL[(i + 1) % Tab::ALL.len()];
            }
            Action::NextHead => {
                let heads = self.mirror.layout().map_or(1, |l| l.num_heads);
                self.head = (self.head + 1) % heads.max(1);
            }
            Action::NextRank => self.next_rank(),
            Action::NextNote
            | Action::PreviousNote
            | Action::Notes
            | Action::NotesDown
            | Action::NotesUp => self.tour_action(action),
            Action::Follow => {
                self.follow = true;
                self.select_position();
            }
            Action::PaneDown => self.scroll_pane(1),
            Action::PaneUp => self.scroll_pane(-1),
            Action::Narrower => self.tree_percent = self.tree_percent.saturating_sub(5).max(20),
            Action::Wider => self.tree_percent = (self.tree_percent + 5).min(70),
            Action::Help => {
                self.overlay = Overlay::Help;
                self.help_scroll = 0;
            }
            Action::Cancel => {
                if self.mirror.busy.is_some() {
                    self.driver.cancel();
                }
                self.overlay = Overlay::None;
            }
            Action::Quit => self.quit = true,
        }
    }

    fn run_command(&mut self, command: Command) {
        if let Some(what) = &self.mirror.busy {
            self.say(format!("busy ({what}): Esc cancels"));
            return;
        }
        self.follow = true;
        self.send(command);
    }
}
