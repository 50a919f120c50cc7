//! How far an op may amplify its inputs' relative error beyond its kind's gain, read from the
//! run's own values (the tolerance's `conditioning`, see `super::tolerance`):
//! * the DSA indexer's scores: terms that cancel, dots small beside their vectors
//!   (`super::indexer_scores`);
//! * a linear projection whose output at this op is small beside what the same projection gave
//!   so far: a rounding error in its input moves each output by about the projection's typical
//!   output size times that error, whatever this token's output is, so the relative error of a
//!   small output over a few values (the indexer's 4 head weights: 0.05 where they are 0.7 at
//!   other tokens) is that many times larger.

use super::record::RunRecord;
use super::sample::holds_all;
use crate::engine::trace::OpKind;
use std::collections::HashMap;

/// The largest factor given: an output that is zero where the projection's typical one is not.
const MOST: f64 = 1e6;

/// Each linear op's outputs seen so far (by rank and name, over the phases judged), kept as the
/// sum of squares of each output column and the number of rows, so that a run is read once.
#[derive(Debug, Default)]
pub struct OutputScales {
    seen: HashMap<(Option<usize>, String), (Vec<f64>, usize)>,
}

impl OutputScales {
    /// The conditioning of op `i` of `run`, having added its outputs to what it has seen (call
    /// once per op, in execution order).
    pub fn next(&mut self, run: &RunRecord, i: usize) -> f64 {
        let linear = run.events.get(i).filter(|e| e.kind == OpKind::Linear);
        if let (Some(e), Some((rows, cols))) = (linear, matrix(run, i)) {
            let key = (e.rank, e.name.clone());
            let (sums, count) = self.seen.entry(key).or_insert((vec![0.0; cols], 0));
            if sums.len() == cols {
                for row in rows.chunks_exact(cols) {
                    for (s, &v) in sums.iter_mut().zip(row) {
                        *s += v as f64 * v as f64;
                    }
                }
                *count += rows.len() / cols;
            }
        }
        self.peek(run, i)
    }

    /// The conditioning of op `i` from what has been seen, adding nothing (an op judged late).
    pub fn peek(&self, run: &RunRecord, i: usize) -> f64 {
        match run.events.get(i).map(|e| e.kind) {
            Some(OpKind::IndexScores) => super::indexer_scores::conditioning(run, i),
            Some(OpKind::Linear) => self.linear(run, i),
            _ => 1.0,
        }
    }

    /// ‖typical‖ / ‖y‖ for linear op `i`'s output y [n, m]: the typical output is each column's
    /// root mean square over the rows seen, n times over. At least 1; 1 where nothing is known.
    fn linear(&self, run: &RunRecord, i: usize) -> f64 {
        let e = &run.events[i];
        let (Some((rows, cols)), Some((sums, count))) =
            (matrix(run, i), self.seen.get(&(e.rank, e.name.clone())))
        else {
            return 1.0;
        };
        if *count == 0 || sums.len() != cols {
            return 1.0;
        }
        let n = (rows.len() / cols) as f64;
        let typical_sq = n * sums.iter().sum::<f64>() / *count as f64;
        let own_sq: f64 = rows.iter().map(|&v| v as f64 * v as f64).sum();
        match (own_sq > 0.0, typical_sq > 0.0) {
            (true, _) => (typical_sq / own_sq).sqrt().clamp(1.0, MOST),
            (false, true) => MOST,
            (false, false) => 1.0,
        }
    }
}

/// Op `i`'s whole output as rows of its last axis: (values, row width); `None` for a sample.
fn matrix(run: &RunRecord, i: usize) -> Option<(&[f32], usize)> {
    let (e, values) = (&run.events[i], run.outputs[i].data());
    let cols = *e.shape.last()?;
    (cols > 0 && holds_all(&e.shape, values.len())).then_some((values, cols))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::debug::runner::cpu_run;
    use crate::engine::generate::Schedule;
    use crate::engine::trace::Phase;
    use crate::tensor::Tensor;
    use std::sync::Arc;

    /// A projection's output shrunk 20 times at one token is conditioned about 20 times (its
    /// rounding error stays the projection's size); outputs of their usual size near 1.
    #[test]
    fn a_small_output_of_a_projection_is_conditioned_by_its_usual_size() {
        let schedule = Schedule {
            prompt: vec![3, 1, 4],
            prefill_len: 3,
            decode_steps: 6,
        };
        let mut run = cpu_run("glm5-tiny", 0, schedule);
        let name = "model.layers.0.self_attn.indexer.weights_proj";
        let shrunk = run.find(Phase::Decode(4), name).unwrap();
        let t = &run.outputs[shrunk];
        let small: Vec<f32> = t.data().iter().map(|v| v * 0.05).collect();
        let shape = run.events[shrunk].shape.clone();
        run.outputs[shrunk] = Arc::new(Tensor::from_vec(&shape, small));
        let mut scales = OutputScales::default();
        for i in 0..run.len() {
            let k = scales.next(&run, i);
            if run.events[i].name != name || run.events[i].phase == Phase::Prefill {
                continue;
            }
            if i == shrunk {
                assert!((12.0..40.0).contains(&k), "{k}");
            } else {
                assert!((1.0..3.0).contains(&k), "{} {k}", run.events[i].phase);
            }
        }
    }
}
