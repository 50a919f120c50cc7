//! Op-level types that the engine hands to the backends and both share: RoPE tables, cached rows
//! (with the slot where a device backend keeps its copy), the storage type, the faults a kernel
//! carries out, which attention kernels run (`kernels`), top-k and MoE routing, and the FP8
//! latent cache format (`kv_fp8`). This module sits below both: the engine and the backends
//! import it, it imports neither (so a backend never depends on the engine).

pub mod kernels;
pub mod kv_fp8;
pub mod moe;
pub mod rope;
pub mod rows;

use serde::{Deserialize, Serialize};

pub use kernels::{
    AttnKernel, AttnKernels, DecodeVariant, KernelInfo, KernelLaunch, PrefillVariant,
    PLANTED_OFFSET32,
};
pub use kv_fp8::{Fp8Faults, KvCacheDtype};
pub use moe::{top_k_indices, Routing};
pub use rope::RopeTable;
pub use rows::{MirrorSlot, RowSource, PAGE_SIZE};

/// How activations are stored between ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StorageDtype {
    /// f32 throughout.
    #[default]
    F32,
    /// Every op's output rounded to bf16 (round to nearest even), arithmetic in f32: what bf16
    /// activation storage with f32 accumulation does to the numbers.
    Bf16,
}

/// The name `--dtype` takes (`f32`, `bf16`), for headers and logs.
impl std::fmt::Display for StorageDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            StorageDtype::F32 => "f32",
            StorageDtype::Bf16 => "bf16",
        })
    }
}

impl std::str::FromStr for StorageDtype {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::error::Result<StorageDtype> {
        match s {
            "f32" => Ok(StorageDtype::F32),
            "bf16" => Ok(StorageDtype::Bf16),
            other => Err(crate::Error::invalid(format!(
                "dtype '{other}' is not f32 or bf16"
            ))),
        }
    }
}

/// The faults an attention kernel itself carries out (the rest act in the engine).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelFaults {
    pub lse_base_mismatch: bool,
    pub skip_padded_rows: bool,
    /// The fast kernels' exp2 softmax handed the scale without log2 e (the reference kernels
    /// compute in exp and ignore it).
    pub exp2_scale: bool,
    /// The flash prefill steps its value tiles by the keys' row width (the reference kernels
    /// ignore it).
    pub kv_stride_mismatch: bool,
    /// The fast decode's page offsets computed in 32 bits, over a pool past 4 GiB (the
    /// reference kernels ignore it).
    pub page_index_overflow: bool,
}
