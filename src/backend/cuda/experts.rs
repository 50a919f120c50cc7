//! The routed experts of an MoE layer on the device in a few launches: every expert's gate and
//! up projections with the SiLU gate in one, the down projections in another, the weighted sum
//! per token in a third (kernels/experts.cu), instead of gather, three GEMMs, the gate and a
//! scatter per expert with two uploads each. Experts with many tokens (long prefills) go
//! through cuBLAS, where the tensor cores pay.

use super::device::expert_kernels::{ExpertWeights as Bufs, EXPERT_TILE};
use super::device::DevBuf;
use super::{buf, CudaBackend};
use crate::backend::experts::{check_jobs, ExpertJob, FetchExpert, RoutedOutput};
use crate::backend::Backend;
use crate::error::Result;
use crate::tensor::Tensor;

/// Experts with more tokens than this run through cuBLAS: the streaming kernels read an
/// expert's weights once per tile of [`EXPERT_TILE`] tokens.
const STREAMED_MAX_TOKENS: usize = 4 * EXPERT_TILE;

/// Weight bytes fetched and held at once: the experts are run in groups of about this much, so
/// a prefill that touches every expert does not hold all of them.
const GROUP_BYTES: usize = 2 << 30;

impl CudaBackend {
    pub(super) fn experts_together(
        &self,
        x: &Tensor,
        jobs: &[ExpertJob],
        fetch: &mut FetchExpert,
        each: bool,
    ) -> Result<RoutedOutput> {
        check_jobs(x, jobs)?;
        let (n, hidden) = (x.rows(), x.cols());
        let xd = self.dev(x)?;
        let out = self.out(n * hidden)?;
        // Slots (one per token of each job) are numbered job by job, so each job's are
        // consecutive and each token's come in expert order.
        let (mut slot_tokens, mut slot_weights, mut first_slot) =
            (Vec::new(), Vec::new(), Vec::new());
        for j in jobs {
            first_slot.push(slot_tokens.len());
            slot_tokens.extend_from_slice(&j.tokens);
            slot_weights.extend_from_slice(&j.weights);
        }
        let slots = slot_tokens.len();
        if slots == 0 {
            self.gpu.fill(&out, false)?;
            return Ok(RoutedOutput {
                per_job: jobs
                    .iter()
                    .filter(|_| each)
                    .map(|_| Tensor::zeros(&[0, hidden]))
                    .collect::<Result<_>>()?,
                sum: self.finish(out, x.shape())?,
            });
        }
        // Poisoned when outputs are: rows no kernel wrote show in each expert's op.
        let y = self.out(slots * hidden)?;
        let (mut inter, mut act): (Option<usize>, Option<DevBuf>) = (None, None);
        let mut tables = None;
        let mut next = 0;
        while next < jobs.len() {
            // A group of experts: fetched, then run.
            let mut group = Vec::new();
            let mut bytes = 0usize;
            while next < jobs.len() && (group.is_empty() || bytes < GROUP_BYTES) {
                let j = &jobs[next];
                next += 1;
                if j.tokens.is_empty() {
                    continue;
                }
                let w = fetch(j.expert)?;
                let size = w.check(j.expert, hidden, inter)?;
                inter = Some(size);
                bytes += 3 * size * hidden * self.elem.size();
                let devs = [self.dev(&w.gate)?, self.dev(&w.up)?, self.dev(&w.down)?];
                group.push((next - 1, w, devs));
            }
            let Some(inter) = inter else {
                break;
            };
            if act.is_none() {
                act = Some(self.gpu.alloc(slots * inter, self.elem)?);
            }
            let act = act.as_ref().expect("made above");
            let (mut streamed, mut tiles) = (Vec::new(), Vec::new());
            for (ji, w, devs) in &group {
                let (m, first) = (jobs[*ji].tokens.len(), first_slot[*ji]);
                if m <= STREAMED_MAX_TOKENS {
                    for t0 in (0..m).step_by(EXPERT_TILE) {
                        tiles.push((streamed.len(), first + t0, (m - t0).min(EXPERT_TILE)));
                    }
                    streamed.push(Bufs {
                        gate: buf(&devs[0]),
                        up: buf(&devs[1]),
                        down: buf(&devs[2]),
                    });
                } else {
                    let xs = self.gather_rows(x, &jobs[*ji].tokens)?;
                    let gated = self.silu_mul(
                        &self.linear(&xs, &w.gate, None)?,
                        &self.linear(&xs, &w.up, None)?,
                    )?;
                    let ye = self.linear(&gated, &w.down, None)?;
                    self.gpu
                        .copy(buf(&self.dev(&ye)?), 0, &y, first * hidden, m * hidden)?;
                }
            }
            let t = self.gpu.expert_tables(
                &streamed,
                &tiles,
                &slot_tokens,
                &slot_weights,
                n,
                (hidden, inter),
                self.elem,
            )?;
            self.gpu.experts_gate_up(&t, buf(&xd), act)?;
            self.gpu.experts_down(&t, act, &y)?;
            tables = Some(t);
        }
        let tables = tables.expect("jobs with slots ran");
        self.gpu.experts_combine(&tables, &y, &out)?;
        // Each job's rows of y as a tensor of its own, for the trace's op of each expert.
        let mut per_job = Vec::with_capacity(jobs.len());
        for (j, &first) in jobs.iter().zip(&first_slot).filter(|_| each) {
            let m = j.tokens.len();
            if m == 0 {
                per_job.push(Tensor::zeros(&[0, hidden])?);
                continue;
            }
            let rows = self.gpu.alloc(m * hidden, self.elem)?;
            self.gpu.copy(&y, first * hidden, &rows, 0, m * hidden)?;
            per_job.push(self.finish(rows, &[m, hidden])?);
        }
        Ok(RoutedOutput {
            per_job,
            sum: self.finish(out, x.shape())?,
        })
    }
}
