//! Choices compared as choices in the live comparison: the DSA indexer's kept keys and an MoE
//! router's experts. Two engines whose numbers agree within noise can still choose differently
//! near a tie; what follows such a choice then differs by design, and a debugger that called it
//! a finding would cry wolf on every clean bf16 run. A different choice is a finding only when
//! the numbers behind it do not explain it.

use super::live::{Comparator, Live, Verdict};

impl Comparator<'_> {
    /// The DSA indexer's choice of keys, compared as a choice: per query row, the set of keys
    /// the engine kept (its list may be sorted by score, padded, or hold masked future keys)
    /// against mladb's. Where they differ, both sides are judged by mladb's scores: keys the
    /// engine kept within the scores' noise below mladb's last kept key, and keys it dropped
    /// within noise above its own last, make a selection flip (a note, and mladb follows the
    /// engine's keys from there: [`Comparator::force_choice`]); further, or another number of
    /// keys, a finding.
    pub(super) fn compare_choice(
        &mut self,
        step: u64,
        module: &str,
        op: &str,
        index: usize,
        data: &[f32],
        rank: Option<u32>,
    ) -> Vec<Live> {
        let scores_op = op.replace(".topk", ".scores");
        let (Some(run), Some(scores_index)) =
            (self.steps.get(&step), self.op_index(step, &scores_op))
        else {
            return Vec::new();
        };
        let (rows, start, phase) = (run.tokens.len(), run.start, run.phase);
        let seq = self.seq_of(step).expect("a compared step has a sequence");
        let mine = seq.record.outputs[index].data();
        let scores = seq.record.outputs[scores_index].data();
        if rows == 0
            || !data.len().is_multiple_of(rows)
            || !mine.len().is_multiple_of(rows)
            || !scores.len().is_multiple_of(rows)
        {
            return Vec::new();
        }
        // The noise of a score: the tolerance the judge would give mladb's scores op, as a
        // share of each row's scale.
        let relative = seq
            .judge
            .as_ref()
            .map_or(0.0, |j| j.tolerance_of(&seq.record, scores_index));
        let layer = seq.record.events[index].layer;
        let (ke, km, ctx) = (data.len() / rows, mine.len() / rows, scores.len() / rows);
        let (mut worst_gap, mut worst_noise, mut worst_why) = (0f64, 0f64, "");
        let (mut differ, mut theirs) = (Vec::new(), Vec::new());
        for r in 0..rows {
            let last = start + r; // the newest key this row may see
            let set = |v: &[f32]| {
                let mut s: Vec<usize> = v
                    .iter()
                    .filter(|&&x| x >= 0.0 && x as usize <= last)
                    .map(|&x| x as usize)
                    .collect();
                s.sort_unstable();
                s.dedup();
                s
            };
            let (engine, ours) = (
                set(&data[r * ke..(r + 1) * ke]),
                set(&mine[r * km..(r + 1) * km]),
            );
            if engine == ours {
                continue;
            }
            let row = &scores[r * ctx..(r + 1) * ctx];
            let finite: Vec<f64> = row
                .iter()
                .filter(|x| x.is_finite())
                .map(|&x| x as f64)
                .collect();
            let rms =
                (finite.iter().map(|x| x * x).sum::<f64>() / finite.len().max(1) as f64).sqrt();
            let (gap, why) = choice_gap(row, &engine, &ours);
            let noise = 3.0 * relative * rms;
            if gap - noise > worst_gap - worst_noise || differ.is_empty() {
                (worst_gap, worst_noise, worst_why) = (gap, noise, why);
            }
            differ.push(format!("row {r}: engine {engine:?}, mladb {ours:?}"));
            theirs.push((r, engine));
        }
        if differ.is_empty() {
            return self.report(
                Verdict::at(step, phase, module, op, index, rank)
                    .says("the same keys in every row".into(), false),
            );
        }
        let shown = differ
            .iter()
            .take(3)
            .cloned()
            .collect::<Vec<_>>()
            .join("; ");
        let more = if differ.len() > 3 {
            format!("; … {} rows in all", differ.len())
        } else {
            String::new()
        };
        if worst_gap <= worst_noise {
            let mut out = self.report(
                Verdict::at(step, phase, module, op, index, rank)
                    .says(format!("other keys within noise: {shown}{more}"), false),
            );
            let after = match self.force_choice(step, phase, op, &theirs) {
                Ok(()) => FOLLOWED.to_string(),
                Err(why) => {
                    if let Some(layer) = layer {
                        self.flip_layers(step, layer, index);
                    }
                    not_followed(&why)
                }
            };
            out.push(Live::Note {
                step: Some(step),
                rank,
                text: format!(
                    "selection-flip at {op}: the engine kept other keys, within the scores' noise of mladb's last kept key (gap {worst_gap:.2e}, noise {worst_noise:.2e}): {shown}{more}; {after}"
                ),
            });
            return out;
        }
        self.report(Verdict::at(step, phase, module, op, index, rank).says(format!("the engine {worst_why} (gap {worst_gap:.2e}, noise {worst_noise:.2e}): {shown}{more}"), true))
    }

    /// Remembers a flipped choice of `layer` and of the later layers that reuse its DSA
    /// selection (GLM-5's shared indexer layers).
    fn flip_layers(&mut self, step: u64, layer: usize, choice_index: usize) {
        let Some(run) = self.steps.get_mut(&step) else {
            return;
        };
        run.flips.push((layer, choice_index));
        let layout = &self.model.layout;
        for l in layer + 1..layout.num_layers {
            if layout.indexer_mode(l) != Some(crate::model::layout::IndexerMode::Shared) {
                break;
            }
            run.flips.push((l, 0));
        }
    }

    /// The experts the engine's router logits choose (by mladb's routing), against mladb's
    /// choice, row by row as `check` judges a choice: a row is a flip when each side's logits
    /// could have chosen as the other did with a change within their noise (`tolerance`, the
    /// logits' judged relative tolerance); then a note, and the layer remembered. A row beyond
    /// that is a finding at the choice, though the whole logits tensor agrees within tolerance
    /// (one token's logits far off among many).
    pub(super) fn selection_flip(
        &mut self,
        at: (u64, crate::engine::trace::Phase, &str),
        gate: &str,
        logits: &[f32],
        rows: usize,
        tolerance: f64,
    ) -> Vec<Live> {
        use crate::debug::selection::{choices_of, diff_row, run_choices, OtherRow};
        let (step, phase, module) = at;
        let Some(moe) = self.model.layout.moe.as_ref() else {
            return Vec::new();
        };
        let choice_op = format!("{gate}.topk_indices");
        let Some(choice_index) = self.op_index(step, &choice_op) else {
            return Vec::new();
        };
        let Ok(bias) = self
            .model
            .weights
            .get(&format!("{gate}.e_score_correction_bias"))
        else {
            return Vec::new();
        };
        let e = moe.n_routed_experts;
        if rows == 0 || logits.len() != rows * e || bias.data().len() != e {
            return Vec::new();
        }
        let engine = crate::ops::moe::route(
            &crate::tensor::Tensor::from_vec(&[rows, e], logits.to_vec()),
            bias.data(),
            moe,
        );
        let Some(seq) = self.seq_of(step) else {
            return Vec::new();
        };
        let event = &seq.record.events[choice_index];
        let listing: Vec<f32> = engine.experts.iter().flatten().map(|&x| x as f32).collect();
        let k = moe.num_experts_per_tok;
        let theirs = choices_of(
            event,
            (&[rows, k], &listing),
            Some((&[rows, e], logits)),
            self.model,
        );
        let ours = run_choices(&seq.record, choice_index, self.model);
        let (Some(theirs), Some(ours)) = (theirs, ours) else {
            return Vec::new();
        };
        if theirs.len() != ours.len() {
            return Vec::new();
        }
        let diffs: Vec<_> = ours
            .iter()
            .zip(&theirs)
            .enumerate()
            .filter_map(|(r, (a, b))| {
                diff_row(
                    event,
                    (choice_index, r),
                    a,
                    OtherRow { phase, row: r },
                    b,
                    tolerance,
                )
            })
            .collect();
        let Some(layer) = event.layer.filter(|_| !diffs.is_empty()) else {
            return Vec::new();
        };
        let describe = |d: &crate::debug::selection::SelectionDiff| {
            format!("row {}: engine {:?}, mladb {:?}", d.row, d.only_b, d.only_a)
        };
        let rank = None;
        if let Some(far) = diffs.iter().find(|d| !d.within_noise()) {
            let text = format!(
                "router logits that agree within tolerance as a whole choose other experts beyond their noise: {}",
                far.describe()
            );
            return self.report(
                super::live::Verdict::at(step, phase, module, &choice_op, choice_index, rank)
                    .says(text, true),
            );
        }
        let rows: Vec<_> = diffs.iter().map(|d| (d.row, d.chosen_b.clone())).collect();
        let after = match self.force_choice(step, phase, &choice_op, &rows) {
            Ok(()) => FOLLOWED.to_string(),
            Err(why) => {
                if let Some(run) = self.steps.get_mut(&step) {
                    run.flips.push((layer, choice_index));
                }
                not_followed(&why)
            }
        };
        vec![Live::Note {
            step: Some(step),
            rank,
            text: format!(
                "selection-flip at {choice_op}: router logits that agree within tolerance choose other experts ({}); {after}",
                diffs.iter().map(describe).collect::<Vec<_>>().join("; ")
            ),
        }]
    }

    /// The layer whose flipped choice explains a divergence of op `index` (an op of that layer
    /// after the choice, the layer's output included), if any.
    pub(super) fn explained_by_flip(&self, step: u64, index: usize) -> Option<usize> {
        let layer = self.seq_of(step)?.record.events[index].layer?;
        let run = self.steps.get(&step)?;
        run.flips
            .iter()
            .find(|&&(l, choice)| l == layer && index > choice)
            .map(|&(l, _)| l)
    }
}

/// What a flip's note says when mladb follows the engine's choice.
const FOLLOWED: &str = "mladb re-ran its reference with the engine's choice at those rows, and compares what follows with that";

/// What a flip's note says when mladb could not follow the engine's choice.
fn not_followed(why: &str) -> String {
    format!("the ops of the layer after it follow the engine's choice and are not judged ({why})")
}

/// How far, by mladb's scores of a row, the engine's kept keys are from a choice mladb could
/// have made with scores off by a little, and what makes it so: the larger of how far a key the
/// engine kept and mladb did not scores below mladb's last kept key, and how far a key mladb
/// kept and the engine dropped scores above the engine's last kept key (a swap near a tie is
/// small both ways; an engine that drops the best key, or keeps a far-off one, is not). Keeping
/// another number of keys than mladb is no near tie at all: infinite.
fn choice_gap(row: &[f32], engine: &[usize], ours: &[usize]) -> (f64, &'static str) {
    if engine.len() != ours.len() {
        return (f64::INFINITY, "kept another number of keys than mladb");
    }
    let score = |j: usize| row.get(j).map_or(f64::NEG_INFINITY, |&x| x as f64);
    let lowest = |keys: &[usize]| keys.iter().map(|&j| score(j)).fold(f64::INFINITY, f64::min);
    let (our_last, their_last) = (lowest(ours), lowest(engine));
    let beyond = |kept: &[usize], other: &[usize], gap: &dyn Fn(f64) -> f64| {
        kept.iter()
            .filter(|j| !other.contains(j))
            .map(|&j| gap(score(j)))
            .map(|g| if g.is_nan() { f64::INFINITY } else { g })
            .fold(0f64, f64::max)
    };
    let kept_below = beyond(engine, ours, &|x| our_last - x);
    let dropped_above = beyond(ours, engine, &|x| x - their_last);
    if dropped_above > kept_below {
        (
            dropped_above,
            "dropped keys scored above its own last kept key",
        )
    } else {
        (kept_below, "kept keys scored below mladb's last kept key")
    }
}
