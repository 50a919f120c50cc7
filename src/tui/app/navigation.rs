//! Moving around the execution tree: the selection, expanding phases and layers, the mouse.

use super::{App, Node, Row, Tab};
use crate::engine::trace::OpEvent;
use ratatui::crossterm::event::{MouseButton, MouseEvent, MouseEventKind};

impl App {
    /// Selects a node, expanding what holds it: its phase stays open, its layer is open while
    /// the selection is there (the layer opened before closes, unless the user opened it).
    pub fn select(&mut self, node: Node) {
        if let Node::Op(i) = node {
            if let Some(e) = self.mirror.current().and_then(|r| r.events.get(i)) {
                self.expanded.insert(Node::Phase(e.phase));
                self.auto_open = e.layer.map(|l| Node::Layer(e.phase, l));
            }
        }
        self.selected = Some(node);
    }

    /// Whether a phase or layer row shows what it holds: the user opened it, or it holds the
    /// op last selected by a step, a search or a jump. Layers start collapsed.
    pub fn is_open(&self, node: Node) -> bool {
        self.expanded.contains(&node) || self.auto_open == Some(node)
    }

    pub(super) fn select_position(&mut self) {
        if let Some(i) = self.mirror.position().map(|e| e.index) {
            self.select(Node::Op(i));
        }
    }

    /// The selected op, if an op row is selected.
    pub fn selected_op(&self) -> Option<(usize, &OpEvent)> {
        match self.selected? {
            Node::Op(i) => self.mirror.current()?.events.get(i).map(|e| (i, e)),
            _ => None,
        }
    }

    /// The layer the selection is in (for the Learn view and layer breakpoints).
    pub fn selected_layer(&self) -> Option<usize> {
        match self.selected? {
            Node::Layer(_, l) => Some(l),
            Node::Op(_) => self.selected_op().and_then(|(_, e)| e.layer),
            Node::Phase(_) => None,
        }
    }

    /// The visible rows of the execution tree.
    pub fn rows(&self) -> Vec<Row> {
        let mut rows = Vec::new();
        let Some(run) = self.mirror.current() else {
            return rows;
        };
        let mut i = 0;
        let events = &run.events;
        while i < events.len() {
            let phase = events[i].phase;
            let phase_node = Node::Phase(phase);
            rows.push(Row {
                node: phase_node,
                depth: 0,
            });
            let open = self.is_open(phase_node);
            while i < events.len() && events[i].phase == phase {
                match events[i].layer {
                    None => {
                        if open && self.shows_rank(events[i].rank) {
                            rows.push(Row {
                                node: Node::Op(i),
                                depth: 1,
                            });
                        }
                        i += 1;
                    }
                    Some(l) => {
                        let layer_node = Node::Layer(phase, l);
                        if open {
                            rows.push(Row {
                                node: layer_node,
                                depth: 1,
                            });
                        }
                        let layer_open = open && self.is_open(layer_node);
                        while i < events.len()
                            && events[i].phase == phase
                            && events[i].layer == Some(l)
                        {
                            if layer_open && self.shows_rank(events[i].rank) {
                                rows.push(Row {
                                    node: Node::Op(i),
                                    depth: 2,
                                });
                            }
                            i += 1;
                        }
                    }
                }
            }
        }
        rows
    }

    /// Whether the tree shows the ops of `rank` (see [`App::rank_view`]).
    pub(super) fn shows_rank(&self, rank: Option<usize>) -> bool {
        self.rank_view.is_none() || rank == self.rank_view
    }

    /// The tree shows the next tensor-parallel rank alone, and after the last every rank again.
    pub(super) fn next_rank(&mut self) {
        let ranks = self.mirror.current().map_or(1, |r| r.flags.tp);
        if ranks < 2 {
            self.log
                .push("this run has no tensor-parallel ranks (run it with --tp N)".into());
            return;
        }
        self.rank_view = match self.rank_view {
            None => Some(0),
            Some(r) if r + 1 < ranks => Some(r + 1),
            Some(_) => None,
        };
        // The selected op, on the rank now shown.
        if let (Some(rank), Some((_, e))) = (self.rank_view, self.selected_op()) {
            let (phase, name) = (e.phase, e.name.clone());
            if let Some(j) = self
                .mirror
                .current()
                .and_then(|r| r.find_at(phase, Some(rank), &name))
            {
                self.selected = Some(Node::Op(j));
            }
        }
        let shown = self
            .rank_view
            .map_or("every rank".to_string(), |r| format!("rank {r} of {ranks}"));
        self.log.push(format!("tree: {shown}"));
    }

    /// Attention heads in the output of `e`: the model's, or a tensor-parallel rank's share.
    pub fn heads_of_op(&self, e: &OpEvent) -> usize {
        let heads = self.mirror.layout().map_or(1, |l| l.num_heads);
        self.mirror.current().map_or(heads, |run| {
            crate::debug::compare::rank_heads(run, e, heads)
        })
    }

    pub(super) fn selected_row(&self, rows: &[Row]) -> Option<usize> {
        let sel = self.selected?;
        rows.iter().position(|r| r.node == sel).or_else(|| {
            // A collapsed op: its layer or phase row.
            let e = match sel {
                Node::Op(i) => self.mirror.current()?.events.get(i)?,
                _ => return None,
            };
            rows.iter()
                .position(|r| e.layer.is_some_and(|l| r.node == Node::Layer(e.phase, l)))
                .or_else(|| rows.iter().position(|r| r.node == Node::Phase(e.phase)))
        })
    }

    pub(super) fn move_selection(&mut self, delta: isize) {
        let rows = self.rows();
        if rows.is_empty() {
            return;
        }
        let at = self.selected_row(&rows).unwrap_or(0) as isize;
        let to = (at + delta).clamp(0, rows.len() as isize - 1) as usize;
        self.follow = false;
        self.selected = Some(rows[to].node);
    }

    pub(super) fn toggle_expand(&mut self) {
        let Some(node) = self.selected else { return };
        match node {
            Node::Phase(_) | Node::Layer(..) => {
                if self.is_open(node) {
                    self.expanded.remove(&node);
                    if self.auto_open == Some(node) {
                        self.auto_open = None;
                    }
                } else {
                    self.expanded.insert(node);
                }
            }
            Node::Op(_) => self.tab = Tab::Tensor,
        }
    }

    pub fn on_mouse(&mut self, m: MouseEvent) {
        match m.kind {
            MouseEventKind::ScrollDown | MouseEventKind::ScrollUp => {
                let down = m.kind == MouseEventKind::ScrollDown;
                if self.areas.pane.contains((m.column, m.row).into()) {
                    self.scroll_pane(if down { 3 } else { -3 });
                } else {
                    self.move_selection(if down { 3 } else { -3 });
                }
            }
            MouseEventKind::Down(MouseButton::Left) => {
                let (x, y) = (m.column, m.row);
                let tree = self.areas.tree;
                if tree.contains((x, y).into()) && y > tree.y && y < tree.y + tree.height - 1 {
                    let rows = self.rows();
                    let index = self.scroll + (y - tree.y - 1) as usize;
                    if let Some(row) = rows.get(index) {
                        if self.selected == Some(row.node) {
                            self.toggle_expand();
                        }
                        self.follow = false;
                        self.selected = Some(row.node);
                    }
                }
                let tabs = self.areas.tabs;
                if tabs.contains((x, y).into()) {
                    let mut at = tabs.x + 1;
                    for tab in Tab::ALL {
                        let w = tab.title().len() as u16 + 3;
                        if x >= at && x < at + w {
                            self.tab = tab;
                        }
                        at += w;
                    }
                }
            }
            _ => {}
        }
    }
}
