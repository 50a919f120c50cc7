//! Colours, or none: `NO_COLOR` (any non-empty value) turns every colour off and leaves only
//! bold, reverse and the symbols, which carry all the meaning on their own.

use ratatui::style::{Color, Modifier, Style};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Theme {
    pub color: bool,
}

impl Theme {
    /// Colour unless `NO_COLOR` is set.
    pub fn from_env() -> Theme {
        Theme {
            color: std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
        }
    }

    pub fn plain() -> Theme {
        Theme { color: false }
    }

    fn fg(&self, c: Color) -> Style {
        if self.color {
            Style::new().fg(c)
        } else {
            Style::new()
        }
    }

    pub fn base(&self) -> Style {
        Style::new()
    }

    pub fn dim(&self) -> Style {
        if self.color {
            Style::new().fg(Color::DarkGray)
        } else {
            Style::new()
        }
    }

    pub fn title(&self) -> Style {
        self.fg(Color::Cyan).add_modifier(Modifier::BOLD)
    }

    pub fn selected(&self) -> Style {
        Style::new().add_modifier(Modifier::REVERSED)
    }

    pub fn ok(&self) -> Style {
        self.fg(Color::Green)
    }

    pub fn bad(&self) -> Style {
        self.fg(Color::Red).add_modifier(Modifier::BOLD)
    }

    pub fn warn(&self) -> Style {
        self.fg(Color::Yellow)
    }

    pub fn diverge(&self) -> Style {
        self.fg(Color::Magenta)
    }

    pub fn accent(&self) -> Style {
        self.fg(Color::Cyan)
    }

    pub fn on(&self) -> Style {
        self.fg(Color::Yellow).add_modifier(Modifier::BOLD)
    }

    /// A heat-map cell colour for a value in [0, 1]: the 24-step grey ramp of 256-colour
    /// terminals (None without colour).
    pub fn heat(&self, v: f32) -> Option<Color> {
        if !self.color {
            return None;
        }
        Some(Color::Indexed(
            232 + (v.clamp(0.0, 1.0) * 23.0).round() as u8,
        ))
    }
}
