//! The Learn view's walk: one MLA layer's ops in the order they explain absorption, and the
//! `n` / `p` keys that move the selection to each step's op in the trace.

use super::{App, Node, Overlay};
use crate::engine::trace::Phase;
use crate::engine::MlaPath;
use crate::tui::keys::Action;
use ratatui::crossterm::event::{KeyCode, KeyEvent};

/// One stop of the walk: the op (its name under `model.layers.N.self_attn.`) and the path it
/// belongs to (`None`: both paths run it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WalkStep {
    pub op: &'static str,
    pub path: Option<MlaPath>,
}

/// The walk, from the compression to the output projection: the shared part, the naive path,
/// the absorbed path.
pub const WALK: [WalkStep; 11] = [
    step("kv_a_proj_with_mqa", None),
    step("kv_a_layernorm", None),
    step("k_rope", None),
    step("q_b_proj", None),
    step("q_rope", None),
    step("kv_b_proj", Some(MlaPath::Naive)),
    step("attn_output", Some(MlaPath::Naive)),
    step("q_absorbed", Some(MlaPath::Absorbed)),
    step("attn_latent", Some(MlaPath::Absorbed)),
    step("attn_output", Some(MlaPath::Absorbed)),
    step("o_proj", None),
];

const fn step(op: &'static str, path: Option<MlaPath>) -> WalkStep {
    WalkStep { op, path }
}

/// Where a walk step's op is in the current run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WalkTarget {
    /// Op `index` in `phase`; `moved` when it is not in the phase the walk was in (the path
    /// the step needs ran elsewhere).
    Found {
        index: usize,
        phase: Phase,
        moved: bool,
    },
    /// Not in this trace, and why.
    Missing(String),
}

impl App {
    /// The layer the Learn view explains and, when the selection is not inside a layer, a
    /// sentence saying which it took instead and why.
    pub fn learn_layer(&self) -> Option<(usize, Option<String>)> {
        if let Some(l) = self.selected_layer() {
            return Some((l, None));
        }
        let first = self.mirror.info.as_ref()?.layers.start;
        let what = match self.selected {
            Some(Node::Op(_)) => match self.selected_op() {
                Some((_, e)) => format!("the selection ({})", e.name),
                None => "the selection".to_string(),
            },
            Some(Node::Phase(p)) => format!("the selection (the {p} row)"),
            _ => "nothing is selected, so the view".to_string(),
        };
        let why = if self.selected.is_none() {
            format!("{what} shows layer {first}, the first layer this run traces.")
        } else {
            format!(
                "{what} is not inside a layer, so this view shows layer {first}, the first \
                 layer this run traces. Select an op of another layer to see that one."
            )
        };
        Some((first, Some(capitalise(&why))))
    }

    /// The phase the walk looks in first: the selected op's when it is in the walk's layer,
    /// else the last phase in which the layer ran its attention.
    fn walk_phase(&self, layer: usize) -> Option<Phase> {
        let run = self.mirror.current()?;
        if let Some((_, e)) = self.selected_op() {
            if e.layer == Some(layer) {
                return Some(e.phase);
            }
        }
        if let Some(Node::Layer(phase, l)) = self.selected {
            if l == layer {
                return Some(phase);
            }
        }
        let name = format!("model.layers.{layer}.self_attn.o_proj");
        run.events
            .iter()
            .rev()
            .find(|e| e.name == name)
            .or_else(|| run.events.iter().rev().find(|e| e.layer == Some(layer)))
            .map(|e| e.phase)
    }

    /// Where step `i` of the walk is in the current run, for the layer the view shows.
    pub fn walk_target(&self, i: usize) -> WalkTarget {
        let Some(step) = WALK.get(i) else {
            return WalkTarget::Missing("no such step".into());
        };
        let (Some(run), Some((layer, _))) = (self.mirror.current(), self.learn_layer()) else {
            return WalkTarget::Missing("no run yet".into());
        };
        let name = format!("model.layers.{layer}.self_attn.{}", step.op);
        let wanted = |p: Phase| step.path.is_none_or(|w| run.flags.path_of(p) == w);
        let first = self.walk_phase(layer);
        if let Some(p) = first.filter(|p| wanted(*p)) {
            if let Some(index) = run.find(p, &name) {
                return WalkTarget::Found {
                    index,
                    phase: p,
                    moved: false,
                };
            }
        }
        // Another phase that ran the step's path, the latest first.
        let other = run
            .events
            .iter()
            .rev()
            .filter(|e| e.name == name && wanted(e.phase))
            .find_map(|e| run.find(e.phase, &name).map(|index| (index, e.phase)));
        if let Some((index, phase)) = other {
            return WalkTarget::Found {
                index,
                phase,
                moved: first.is_some(),
            };
        }
        let path_name = |p: MlaPath| p.to_string();
        WalkTarget::Missing(match step.path {
            Some(w) => {
                let ran = run.flags.paths();
                format!(
                    "not in this trace: layer {layer} ran no {} attention (prefill {} · decode {}{})",
                    path_name(w),
                    path_name(ran.prefill),
                    path_name(ran.decode),
                    if run.flags.mla_disable { ", MLA disabled" } else { "" }
                )
            }
            None => format!(
                "not in this trace: layer {layer} has not run {} yet",
                step.op
            ),
        })
    }

    /// Moves the walk one step forward or back and the selection to that step's op.
    pub fn walk(&mut self, forward: bool) {
        let next = match (self.learn_step, forward) {
            (None, true) => 0,
            (None, false) => WALK.len() - 1,
            (Some(i), true) => (i + 1).min(WALK.len() - 1),
            (Some(i), false) => i.saturating_sub(1),
        };
        self.learn_step = Some(next);
        self.learn_from = self.learn_layer().and_then(|(l, _)| self.walk_phase(l));
        if let WalkTarget::Found { index, .. } = self.walk_target(next) {
            self.follow = false;
            self.select(Node::Op(index));
        }
    }

    /// Keys in the Learn view: `n` / `p` walk the layer's ops whatever the key map binds them
    /// to elsewhere; the tour's keys go from note to note; `:` opens the command line over it.
    pub(super) fn learn_key(&mut self, key: KeyEvent, scroll: u16) {
        if let (KeyCode::Char(c @ ('n' | 'p')), true) = (key.code, key.modifiers.is_empty()) {
            return self.walk(c == 'n');
        }
        let to = |scroll| Overlay::Learn { scroll };
        match self.keymap.action(&key) {
            Some(Action::Down) => self.overlay = to(scroll.saturating_add(1)),
            Some(Action::Up) => self.overlay = to(scroll.saturating_sub(1)),
            Some(Action::PageDown) => self.overlay = to(scroll.saturating_add(10)),
            Some(Action::PageUp) => self.overlay = to(scroll.saturating_sub(10)),
            Some(Action::NextHead) => self.head += 1,
            Some(Action::Command) => {
                self.tour.learn_under_prompt = Some(scroll);
                self.overlay = Overlay::Command {
                    input: String::new(),
                };
            }
            Some(a) if super::tour::is_tour_action(a) => self.tour_action(a),
            Some(Action::Quit) | Some(Action::Cancel) | Some(Action::Learn) => {
                self.overlay = Overlay::None
            }
            _ => {}
        }
    }
}

fn capitalise(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}
