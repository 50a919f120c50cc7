//! Which attention kernels run, and what a launch of one looked like.
//!
//! On the GPU the engine's attention runs either the production kernels (`fast`: the tensor-core
//! MLA decode over the paged latent cache with its split-KV merge, and the flash prefill) or the
//! debugger's reference kernels (`reference`: simple kernels that also write the probabilities
//! and carry the fault injections). The choice is a flag (`--attn-kernel`, `:set attn-kernel`);
//! the variant of each fast kernel is chosen for the device unless `--decode-variant` /
//! `--prefill-variant` force one. Every attention op on the GPU says in the trace which kernel
//! ran, with its launch geometry, or why the fast kernel declined.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The attention kernels the GPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttnKernel {
    /// The production kernels (tensor cores, split-KV, no probabilities).
    #[default]
    Fast,
    /// The debugger's simple kernels (probabilities written, faults planted).
    Reference,
}

impl std::str::FromStr for AttnKernel {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::error::Result<AttnKernel> {
        match s {
            "fast" => Ok(AttnKernel::Fast),
            "reference" => Ok(AttnKernel::Reference),
            other => Err(crate::Error::invalid(format!(
                "attn-kernel '{other}' is not fast or reference"
            ))),
        }
    }
}

impl fmt::Display for AttnKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttnKernel::Fast => "fast",
            AttnKernel::Reference => "reference",
        })
    }
}

/// A variant of the tensor-core MLA decode (kernels/mla_decode*.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecodeVariant {
    /// Hopper only: TMA-fed tiles, warpgroup MMAs (mla_decode_sm90.cu).
    Wgmma,
    /// Split-k S with its tiles copied by TMA, three stages (sm_90 and later).
    Kt3,
    /// Split-k S, P·V by output dims, three cp.async stages.
    Ks3,
    /// The same in two stages.
    Ks2,
    /// 32-token tiles, two stages (A100).
    T32,
    /// 16-token tiles, one stage: fits 99 KB of shared memory (sm_86/89).
    T16,
    /// 32 heads a block, Q in registers, four 16-token stages by TMA: fits 99 KB of shared
    /// memory with TMA (sm_120).
    Kt16,
    /// The 8-head kernels (sm_90 and later): up to 8 heads a block as the MMAs' columns, over an
    /// FP8 cache dense or sparse (mla_decode_fp8_h8.cu), over a bf16 cache sparse only
    /// (mla_sparse_h8.cu).
    H8,
    /// FP8 cache only (sm_90 and later): 16 heads a block as rows, dense or sparse
    /// (mla_decode_fp8.cu).
    H16,
}

impl DecodeVariant {
    /// Every variant, in order of preference.
    pub const ALL: [DecodeVariant; 9] = [
        DecodeVariant::Wgmma,
        DecodeVariant::Kt3,
        DecodeVariant::Ks3,
        DecodeVariant::Ks2,
        DecodeVariant::Kt16,
        DecodeVariant::T32,
        DecodeVariant::T16,
        DecodeVariant::H8,
        DecodeVariant::H16,
    ];

    /// The short name (`ks3`), as flags take it.
    pub fn tag(self) -> &'static str {
        match self {
            DecodeVariant::Wgmma => "wgmma",
            DecodeVariant::Kt3 => "kt3",
            DecodeVariant::Ks3 => "ks3",
            DecodeVariant::Ks2 => "ks2",
            DecodeVariant::T32 => "t32",
            DecodeVariant::T16 => "t16",
            DecodeVariant::Kt16 => "kt16",
            DecodeVariant::H8 => "h8",
            DecodeVariant::H16 => "h16",
        }
    }

    /// The kernel's name in the CUDA sources (`mla_decode_ks3`; the FP8-only variants' one
    /// form, `mla_decode_fp8_h8`).
    pub fn kernel(self) -> &'static str {
        match self {
            DecodeVariant::Wgmma => "mla_decode_wgmma",
            DecodeVariant::Kt3 => "mla_decode_kt3",
            DecodeVariant::Ks3 => "mla_decode_ks3",
            DecodeVariant::Ks2 => "mla_decode_ks2",
            DecodeVariant::T32 => "mla_decode_t32",
            DecodeVariant::T16 => "mla_decode_t16",
            DecodeVariant::Kt16 => "mla_decode_kt16",
            DecodeVariant::H8 => "mla_decode_fp8_h8",
            DecodeVariant::H16 => "mla_decode_fp8_h16",
        }
    }
}

impl std::str::FromStr for DecodeVariant {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::error::Result<DecodeVariant> {
        // A kernel's name: its variant (`mla_decode_fp8_ks3` is the FP8 form of ks3,
        // `mla_decode_wgmma_fp8` of wgmma, `mla_sparse_wgmma_fp8` its sparse form).
        let tag = (s.strip_prefix("mla_decode_"))
            .or_else(|| s.strip_prefix("mla_sparse_"))
            .unwrap_or(s);
        let tag = tag.strip_prefix("fp8_").unwrap_or(tag);
        let tag = tag.strip_suffix("_fp8").unwrap_or(tag);
        DecodeVariant::ALL
            .into_iter()
            .find(|v| v.tag() == tag)
            .ok_or_else(|| {
                crate::Error::invalid(format!(
                    "decode variant '{s}' is not one of {}",
                    tags(DecodeVariant::ALL.map(DecodeVariant::tag))
                ))
            })
    }
}

/// A variant of the flash prefill (kernels/flash_prefill*.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefillVariant {
    /// Hopper only, head dims 256/256: TMA and warpgroup MMAs (flash_prefill_sm90.cu).
    Wgmma,
    /// 128 query rows a block, 64-token K/V tiles by TMA, two stages.
    K128t64,
    /// The same with cp.async.
    R128t64,
    /// 64 rows, 32-token tiles by TMA, two stages.
    K64t32,
    /// 64 rows, 64-token tiles, one stage.
    R64t64,
    /// 128 rows, 32-token tiles, two stages.
    R128t32,
    /// 64 rows, 32-token tiles, one stage (the smallest).
    R64t32,
}

impl PrefillVariant {
    /// Every variant, in order of preference.
    pub const ALL: [PrefillVariant; 7] = [
        PrefillVariant::Wgmma,
        PrefillVariant::K128t64,
        PrefillVariant::R128t64,
        PrefillVariant::K64t32,
        PrefillVariant::R64t64,
        PrefillVariant::R128t32,
        PrefillVariant::R64t32,
    ];

    /// The short name (`k128t64`), as flags take it.
    pub fn tag(self) -> &'static str {
        match self {
            PrefillVariant::Wgmma => "wgmma",
            PrefillVariant::K128t64 => "k128t64",
            PrefillVariant::R128t64 => "r128t64",
            PrefillVariant::K64t32 => "k64t32",
            PrefillVariant::R64t64 => "r64t64",
            PrefillVariant::R128t32 => "r128t32",
            PrefillVariant::R64t32 => "r64t32",
        }
    }
}

impl std::str::FromStr for PrefillVariant {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::error::Result<PrefillVariant> {
        PrefillVariant::ALL
            .into_iter()
            .find(|v| v.tag() == s)
            .ok_or_else(|| {
                crate::Error::invalid(format!(
                    "prefill variant '{s}' is not one of {}",
                    tags(PrefillVariant::ALL.map(PrefillVariant::tag))
                ))
            })
    }
}

fn tags<const N: usize>(all: [&str; N]) -> String {
    all.join(", ")
}

/// The attention kernels a run asks for: fast or reference, and a forced variant of each fast
/// kernel (`None`: the first the device runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct AttnKernels {
    pub kernel: AttnKernel,
    #[serde(default)]
    pub decode: Option<DecodeVariant>,
    #[serde(default)]
    pub prefill: Option<PrefillVariant>,
}

/// One kernel launch as the trace records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelLaunch {
    /// The kernel's name in the CUDA sources.
    pub kernel: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Dynamic shared memory per block, bytes.
    pub shared_bytes: u32,
    /// KV splits (1 for kernels that do not split).
    pub splits: u32,
    /// Blocks a cluster along x: 2 where a pair of splits merges inside the kernel (no
    /// partials, no merge kernel); 1 for a launch without clusters.
    #[serde(default = "one")]
    pub cluster: u32,
}

fn one() -> u32 {
    1
}

impl fmt::Display for KernelLaunch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [gx, gy, gz] = self.grid;
        let [bx, by, bz] = self.block;
        write!(
            f,
            "{} grid ({gx},{gy},{gz}) block ({bx},{by},{bz}) smem {} B",
            self.kernel, self.shared_bytes
        )?;
        if self.splits > 1 {
            write!(f, " splits {}", self.splits)?;
        }
        if self.cluster > 1 {
            write!(f, " in clusters of {}", self.cluster)?;
        }
        Ok(())
    }
}

/// The name suffix of the decode kernels with page-index-overflow planted
/// (`mla_decode_ks3_o32`): the launcher runs them in place of the device's variant when the
/// fault is injected, and the debugger recognises them in the trace by it.
pub const PLANTED_OFFSET32: &str = "_o32";

/// Which kernels ran an attention op: their launches (the split kernel, then the merge), or that
/// the reference kernel ran and why (the flag asked for it, or the fast kernel declined).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KernelInfo {
    #[serde(default)]
    pub launches: Vec<KernelLaunch>,
    /// The reference kernel ran this op, and why (the flag, or what the fast kernel declined).
    #[serde(default)]
    pub reference: Option<String>,
}

impl fmt::Display for KernelInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let launches: Vec<String> = self.launches.iter().map(|l| l.to_string()).collect();
        f.write_str(&launches.join(" → "))?;
        if let Some(why) = &self.reference {
            if !launches.is_empty() {
                f.write_str("; ")?;
            }
            write!(f, "reference kernel: {why}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_parse_from_their_tags_and_kernel_names() {
        for v in DecodeVariant::ALL {
            assert_eq!(v.tag().parse::<DecodeVariant>().unwrap(), v);
            assert_eq!(v.kernel().parse::<DecodeVariant>().unwrap(), v);
        }
        for v in PrefillVariant::ALL {
            assert_eq!(v.tag().parse::<PrefillVariant>().unwrap(), v);
        }
        // The FP8-cache kernels' names, dense and sparse, read as their variants.
        for (name, v) in [
            ("mla_decode_fp8_ks3", DecodeVariant::Ks3),
            ("mla_decode_wgmma_fp8", DecodeVariant::Wgmma),
            ("mla_sparse_wgmma_fp8", DecodeVariant::Wgmma),
            ("mla_sparse_fp8_h16", DecodeVariant::H16),
        ] {
            assert_eq!(name.parse::<DecodeVariant>().unwrap(), v, "{name}");
        }
        let err = "t8".parse::<DecodeVariant>().unwrap_err().to_string();
        assert!(err.contains("wgmma, kt3"), "{err}");
        assert!("r32".parse::<PrefillVariant>().is_err());
        assert_eq!(
            "reference".parse::<AttnKernel>().unwrap(),
            AttnKernel::Reference
        );
        assert!("slow".parse::<AttnKernel>().is_err());
    }

    #[test]
    fn a_launch_reads_as_one_line() {
        let l = KernelLaunch {
            kernel: "mla_decode_ks3".into(),
            grid: [4, 64, 1],
            block: [256, 1, 1],
            shared_bytes: 222_000,
            splits: 4,
            cluster: 1,
        };
        let info = KernelInfo {
            launches: vec![l.clone()],
            reference: None,
        };
        assert_eq!(
            info.to_string(),
            "mla_decode_ks3 grid (4,64,1) block (256,1,1) smem 222000 B splits 4"
        );
        // Two splits merged inside the kernel by a cluster of two blocks (no partials).
        let paired = KernelLaunch {
            kernel: "mla_decode_wgmma".into(),
            grid: [2, 64, 1],
            splits: 2,
            cluster: 2,
            ..l
        };
        assert_eq!(
            paired.to_string(),
            "mla_decode_wgmma grid (2,64,1) block (256,1,1) smem 222000 B splits 2 in clusters of 2"
        );
        let declined = KernelInfo {
            launches: vec![],
            reference: Some("latent width 64 (built for 512)".into()),
        };
        assert_eq!(
            declined.to_string(),
            "reference kernel: latent width 64 (built for 512)"
        );
    }
}
