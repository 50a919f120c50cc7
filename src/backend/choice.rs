//! Which backend runs: `--device cpu|cuda|auto`, with `auto` settled once per process.

use super::{cpu, cuda, Backend};
use crate::error::Result;
use crate::ops::StorageDtype;

/// Which backend `--device` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    Cuda,
    Auto,
}

impl DeviceChoice {
    /// `auto` made definite, once per process: the GPU when one can be used, else the CPU
    /// (saying why on stderr). What describes the run (its device flag, its default dtype) and
    /// the backend that runs it then agree: an `auto` left open ran on the GPU while the run's
    /// flags said CPU and f32, which turned the GPU's detectors off and made a recorded session
    /// fail its own verification.
    pub fn resolved(self) -> DeviceChoice {
        static AUTO: std::sync::OnceLock<DeviceChoice> = std::sync::OnceLock::new();
        match self {
            DeviceChoice::Auto => *AUTO.get_or_init(|| match cuda::probe() {
                Ok(()) => DeviceChoice::Cuda,
                Err(why) => {
                    eprintln!("device auto: using the CPU ({why})");
                    DeviceChoice::Cpu
                }
            }),
            definite => definite,
        }
    }
}

/// Picks the backend for a device choice; `storage` is the device's storage type. Returns the
/// backend and, when `auto` fell back to the CPU, why.
pub fn select(
    choice: DeviceChoice,
    storage: StorageDtype,
) -> Result<(Box<dyn Backend>, Option<String>)> {
    match choice {
        DeviceChoice::Cpu => Ok((Box::new(cpu::CpuBackend), None)),
        DeviceChoice::Cuda => Ok((Box::new(cuda::CudaBackend::new(storage)?), None)),
        DeviceChoice::Auto => match cuda::probe() {
            Ok(()) => match cuda::CudaBackend::new(storage) {
                Ok(b) => Ok((Box::new(b), None)),
                Err(e) => Ok((
                    Box::new(cpu::CpuBackend),
                    Some(format!("device auto: using the CPU ({e})")),
                )),
            },
            Err(why) => Ok((
                Box::new(cpu::CpuBackend),
                Some(format!("device auto: using the CPU ({why})")),
            )),
        },
    }
}
