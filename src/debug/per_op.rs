//! The findings one run shows by itself: NaN/Inf (the first op of each phase), all-zero outputs,
//! elements left unwritten in poisoned buffers, buffer disconnects and reads of buffers no op
//! wrote.

use super::detect::{Finding, FindingKind};
use super::forensics::{disconnects, orphan_reads};
use super::indexer_scores::relu_explains_zero;
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
            || (e.rank.is_some() && crate::model::shard::partial_sum(&e.name))
            || (e.kind == OpKind::IndexScores && relu_explains_zero(run, i));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::debug::detect::FindingKind;
    use crate::debug::runner::cpu_run;
    use crate::engine::generate::Schedule;
    use crate::stats::TensorStats;
    use crate::tensor::Tensor;
    use std::sync::Arc;

    /// glm5-tiny, seed 557, one prompt token: layer 1's indexer scores its one key 0 (every head's
    /// dot is negative), layer 0's does not.
    fn one_token_run() -> RunRecord {
        let schedule = Schedule {
            prompt: vec![74],
            prefill_len: 1,
            decode_steps: 0,
        };
        cpu_run("glm5-tiny", 557, schedule)
    }

    fn scores_of(run: &RunRecord, layer: usize) -> usize {
        let name = format!("model.layers.{layer}.self_attn.indexer.scores");
        run.find(Phase::Prefill, &name).unwrap()
    }

    fn zeros(run: &RunRecord) -> Vec<String> {
        per_op_findings(run)
            .into_iter()
            .filter(|f| f.kind == FindingKind::AllZero)
            .map(|f| f.op)
            .collect()
    }

    /// Scores that the ReLU makes zero are no finding (they were one: a false alarm on one
    /// prompt token in 16 per indexer layer of glm5-tiny).
    #[test]
    fn indexer_scores_zero_by_the_relu_are_no_finding() {
        let run = one_token_run();
        let i = scores_of(&run, 1);
        assert!(run.events[i].stats.all_zero(), "the fixture lost its zero");
        assert!(zeros(&run).is_empty(), "{:?}", per_op_findings(&run));
    }

    /// Scores zeroed where a head's dot is positive (a kernel that wrote nothing) still are.
    #[test]
    fn indexer_scores_zeroed_against_their_dots_are_a_finding() {
        let mut run = one_token_run();
        let i = scores_of(&run, 0);
        assert!(!run.events[i].stats.all_zero());
        let n = run.outputs[i].numel();
        let shape = run.events[i].shape.clone();
        run.outputs[i] = Arc::new(Tensor::from_vec(&shape, vec![0.0; n]));
        run.events[i].stats = TensorStats::of(&vec![0.0; n]);
        assert_eq!(zeros(&run), [run.events[i].name.clone()]);
    }

    /// The scores' conditioning: every score free to move where the ReLU zeroed them all (the
    /// zero is no measure of their noise), a finite factor of at least 1 where it did not.
    #[test]
    fn the_relu_zero_leaves_the_scores_free_and_others_conditioned() {
        use crate::debug::indexer_scores::conditioning;
        let run = one_token_run();
        assert!(conditioning(&run, scores_of(&run, 1)) >= 1e6);
        let k = conditioning(&run, scores_of(&run, 0));
        assert!((1.0..1e3).contains(&k), "{k}");
    }
}
