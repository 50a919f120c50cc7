//! Notes as a tour: the notes pane's state, the keys that go from note to note in a replay
//! (each moves the selection to the note's op and switches to the note's pane), and what a
//! note typed now records of where the user stood.

use super::{App, Overlay, Tab, WALK};
use crate::service::{Command, Update};
use crate::session::recorded::{Annotation, Pane};
use crate::tui::keys::Action;

/// What the notes pane shows and where a tour stands.
#[derive(Debug, Clone, Default)]
pub struct Tour {
    /// The replayed session's notes, in the order a tour visits them (none live).
    pub notes: Vec<Annotation>,
    /// The note shown: the last one gone to, or passed by a step.
    pub at: Option<usize>,
    /// The notes pane is open.
    pub open: bool,
    /// The first line of the note shown (a note longer than the pane scrolls).
    pub scroll: u16,
    /// The Learn view's scroll while the command line is open over it: a note typed there is
    /// about the Learn view, and the view comes back when the command line closes.
    pub learn_under_prompt: Option<u16>,
}

/// Whether an action belongs to the tour (the Learn view passes these on).
pub fn is_tour_action(action: Action) -> bool {
    matches!(
        action,
        Action::NextNote
            | Action::PreviousNote
            | Action::Notes
            | Action::NotesDown
            | Action::NotesUp
    )
}

/// What the keys say where there is nothing to tour.
pub const NO_NOTES: &str = "no notes placed in this session's timeline, so there is nothing to \
     tour (a replay of a session saved with :note TEXT goes from note to note)";

impl Tour {
    /// The note shown, if any.
    pub fn current(&self) -> Option<(usize, &Annotation)> {
        let i = self.at?;
        self.notes.get(i).map(|a| (i, a))
    }
}

impl App {
    /// The keys of the tour and the notes pane.
    pub(super) fn tour_action(&mut self, action: Action) {
        match action {
            Action::NextNote => self.step_note(true),
            Action::PreviousNote => self.step_note(false),
            Action::Notes => self.tour.open = !self.tour.open,
            Action::NotesDown => self.tour.scroll = self.tour.scroll.saturating_add(1),
            Action::NotesUp => self.tour.scroll = self.tour.scroll.saturating_sub(1),
            _ => {}
        }
    }

    /// Goes to the next or the previous note (the first, when none has been shown).
    fn step_note(&mut self, forward: bool) {
        let n = self.tour.notes.len();
        if n == 0 {
            self.notice = Some(NO_NOTES.to_string());
            self.say(NO_NOTES);
            return;
        }
        let next = match (self.tour.at, forward) {
            (None, true) => Some(0),
            (Some(i), true) if i + 1 < n => Some(i + 1),
            (Some(i), false) if i > 0 => Some(i - 1),
            _ => None,
        };
        match next {
            Some(i) => self.send(Command::GotoNote(i)),
            None => {
                self.tour.open = true;
                let (key, what) = if forward {
                    (Action::PreviousNote, "the last note")
                } else {
                    (Action::NextNote, "the first note")
                };
                self.notice = Some(format!(
                    "this is {what} of {n}: {} goes the other way",
                    self.keymap.key_of(key)
                ));
            }
        }
    }

    /// Takes in the tour's updates from the replay.
    pub(super) fn tour_update(&mut self, update: Update) {
        match update {
            Update::Tour(notes) => self.tour.notes = notes,
            Update::NoteReached { index, moved } => {
                if self.tour.at != Some(index) {
                    self.tour.scroll = 0;
                }
                self.tour.at = Some(index);
                if moved {
                    self.tour.open = true;
                    self.tour.scroll = 0;
                    if let Some(pane) = self.tour.notes.get(index).and_then(|a| a.pane) {
                        self.show_pane(pane);
                    }
                }
            }
            _ => {}
        }
    }

    /// A new model or a replay back at its start: no note shown.
    pub(super) fn tour_reset(&mut self) {
        self.tour.at = None;
        self.tour.open = false;
        self.tour.scroll = 0;
    }

    /// Switches to a note's pane; the Learn view opens at the walk step of the selected op.
    fn show_pane(&mut self, pane: Pane) {
        let tab = match pane {
            Pane::Tensor => Tab::Tensor,
            Pane::Buffers => Tab::Buffers,
            Pane::Compare => Tab::Compare,
            Pane::Learn => {
                if !matches!(self.overlay, Overlay::Learn { .. }) {
                    self.overlay = Overlay::Learn { scroll: 0 };
                }
                self.learn_step = self.walk_step_of_selection().or(self.learn_step);
                return;
            }
        };
        if matches!(self.overlay, Overlay::Learn { .. }) {
            self.overlay = Overlay::None;
        }
        self.tab = tab;
    }

    /// The step of the Learn view's walk whose op is the selected one (on the path its phase
    /// ran), so that the walk's panel explains the op a note is about.
    fn walk_step_of_selection(&self) -> Option<usize> {
        let (_, e) = self.selected_op()?;
        let run = self.mirror.current()?;
        let op = e.name.split_once(".self_attn.")?.1;
        WALK.iter()
            .position(|s| s.op == op && s.path.is_none_or(|p| run.flags.path_of(e.phase) == p))
    }

    /// The pane a note typed now is about.
    pub(super) fn pane_now(&self) -> Pane {
        if self.tour.learn_under_prompt.is_some() || matches!(self.overlay, Overlay::Learn { .. }) {
            return Pane::Learn;
        }
        match self.tab {
            Tab::Tensor => Pane::Tensor,
            Tab::Buffers => Pane::Buffers,
            Tab::Compare => Pane::Compare,
        }
    }

    /// After the command line closes: back to the Learn view it was opened over.
    pub(super) fn back_to_learn(&mut self) {
        if let Some(scroll) = self.tour.learn_under_prompt.take() {
            if self.overlay == Overlay::None {
                self.overlay = Overlay::Learn { scroll };
            }
        }
    }
}
