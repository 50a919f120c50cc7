//! How the comparisons of `check` become findings: the first difference of each phase, one
//! finding per op and rank, and how close each op kind came to its tolerances.

use super::compare::OpComparison;
use super::detect::{Finding, FindingKind, Headroom};
use super::selection::SelectionDiff;
use super::tolerance::Tolerances;
use crate::engine::trace::Phase;

/// How close each op kind of one comparison came to its tolerances.
pub fn headroom_of(
    name: &str,
    comparisons: &[OpComparison],
    tolerances: &Tolerances,
) -> Vec<Headroom> {
    let mut out: Vec<Headroom> = Vec::new();
    for c in comparisons {
        let Ok(d) = &c.diff else { continue };
        // A zero reference passed within the op's noise: the difference is its values' own size.
        let rel = match d.rel_l2 {
            r if r.is_nan() => f64::INFINITY,
            r if r.is_infinite() && !c.exceeds_its() => 1.0,
            r => r,
        };
        let floor = tolerances.row(c.kind).0;
        let (floor_error, gain_needed) = if c.input_error == 0.0 {
            (rel, 0.0)
        } else {
            (
                0.0,
                ((rel - floor) / (c.input_error * c.conditioning)).max(0.0),
            )
        };
        let h = match out.iter_mut().find(|h| h.kind == c.kind) {
            Some(h) => h,
            None => {
                out.push(Headroom {
                    comparison: name.to_string(),
                    kind: c.kind,
                    op: c.name.clone(),
                    phase: c.phase,
                    rel_l2: rel,
                    tolerance: c.tolerance,
                    floor_error: 0.0,
                    gain_needed: 0.0,
                });
                out.last_mut().expect("just pushed")
            }
        };
        if rel / c.tolerance > h.rel_l2 / h.tolerance {
            (h.op, h.phase, h.rel_l2, h.tolerance) = (c.name.clone(), c.phase, rel, c.tolerance);
        }
        h.floor_error = h.floor_error.max(floor_error);
        h.gain_needed = h.gain_needed.max(gain_needed);
    }
    out
}

/// One finding per kind and op: the same op found again in later phases is listed in the
/// first finding's detail instead of repeating it.
pub fn fold_repeats(findings: Vec<Finding>) -> Vec<Finding> {
    let mut out: Vec<Finding> = Vec::new();
    let mut again: Vec<Vec<Phase>> = Vec::new();
    for f in findings {
        match out
            .iter()
            .position(|g| (g.kind, &g.op, g.rank) == (f.kind, &f.op, f.rank))
        {
            Some(i) => again[i].push(f.phase),
            None => {
                out.push(f);
                again.push(Vec::new());
            }
        }
    }
    for (f, phases) in out.iter_mut().zip(again) {
        if !phases.is_empty() {
            let list: Vec<String> = phases.iter().map(Phase::to_string).collect();
            f.detail
                .push_str(&format!(" [also in {}]", list.join(", ")));
        }
    }
    out
}

/// The first difference in each phase, as findings: an op over its tolerance or a choice that
/// differs at a clear margin, whichever comes first. An op over its tolerance only through
/// NaN / ±Inf alike on both sides is not a difference ([`OpComparison::fails_only_alike`]).
pub fn first_per_phase(
    comparisons: &[OpComparison],
    clear_flips: &[SelectionDiff],
    kind: FindingKind,
    describe: &str,
) -> Vec<Finding> {
    let mut phases: Vec<Phase> = comparisons
        .iter()
        .map(|c| c.phase)
        .chain(clear_flips.iter().map(|d| d.phase))
        .collect();
    phases.sort();
    phases.dedup();
    let mut out = Vec::new();
    for phase in phases {
        let over: Vec<&OpComparison> = comparisons
            .iter()
            .filter(|c| c.phase == phase && c.diverges())
            .collect();
        let flips: Vec<&SelectionDiff> = clear_flips.iter().filter(|d| d.phase == phase).collect();
        let later = |first: usize| {
            let n = over.iter().filter(|c| c.index > first).count();
            if n > 0 {
                format!("; {n} later ops of {phase} differ too")
            } else {
                String::new()
            }
        };
        let numeric = over
            .first()
            .filter(|c| flips.first().is_none_or(|f| c.index < f.index));
        let finding = match (numeric, flips.first()) {
            (Some(c), _) => {
                let figures = c.diff.as_ref().map(|d| d.summary()).unwrap_or_default();
                Finding {
                    rank: None,
                    kind,
                    phase,
                    op: c.name.clone(),
                    index: c.index,
                    detail: format!(
                        "{describe}: {figures} ({}){}",
                        c.tolerance_text(),
                        later(c.index)
                    ),
                }
            }
            (_, Some(f)) => Finding {
                rank: None,
                kind,
                phase,
                op: f.op.clone(),
                index: f.index,
                detail: format!(
                    "{describe}: selects differently beyond noise: {}{}",
                    f.describe(),
                    later(f.index)
                ),
            },
            (None, None) => continue,
        };
        out.push(finding);
    }
    out
}
