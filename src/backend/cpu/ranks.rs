//! Tensor-parallel ranks on the CPU: simulated one after another in this process, each with a
//! CPU backend, joined by an all-reduce that sums the parts in rank order (exact, and the same on
//! every rank). The engine runs them through the same collective path as ranks on GPUs joined by
//! NCCL, so that path is what CI tests.

use super::CpuBackend;
use crate::backend::{checks::same_shape, AllReduce, Backend, RankBackends, SumClock};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use std::sync::Arc;

/// `size` simulated ranks (none for one).
pub fn rank_backends(size: usize) -> Option<RankBackends> {
    (size > 1).then(|| RankBackends {
        backends: (0..size)
            .map(|_| Arc::new(CpuBackend) as Arc<dyn Backend>)
            .collect(),
        all_reduce: Some(Arc::new(HostSum::default())),
        note: format!(
            "{size} ranks simulated one after another on the cpu backend, joined by exact sums in \
             rank order"
        ),
    })
}

/// The sum of the ranks' parts in rank order, in f32.
#[derive(Default)]
struct HostSum {
    clock: SumClock,
}

impl AllReduce for HostSum {
    fn sum(&self, parts: &[&Tensor]) -> Result<Vec<Tensor>> {
        self.clock.time(|| {
            let (first, rest) = parts
                .split_first()
                .ok_or_else(|| Error::invalid("an all-reduce of no parts"))?;
            let mut total = first.data().to_vec();
            for p in rest {
                same_shape("all-reduce", first, p)?;
                for (t, v) in total.iter_mut().zip(p.data()) {
                    *t += v;
                }
            }
            Ok(parts
                .iter()
                .map(|_| Tensor::from_vec(first.shape(), total.clone()))
                .collect())
        })
    }

    fn seconds(&self) -> f64 {
        self.clock.seconds()
    }
}
