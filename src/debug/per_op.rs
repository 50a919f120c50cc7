//! The findings one run shows by itself: NaN/Inf (the first op of each phase), all-zero outputs,
//! elements left unwritten in poisoned buffers, buffer disconnects and reads of buffers no op
//! wrote.

use super::detect::{Finding, FindingKind};
use super::forensics::{disconnects, orphan_reads};
use super::record::RunRecord;
use crate::engine::trace::{OpKind, Phase};

/// Findings that one run shows by itself.
pub fn per_op_findings(run: &RunRecord) -> Vec<Finding> {
    let mut findings = Vec::new();
    let mut nan_seen: Vec<(Phase, usize)> = Vec::new();
    let mut zero_seen: Vec<(Phase, usize)> = Vec::new();
    for (i, e) in run.events.iter().enumerate() {
        let s = &e.stats;
        let f = |kind, detail: String| Finding {
            rank: None,
            kind,
            phase: e.phase,
            op: e.name.clone(),
            index: i,
            detail,
        };
        if s.unwritten > 0 {
            findings.push(f(
                FindingKind::Unwritten,
                format!(
                    "{} of {} elements were never written (poison still in place)",
                    s.unwritten, s.count
                ),
            ));
        }
        // Masked indexer scores are −∞ by design; poison is reported as unwritten above.
        let bad = s.nan - s.unwritten
            + s.pos_inf
            + if e.kind == OpKind::IndexScores {
                0
            } else {
                s.neg_inf
            };
        if bad > 0 {
            note_first(&mut nan_seen, &mut findings, e.phase, || {
                f(
                    FindingKind::NanInf,
                    format!(
                        "{} NaN, {} +Inf, {} -Inf of {} elements",
                        s.nan - s.unwritten,
                        s.pos_inf,
                        s.neg_inf,
                        s.count
                    ),
                )
            });
        }
        // Index listings (chosen experts, kept keys) may well be all zero: expert 0, key 0; a
        // padded batch's rows (no keys) must be.
        // A rank's partial sum may be too: no token of the prompt in its part of the vocabulary,
        // no token routed to its experts.
        let zero_ok = e.dtype == crate::tensor::DType::I32
            || e.kind == OpKind::AttentionPadding
            || (e.rank.is_some() && crate::model::shard::partial_sum(&e.name));
        if s.all_zero() && !zero_ok {
            note_first(&mut zero_seen, &mut findings, e.phase, || {
                f(
                    FindingKind::AllZero,
                    format!("all {} elements are zero", s.count),
                )
            });
        }
    }
    count_later(&mut findings, &nan_seen, FindingKind::NanInf, "op");
    count_later(&mut findings, &zero_seen, FindingKind::AllZero, "op");
    for d in disconnects(run) {
        findings.push(Finding {
            rank: None,
            kind: FindingKind::BufferDisconnect,
            phase: d.phase,
            op: d.op.clone(),
            index: d.index,
            detail: format!(
                "the kernel wrote buffer #{} @{:#x}, the op handed on buffer #{} @{:#x}{}",
                d.kernel_wrote.id.0,
                d.kernel_wrote.address,
                d.returned.id.0,
                d.returned.address,
                if d.consumers.is_empty() {
                    String::new()
                } else {
                    format!(", which {} read", d.consumers.join(", "))
                }
            ),
        });
    }
    for (i, r) in orphan_reads(run) {
        let e = &run.events[i];
        findings.push(Finding {
            rank: None,
            kind: FindingKind::BufferDisconnect,
            phase: e.phase,
            op: e.name.clone(),
            index: i,
            detail: format!(
                "reads buffer #{} @{:#x}, which no earlier op wrote",
                r.id.0, r.address
            ),
        });
    }
    findings
}

/// Records a finding only for the first occurrence in a phase; counts the rest.
fn note_first(
    seen: &mut Vec<(Phase, usize)>,
    findings: &mut Vec<Finding>,
    phase: Phase,
    make: impl FnOnce() -> Finding,
) {
    match seen.iter_mut().find(|(p, _)| *p == phase) {
        Some((_, n)) => *n += 1,
        None => {
            seen.push((phase, 0));
            findings.push(make());
        }
    }
}

fn count_later(findings: &mut [Finding], seen: &[(Phase, usize)], kind: FindingKind, what: &str) {
    for (phase, later) in seen {
        if *later == 0 {
            continue;
        }
        if let Some(f) = findings
            .iter_mut()
            .find(|f| f.kind == kind && f.phase == *phase)
        {
            f.detail
                .push_str(&format!("; {later} later {what}s of {phase} too"));
        }
    }
}
