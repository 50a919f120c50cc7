//! Scrolling the right pane (Tensor, Buffers, Compare) where its content is taller than the
//! pane, as at 80×24. The offset belongs to what is shown: another op or tab starts at the top.

use super::{App, Node, Tab};

/// How far the right pane is scrolled, and for which tab and selection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PaneScroll {
    /// First line shown.
    pub offset: u16,
    /// The lines below the last one shown at offset 0 (0: it all fits), from the last draw.
    pub most: u16,
    of: Option<(Tab, Option<Node>)>,
}

impl PaneScroll {
    /// The offset for the tab and selection shown now: 0 when they changed since it was set.
    pub fn offset_for(&mut self, tab: Tab, selected: Option<Node>) -> u16 {
        if self.of != Some((tab, selected)) {
            *self = PaneScroll {
                of: Some((tab, selected)),
                ..PaneScroll::default()
            };
        }
        self.offset
    }

    /// After a draw: how much was left below, with the offset kept within it.
    pub fn drawn(&mut self, most: u16) {
        self.most = most;
        self.offset = self.offset.min(most);
    }
}

impl App {
    /// Scrolls the right pane by `lines` (down when positive), within its content.
    pub fn scroll_pane(&mut self, lines: i32) {
        let (tab, selected) = (self.tab, self.selected);
        let known = self.pane_scroll.of == Some((tab, selected));
        let at = self.pane_scroll.offset_for(tab, selected) as i32;
        // The bottom is known once the pane was drawn for this op; until then the draw clamps.
        let most = if known {
            self.pane_scroll.most as i32
        } else {
            i32::from(u16::MAX)
        };
        self.pane_scroll.offset = (at + lines).clamp(0, most) as u16;
    }
}
