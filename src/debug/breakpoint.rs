//! Breakpoints: on a layer, on op names (optionally of one phase), or on a condition of an op's
//! output (tfdbg's `has_inf_or_nan` and friends, and a difference from the comparison run). A
//! condition stops where it becomes true: at an op none of whose sources (the ops that wrote what
//! it read) already met it, so NaNs inherited from an earlier op do not stop every later op.

use crate::engine::trace::{BufferRole, OpEvent};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Breakpoint {
    /// Entering decoder layer L (its first op in each phase).
    Layer(usize),
    /// Any op whose name matches the pattern (`*` any run of characters, `?` one character);
    /// `PHASE/NAME` (`decode.0/*attn_probs`, `decode.*/…`) also matches the phase.
    Op(String),
    /// The output holds NaN or ±Inf.
    NanInf,
    /// Every element of the output is zero.
    AllZero,
    /// The largest |value| of the output is above this.
    AbsMaxAbove(f64),
    /// The relative L2 difference from the same op of the comparison run is above this.
    DiffAbove(f64),
}

impl Breakpoint {
    /// Parses `layer N`, `op PATTERN`, `nan`, `zero`, `absmax>X`, `diff>X` (what `:break` takes).
    pub fn parse(text: &str) -> Result<Breakpoint> {
        let text = text.trim();
        let bad = || {
            Error::invalid(format!(
                "breakpoint '{text}': expected layer N, op PATTERN, nan, zero, absmax>X or diff>X"
            ))
        };
        let number = |s: &str| {
            s.trim()
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite())
                .ok_or_else(bad)
        };
        if let Some(rest) = text.strip_prefix("layer") {
            return rest
                .trim()
                .parse()
                .map(Breakpoint::Layer)
                .map_err(|_| bad());
        }
        if let Some(rest) = text.strip_prefix("op ") {
            return Ok(Breakpoint::Op(rest.trim().to_string()));
        }
        if let Some(rest) = text.strip_prefix("absmax>") {
            return number(rest).map(Breakpoint::AbsMaxAbove);
        }
        if let Some(rest) = text.strip_prefix("diff>") {
            return number(rest).map(Breakpoint::DiffAbove);
        }
        match text {
            "nan" | "inf" | "has_inf_or_nan" => Ok(Breakpoint::NanInf),
            "zero" | "all_zero" => Ok(Breakpoint::AllZero),
            _ => Err(bad()),
        }
    }

    /// Whether this is an op breakpoint whose pattern matches `event` (its phase too, for a
    /// `PHASE/NAME` pattern).
    pub fn matches_op(&self, event: &OpEvent) -> bool {
        let Breakpoint::Op(pattern) = self else {
            return false;
        };
        match pattern.split_once('/') {
            Some((phase, name)) => {
                glob_match(phase, &event.phase.to_string()) && glob_match(name, &event.name)
            }
            None => glob_match(pattern, &event.name),
        }
    }

    /// Whether a condition (`nan`, `zero`, `absmax>X`, `diff>X`) rather than a place.
    pub fn is_condition(&self) -> bool {
        !matches!(self, Breakpoint::Layer(_) | Breakpoint::Op(_))
    }

    /// Whether the op `event` (preceded by `previous`) meets this breakpoint, looked at alone;
    /// `diff` is its relative difference from the comparison run, when there is one. See
    /// [`first_hit`] for where a condition stops.
    pub fn hits(&self, event: &OpEvent, previous: Option<&OpEvent>, diff: Option<f64>) -> bool {
        match self {
            Breakpoint::Layer(l) => {
                event.layer == Some(*l)
                    && previous.is_none_or(|p| p.layer != Some(*l) || p.phase != event.phase)
            }
            Breakpoint::Op(_) => self.matches_op(event),
            Breakpoint::NanInf => {
                let s = &event.stats;
                s.nan
                    + s.pos_inf
                    + if event.kind == crate::engine::OpKind::IndexScores {
                        0
                    } else {
                        s.neg_inf
                    }
                    > 0
            }
            Breakpoint::AllZero => event.stats.all_zero(),
            Breakpoint::AbsMaxAbove(v) => event.stats.abs_max > *v,
            Breakpoint::DiffAbove(v) => diff.is_some_and(|d| d.is_nan() || d > *v),
        }
    }
}

impl fmt::Display for Breakpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Breakpoint::Layer(l) => write!(f, "layer {l}"),
            Breakpoint::Op(p) => write!(f, "op {p}"),
            Breakpoint::NanInf => write!(f, "nan"),
            Breakpoint::AllZero => write!(f, "zero"),
            Breakpoint::AbsMaxAbove(v) => write!(f, "absmax>{v}"),
            Breakpoint::DiffAbove(v) => write!(f, "diff>{v}"),
        }
    }
}

/// Adds a breakpoint unless it is set already.
pub fn add(breakpoints: &mut Vec<Breakpoint>, bp: Breakpoint) {
    if !breakpoints.contains(&bp) {
        breakpoints.push(bp);
    }
}

/// Removes a breakpoint; returns whether it was set.
pub fn remove(breakpoints: &mut Vec<Breakpoint>, bp: &Breakpoint) -> bool {
    let before = breakpoints.len();
    breakpoints.retain(|b| b != bp);
    before != breakpoints.len()
}

/// Sets the breakpoint if absent, removes it if present; returns whether it is now set.
pub fn toggle(breakpoints: &mut Vec<Breakpoint>, bp: Breakpoint) -> bool {
    if remove(breakpoints, &bp) {
        false
    } else {
        add(breakpoints, bp);
        true
    }
}

/// The first of `breakpoints` that op `i` of `events` triggers; `diff(j)` is op j's relative
/// difference from the comparison run. A condition triggers where it becomes true: it holds at
/// op i and at none of i's sources, the ops that last wrote the activations and caches i read
/// (and the op before i when both are results of one kernel call, which read the same buffers).
pub fn first_hit(
    breakpoints: &[Breakpoint],
    events: &[OpEvent],
    i: usize,
    diff: &dyn Fn(usize) -> Option<f64>,
) -> Option<usize> {
    let e = events.get(i)?;
    let previous = i.checked_sub(1).map(|p| &events[p]);
    let holds = |b: &Breakpoint, j: usize| {
        let before = j.checked_sub(1).map(|p| &events[p]);
        b.hits(&events[j], before, diff(j))
    };
    breakpoints.iter().position(|b| {
        if !b.is_condition() {
            return b.hits(e, previous, None);
        }
        holds(b, i) && !sources(events, i).into_iter().any(|j| holds(b, j))
    })
}

/// The ops whose outputs op `i` read: the last writer before it of each activation or cache it
/// read, and the op just before it when that one read the very same buffers (two results of
/// one kernel call, such as attention probabilities and output).
fn sources(events: &[OpEvent], i: usize) -> Vec<usize> {
    let e = &events[i];
    let mut out: Vec<usize> = e
        .inputs
        .iter()
        .filter(|r| r.role != BufferRole::Weight)
        .filter_map(|r| (0..i).rev().find(|&j| events[j].output.id == r.id))
        .collect();
    if let Some(p) = i.checked_sub(1) {
        let ids = |x: &OpEvent| x.inputs.iter().map(|r| r.id).collect::<Vec<_>>();
        if !e.inputs.is_empty() && ids(&events[p]) == ids(e) {
            out.push(p);
        }
    }
    out
}

/// Glob matching with `*` (any run, also empty) and `?` (one character).
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parsing_and_globs() {
        assert_eq!(Breakpoint::parse("layer 3").unwrap(), Breakpoint::Layer(3));
        assert_eq!(
            Breakpoint::parse("op *q_absorbed").unwrap(),
            Breakpoint::Op("*q_absorbed".into())
        );
        assert_eq!(
            Breakpoint::parse("absmax>100").unwrap(),
            Breakpoint::AbsMaxAbove(100.0)
        );
        assert_eq!(
            Breakpoint::parse("diff>1e-3").unwrap(),
            Breakpoint::DiffAbove(1e-3)
        );
        assert_eq!(Breakpoint::parse("nan").unwrap(), Breakpoint::NanInf);
        assert!(Breakpoint::parse("layer x").is_err());
        assert!(Breakpoint::parse("sometimes").is_err());
        assert!(glob_match(
            "*q_absorbed",
            "model.layers.3.self_attn.q_absorbed"
        ));
        assert!(glob_match("model.layers.?.mlp", "model.layers.3.mlp"));
        assert!(!glob_match("model.layers.?.mlp", "model.layers.13.mlp"));
        assert!(glob_match("*attn*", "x.self_attn.o_proj"));
        assert!(!glob_match("*attn", "x.self_attn.o_proj"));
    }
}
