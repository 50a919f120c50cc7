//! The routed experts of one MoE layer as one backend call, so that a device backend can run
//! them all together; a host backend runs them one at a time, in expert order. Weights are
//! fetched through the caller as they are needed, so a host run holds one expert at a time.

use super::Backend;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use std::sync::Arc;

/// One chosen expert and the tokens routed to it, with their routing weights.
pub struct ExpertJob {
    pub expert: usize,
    pub tokens: Vec<usize>,
    pub weights: Vec<f32>,
}

/// An expert's weights: gate and up [inter, hidden], down [hidden, inter].
pub struct ExpertWeights {
    pub gate: Arc<Tensor>,
    pub up: Arc<Tensor>,
    pub down: Arc<Tensor>,
}

/// What the routed experts of a layer computed.
pub struct RoutedOutput {
    /// Each job's down projection [its tokens, hidden], before its routing weight, in job order
    /// (empty unless asked for).
    pub per_job: Vec<Tensor>,
    /// The routing-weighted sum per token [n, hidden].
    pub sum: Tensor,
}

/// Fetches expert `e`'s weights (and records the reads).
pub type FetchExpert<'f> = dyn FnMut(usize) -> Result<ExpertWeights> + 'f;

/// Checks that the jobs are in ascending expert order and route rows of x [n, hidden], one
/// weight each.
pub fn check_jobs(x: &Tensor, jobs: &[ExpertJob]) -> Result<()> {
    let n = x.rows();
    for (i, j) in jobs.iter().enumerate() {
        if j.tokens.len() != j.weights.len() || j.tokens.iter().any(|&t| t >= n) {
            return Err(Error::invalid(format!(
                "expert {}: {} tokens with {} weights, of {n} rows",
                j.expert,
                j.tokens.len(),
                j.weights.len()
            )));
        }
        if i > 0 && jobs[i - 1].expert >= j.expert {
            return Err(Error::invalid("experts out of order"));
        }
    }
    Ok(())
}

impl ExpertWeights {
    /// Checks the shapes against an input of width `hidden` and an intermediate size `inter`
    /// (`None`: this expert's own).
    pub fn check(&self, expert: usize, hidden: usize, inter: Option<usize>) -> Result<usize> {
        let inter = inter.unwrap_or(self.gate.rows());
        let agree = self.gate.shape() == [inter, hidden]
            && self.up.shape() == [inter, hidden]
            && self.down.shape() == [hidden, inter];
        if !agree {
            return Err(Error::invalid(format!(
                "expert {expert}: gate {:?}, up {:?}, down {:?} for an input of width {hidden}",
                self.gate.shape(),
                self.up.shape(),
                self.down.shape()
            )));
        }
        Ok(inter)
    }
}

/// Each expert in turn: its tokens gathered, down(SiLU(gate(x)) · up(x)) (kept), added into a
/// zeroed output with its routing weights (the order HF accumulates in).
pub fn experts_one_by_one<B: Backend + ?Sized>(
    b: &B,
    x: &Tensor,
    jobs: &[ExpertJob],
    fetch: &mut FetchExpert,
) -> Result<RoutedOutput> {
    check_jobs(x, jobs)?;
    let mut routed = Tensor::zeros(x.shape())?;
    let mut per_job = Vec::with_capacity(jobs.len());
    for j in jobs {
        if j.tokens.is_empty() {
            per_job.push(Tensor::zeros(&[0, x.cols()])?);
            continue;
        }
        let w = fetch(j.expert)?;
        w.check(j.expert, x.cols(), None)?;
        let xs = b.gather_rows(x, &j.tokens)?;
        let act = b.silu_mul(&b.linear(&xs, &w.gate, None)?, &b.linear(&xs, &w.up, None)?)?;
        let y = b.linear(&act, &w.down, None)?;
        b.scatter_add_rows(&mut routed, &j.tokens, &y, &j.weights)?;
        per_job.push(y);
    }
    Ok(RoutedOutput {
        per_job,
        sum: routed,
    })
}
