//! The ranks of a tensor-parallel run on CUDA. A host with a device per rank runs rank r on
//! device r, each with a backend of its own, and sums across them through NCCL. A host with fewer
//! devices runs every rank on device 0, still each with a backend of its own, and sums in rank
//! order on that device, as the CPU does (NCCL cannot join two ranks on one device).

use super::device::nccl::{nccl_version, NcclRanks};
use super::device::{DevBuf, Gpu};
use super::{buf, CudaBackend};
use crate::backend::{AllReduce, Backend, RankBackends, SumClock};
use crate::error::{CudaError, Error, Result};
use crate::tensor::Tensor;
use cudarc::driver::CudaContext;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The rank backends a backend has made, by rank count: devices are opened (their kernels
/// compiled) and NCCL communicators set up once, not per run.
#[derive(Default)]
pub(super) struct RanksCache(Mutex<HashMap<usize, RankBackends>>);

impl CudaBackend {
    pub(super) fn rank_backends_of(&self, size: usize) -> Result<Option<RankBackends>> {
        if size <= 1 {
            return Ok(None);
        }
        let mut cache = self.ranks.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(made) = cache.get(&size) {
            return Ok(Some(made.clone()));
        }
        let count = CudaContext::device_count().map_err(CudaError::driver("device count"))?;
        let made = match usize::try_from(count).unwrap_or(0) >= size {
            true => self.one_device_each(size)?,
            false => self.sharing_device(size, count),
        };
        cache.insert(size, made.clone());
        Ok(Some(made))
    }

    /// Rank r on device r, joined by NCCL.
    fn one_device_each(&self, size: usize) -> Result<RankBackends> {
        let gpus = (0..size)
            .map(|o| match o == self.gpu.ordinal() {
                true => Ok(self.gpu.clone()),
                false => Gpu::open(o).map(Arc::new),
            })
            .collect::<Result<Vec<_>>>()?;
        let nccl = NcclRanks::new(gpus.clone())?;
        let version = nccl_version()?;
        let backends: Vec<Arc<CudaBackend>> = gpus
            .into_iter()
            .map(|g| Arc::new(CudaBackend::on(g, self.elem)))
            .collect();
        Ok(RankBackends {
            backends: backends
                .iter()
                .map(|b| b.clone() as Arc<dyn Backend>)
                .collect(),
            all_reduce: Some(Arc::new(NcclSum {
                backends,
                nccl: Mutex::new(nccl),
                clock: SumClock::default(),
            })),
            note: format!(
                "{size} ranks on CUDA devices 0..={}, one each, joined by NCCL {version}",
                size - 1
            ),
        })
    }

    /// Every rank on this backend's device, each with a backend of its own.
    fn sharing_device(&self, size: usize, count: i32) -> RankBackends {
        RankBackends {
            backends: (0..size)
                .map(|_| Arc::new(CudaBackend::on(self.gpu.clone(), self.elem)) as Arc<dyn Backend>)
                .collect(),
            all_reduce: None,
            note: format!(
                "{size} ranks share CUDA device {} ({count} device{} here): their collectives \
                 are exact sums on it in rank order, not NCCL",
                self.gpu.ordinal(),
                if count == 1 { "" } else { "s" }
            ),
        }
    }
}

/// The all-reduce through NCCL, rank r's part summed on device r.
struct NcclSum {
    backends: Vec<Arc<CudaBackend>>,
    nccl: Mutex<NcclRanks>,
    clock: SumClock,
}

impl AllReduce for NcclSum {
    fn sum(&self, parts: &[&Tensor]) -> Result<Vec<Tensor>> {
        let shape = parts.first().map(|t| t.shape()).unwrap_or_default();
        if parts.len() != self.backends.len() || parts.iter().any(|t| t.shape() != shape) {
            return Err(Error::invalid(format!(
                "all-reduce over {} ranks given {} parts of differing shapes",
                self.backends.len(),
                parts.len()
            )));
        }
        // Each part on its rank's device (an input made on the host, such as the embedding's
        // rows, is uploaded there).
        let devs = parts
            .iter()
            .zip(&self.backends)
            .map(|(t, b)| b.dev(t))
            .collect::<Result<Vec<_>>>()?;
        let sends: Vec<&DevBuf> = devs.iter().map(buf).collect();
        // The time counted starts when every rank's part is ready.
        for b in &self.backends {
            b.gpu.synchronize()?;
        }
        let nccl = self.nccl.lock().unwrap_or_else(|p| p.into_inner());
        let sums = self.clock.time(|| nccl.all_reduce_sum(&sends))?;
        sums.into_iter()
            .zip(&self.backends)
            .map(|(s, b)| b.finish(s, shape))
            .collect()
    }

    fn seconds(&self) -> f64 {
        self.clock.seconds()
    }
}
