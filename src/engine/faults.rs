//! Fault injection: a catalogue of MLA bug classes seen in public backends, each planted beside
//! the code it corrupts, off by default. Checking one is a bit test, so there is no cost when off.
//!
//! | fault | what goes wrong | where it lives |
//! |---|---|---|
//! | `output-buffer-disconnect` | the attention wrapper hands the kernel a phantom output buffer and returns its own, never written (the vLLM garbage-output bug); only while the MLA backend serves the run, so `--mla-disable` routes around it | engine/attention.rs, the attention wrapper |
//! | `softmax-scale-latent` | absorbed attention scaled by the latent width (kv_lora_rank + qk_rope)^-0.5 instead of (qk_nope + qk_rope)^-0.5 | engine/attention.rs, the softmax scale |
//! | `absorb-wrong-split` | W_UK and W_UV taken from the wrong rows of kv_b_proj (as if each head were [W_UV; W_UK]) | engine/attention.rs, the kv_b_proj split |
//! | `rope-noninterleaved` | the query's RoPE uses the split-half layout while the key's is interleaved | engine/attention.rs, q_rope |
//! | `lse-base-mismatch` | split-KV partials' log-sum-exps merged in the wrong base (log2 against natural log) | the split-KV merges: the fast decode's (kernels/mla_decode.cu, which then splits every 64 tokens; contexts of 64 or fewer go to the reference kernel, which splits every 8) and the reference kernels' (backend/cpu/attention.rs, kernels/attention.cu) |
//! | `skip-padded-rows` | output rows left unwritten. In the fast decode, the zero-length sequences padding a CUDA-graph batch: its merge skips rows with no keys (the FlashInfer/vLLM bug that left padded rows unwritten or NaN); under it the batch always has a padded row (padded to the next capture size where it would have none) and always splits. In the reference kernels, the last head of every query, as a kernel that counts the head group's padding one row too many | the fast decode's merge (kernels/mla_decode.cu, the padded batch in backend/cuda/fast_attention.rs) and the reference kernels (backend/cpu/attention.rs, kernels/attention.cu) |
//! | `kv-cache-off-by-one` | decode writes a token's latent row one slot early, so its own slot stays unwritten | engine/attention/cache_writes.rs, the slot mapping, which the GPU's cache-write kernels follow (kernels/cache_write.cu, kernels/kv_fp8.cu) |
//! | `exp2-scale` | the fast kernels' softmax runs in base 2, but the launcher hands them the scale without the log2 e factor (every score too small by ln 2); the reference kernels use exp, so only the fast ones carry it | backend/cuda/fast_attention.rs, where the kernels' scale is computed |
//! | `kv-stride-mismatch` | the flash prefill steps its value tiles by the keys' row width (qk_nope + qk_rope) where the values' (v_head) belongs, so keys and values drift apart after the first tile; acts where the two differ (DeepSeek-V3's 192/128, not GLM-5's 256/256); only the fast GPU prefill carries it | kernels/flash_prefill.cu, the value tile loader |
//! | `indexer-rope-layout` | the DSA indexer's RoPE uses the other layout (interleaved vs split-half) than its checkpoint; the main attention's is right. Only a reference dump shows it: every path shares the indexer | engine/attention/indexer.rs |
//! | `yarn-mscale` | under YaRN, the softmax scale takes `mscale` where `mscale_all_dim` belongs (a difference only where the two differ). Only a reference dump shows it: both paths share the scale | engine/attention.rs, the softmax scale |
//! | `q4k-scale-unpack` | the dequantization kernel unpacks the 6-bit scales and mins of Q4_K sub-blocks 4..7 as if they were 0..3 (acts on a quantized kv_b_proj) | model/quant.rs, `dequantize_with` |
//! | `fp8-scale-default` | the FP8 latent cache's tile scales stay at 1.0, as if the loader step that sets them was skipped: values past 448 clamp, small ones fall among the subnormals (acts with `--kv-cache-dtype fp8_ds_mla`) | ops/kv_fp8.rs, `tile_scale_with`, and the write kernel kernels/kv_fp8.cu |
//! | `fp8-amax-padded-rows` | each tile's amax also covers unwritten padding holding stale values (at least 1e4), so the scale is far too large and the real values are crushed toward zero (acts with `--kv-cache-dtype fp8_ds_mla`) | the same |
//! | `tp-head-offset` | under tensor parallelism, each rank's kv_b_proj holds the heads of the next rank (rank r reads shard r+1 mod N) while its queries and o_proj hold its own | engine/attention/kv_b.rs |
//! | `tp-missing-allreduce` | o_proj's partial sums are not all-reduced: each rank carries on with its own heads' share | engine/tp.rs, the all-reduce |
//! | `tp-double-reduce` | o_proj's partial sums are all-reduced twice (the layer and its caller both reduce): N times the sum | engine/tp.rs, the all-reduce |
//! | `tp-absorb-unsliced` | the absorbed path's query absorption reads the whole W_UK from its start while the query holds only the rank's heads, so every rank uses rank 0's heads; W_UV is sliced right | engine/attention/kv_b.rs |
//! | `page-index-overflow` | the fast decode computes a page's byte offset (page × page bytes) in 32 bits, which wraps for pages past the first 4 GiB of the pool and reads rows 4 GiB early. Planted in the dense bf16 decode (`mla_decode_ks3_o32`, `mla_decode_t16_o32`, run in place of the device's variant), with the cache's pages placed past 4 GiB of a pool larger than that so that it acts (and every wrapped read stays inside the pool); a sparse selection or an fp8_ds_mla cache goes to the reference kernel under it | kernels/common.cuh `paged_row`, backend/cuda/fast_attention.rs (the pool) |
//!
//! A fault may be limited to one phase, `NAME@prefill` or `NAME@decode`, or act in both,
//! `NAME@both` (the default of all but the two decode-kernel faults, which default to decode).

use super::trace::Phase;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    OutputBufferDisconnect,
    SoftmaxScaleLatent,
    AbsorbWrongSplit,
    RopeNoninterleaved,
    LseBaseMismatch,
    SkipPaddedRows,
    KvCacheOffByOne,
    Q4kScaleUnpack,
    Exp2Scale,
    IndexerRopeLayout,
    YarnMscale,
    KvStrideMismatch,
    Fp8ScaleDefault,
    Fp8AmaxPaddedRows,
    PageIndexOverflow,
    TpHeadOffset,
    TpMissingAllreduce,
    TpDoubleReduce,
    TpAbsorbUnsliced,
}

impl Fault {
    pub const ALL: [Fault; 19] = [
        Fault::OutputBufferDisconnect,
        Fault::SoftmaxScaleLatent,
        Fault::AbsorbWrongSplit,
        Fault::RopeNoninterleaved,
        Fault::LseBaseMismatch,
        Fault::SkipPaddedRows,
        Fault::KvCacheOffByOne,
        Fault::Q4kScaleUnpack,
        Fault::Exp2Scale,
        Fault::IndexerRopeLayout,
        Fault::YarnMscale,
        Fault::KvStrideMismatch,
        Fault::Fp8ScaleDefault,
        Fault::Fp8AmaxPaddedRows,
        Fault::PageIndexOverflow,
        Fault::TpHeadOffset,
        Fault::TpMissingAllreduce,
        Fault::TpDoubleReduce,
        Fault::TpAbsorbUnsliced,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::OutputBufferDisconnect => "output-buffer-disconnect",
            Fault::SoftmaxScaleLatent => "softmax-scale-latent",
            Fault::AbsorbWrongSplit => "absorb-wrong-split",
            Fault::RopeNoninterleaved => "rope-noninterleaved",
            Fault::LseBaseMismatch => "lse-base-mismatch",
            Fault::SkipPaddedRows => "skip-padded-rows",
            Fault::KvCacheOffByOne => "kv-cache-off-by-one",
            Fault::Q4kScaleUnpack => "q4k-scale-unpack",
            Fault::Exp2Scale => "exp2-scale",
            Fault::IndexerRopeLayout => "indexer-rope-layout",
            Fault::YarnMscale => "yarn-mscale",
            Fault::KvStrideMismatch => "kv-stride-mismatch",
            Fault::Fp8ScaleDefault => "fp8-scale-default",
            Fault::Fp8AmaxPaddedRows => "fp8-amax-padded-rows",
            Fault::PageIndexOverflow => "page-index-overflow",
            Fault::TpHeadOffset => "tp-head-offset",
            Fault::TpMissingAllreduce => "tp-missing-allreduce",
            Fault::TpDoubleReduce => "tp-double-reduce",
            Fault::TpAbsorbUnsliced => "tp-absorb-unsliced",
        }
    }

    pub fn description(self) -> &'static str {
        match self {
            Fault::OutputBufferDisconnect => {
                "attention kernel writes a phantom buffer; the wrapper returns its own, unwritten"
            }
            Fault::SoftmaxScaleLatent => {
                "absorbed softmax scaled by the latent width, not qk_nope + qk_rope"
            }
            Fault::AbsorbWrongSplit => "W_UK / W_UV taken from the wrong rows of kv_b_proj",
            Fault::RopeNoninterleaved => "query RoPE in split-half layout, key RoPE interleaved",
            Fault::LseBaseMismatch => "split-KV partials in log2 merged as natural log",
            Fault::SkipPaddedRows => "decode kernel leaves some output rows unwritten",
            Fault::KvCacheOffByOne => "decode writes the latent cache one slot early",
            Fault::Q4kScaleUnpack => "Q4_K sub-blocks 4..7 decoded with the wrong scales and mins",
            Fault::Exp2Scale => "fast kernels' exp2 softmax given a scale without log2 e",
            Fault::IndexerRopeLayout => "DSA indexer RoPE in the other layout (interleaved/split)",
            Fault::YarnMscale => "YaRN softmax scale from mscale instead of mscale_all_dim",
            Fault::KvStrideMismatch => "flash prefill steps V tiles by the K row width",
            Fault::Fp8ScaleDefault => "FP8 latent cache tile scales left at 1.0",
            Fault::Fp8AmaxPaddedRows => "FP8 tile scales taken over stale padding",
            Fault::PageIndexOverflow => "decode page offsets in 32 bits wrap past 4 GiB of pool",
            Fault::TpHeadOffset => "a TP rank takes its neighbour's heads of kv_b_proj",
            Fault::TpMissingAllreduce => "o_proj's partial sums not all-reduced across TP ranks",
            Fault::TpDoubleReduce => "o_proj's partial sums all-reduced twice",
            Fault::TpAbsorbUnsliced => "absorption reads the full W_UK, not the rank's heads",
        }
    }

    /// Phases the fault acts in when no `@phase` is given.
    pub fn default_scope(self) -> Scope {
        match self {
            Fault::SkipPaddedRows | Fault::KvCacheOffByOne => Scope::Decode,
            _ => Scope::All,
        }
    }

    fn bit(self) -> u64 {
        self as u64
    }

    /// Whether the fault lives in the FP8 latent cache's codec (it needs
    /// `--kv-cache-dtype fp8_ds_mla` to act).
    pub fn needs_fp8_cache(self) -> bool {
        matches!(self, Fault::Fp8ScaleDefault | Fault::Fp8AmaxPaddedRows)
    }

    /// Whether the fault lives in tensor parallelism (it needs `--tp 2` or more to act).
    pub fn needs_tp(self) -> bool {
        matches!(
            self,
            Fault::TpHeadOffset
                | Fault::TpMissingAllreduce
                | Fault::TpDoubleReduce
                | Fault::TpAbsorbUnsliced
        )
    }
}

impl std::str::FromStr for Fault {
    type Err = Error;

    fn from_str(s: &str) -> Result<Fault> {
        Fault::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Fault::ALL.iter().map(|f| f.name()).collect();
                Error::invalid(format!(
                    "unknown injection '{s}' (known: {})",
                    names.join(", ")
                ))
            })
    }
}

/// Phases a fault acts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    All,
    Prefill,
    Decode,
}

impl Scope {
    /// Every scope, in the order a menu offers them.
    pub const ALL: [Scope; 3] = [Scope::All, Scope::Prefill, Scope::Decode];

    /// The scope's name, as `NAME@SCOPE` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Scope::All => "both",
            Scope::Prefill => "prefill",
            Scope::Decode => "decode",
        }
    }

    fn mask(self) -> u64 {
        match self {
            Scope::All => 0b11,
            Scope::Prefill => 0b01,
            Scope::Decode => 0b10,
        }
    }
}

/// The set of active faults, two bits (prefill, decode) per fault.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Faults(u64);

impl Faults {
    pub fn none() -> Faults {
        Faults(0)
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn with(self, fault: Fault, scope: Scope) -> Faults {
        Faults(self.0 | scope.mask() << (2 * fault.bit()))
    }

    pub fn without(self, fault: Fault) -> Faults {
        Faults(self.0 & !(0b11 << (2 * fault.bit())))
    }

    /// `fault` acting in exactly `scope` (whatever scope it had before).
    pub fn with_scope(self, fault: Fault, scope: Scope) -> Faults {
        self.without(fault).with(fault, scope)
    }

    /// The phases `fault` acts in, or `None` when it is off.
    pub fn scope(self, fault: Fault) -> Option<Scope> {
        match self.0 >> (2 * fault.bit()) & 0b11 {
            0b01 => Some(Scope::Prefill),
            0b10 => Some(Scope::Decode),
            0b11 => Some(Scope::All),
            _ => None,
        }
    }

    /// Whether `fault` acts in `phase`.
    #[inline]
    pub fn active(self, fault: Fault, phase: Phase) -> bool {
        let bit = match phase {
            Phase::Prefill => 0b01,
            Phase::Decode(_) => 0b10,
        };
        self.0 >> (2 * fault.bit()) & bit != 0
    }

    /// Whether `fault` acts in any phase.
    pub fn contains(self, fault: Fault) -> bool {
        self.0 >> (2 * fault.bit()) & 0b11 != 0
    }

    /// Parses `NAME`, `NAME@prefill`, `NAME@decode` or `NAME@both` and adds it.
    pub fn parse_add(self, spec: &str) -> Result<Faults> {
        let (fault, scope) = parse_spec(spec)?;
        Ok(self.with(fault, scope))
    }

    /// Each active fault with its scope, as the specs `parse_add` reads.
    pub fn specs(self) -> Vec<String> {
        Fault::ALL
            .into_iter()
            .filter_map(|f| Some(spec_of(f, self.scope(f)?)))
            .collect()
    }
}

/// A fault spec (`NAME`, `NAME@prefill`, `NAME@decode`, `NAME@both`): the fault and its scope
/// (its default scope when none is given).
pub fn parse_spec(spec: &str) -> Result<(Fault, Scope)> {
    let (name, scope) = match spec.split_once('@') {
        None => (spec, None),
        Some((n, "prefill")) => (n, Some(Scope::Prefill)),
        Some((n, "decode")) => (n, Some(Scope::Decode)),
        Some((n, "both" | "all")) => (n, Some(Scope::All)),
        Some((_, other)) => {
            return Err(Error::invalid(format!(
                "injection scope '@{other}' is not @prefill, @decode or @both"
            )))
        }
    };
    let fault: Fault = name.parse()?;
    Ok((fault, scope.unwrap_or(fault.default_scope())))
}

/// The spec of `fault` acting in `scope`: the bare name for its default scope.
pub fn spec_of(fault: Fault, scope: Scope) -> String {
    if scope == fault.default_scope() {
        fault.name().to_string()
    } else {
        format!("{}@{}", fault.name(), scope.name())
    }
}

impl fmt::Display for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return write!(f, "none");
        }
        write!(f, "{}", self.specs().join(","))
    }
}

impl Serialize for Faults {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.specs().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Faults {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Faults, D::Error> {
        let specs = Vec::<String>::deserialize(d)?;
        specs
            .iter()
            .try_fold(Faults::none(), |f, s| f.parse_add(s))
            .map_err(serde::de::Error::custom)
    }
}

pub use crate::ops::{Fp8Faults, KernelFaults};

impl Faults {
    /// The codec faults acting in `phase`.
    pub fn fp8(self, phase: Phase) -> Fp8Faults {
        Fp8Faults {
            scale_default: self.active(Fault::Fp8ScaleDefault, phase),
            amax_padded: self.active(Fault::Fp8AmaxPaddedRows, phase),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_round_trip_with_scopes() {
        let f = Faults::none()
            .parse_add("softmax-scale-latent")
            .unwrap()
            .parse_add("output-buffer-disconnect@prefill")
            .unwrap()
            .parse_add("kv-cache-off-by-one")
            .unwrap();
        assert!(f.active(Fault::SoftmaxScaleLatent, Phase::Prefill));
        assert!(f.active(Fault::SoftmaxScaleLatent, Phase::Decode(3)));
        assert!(f.active(Fault::OutputBufferDisconnect, Phase::Prefill));
        assert!(!f.active(Fault::OutputBufferDisconnect, Phase::Decode(0)));
        assert!(!f.active(Fault::KvCacheOffByOne, Phase::Prefill));
        assert!(!f.contains(Fault::RopeNoninterleaved));
        let again = f
            .specs()
            .iter()
            .try_fold(Faults::none(), |a, s| a.parse_add(s))
            .unwrap();
        assert_eq!(f, again);
        assert!(f.without(Fault::SoftmaxScaleLatent).specs().len() == 2);
        assert!(Faults::none().parse_add("nope").is_err());
        assert_eq!(f.scope(Fault::KvCacheOffByOne), Some(Scope::Decode));
        assert_eq!(f.scope(Fault::AbsorbWrongSplit), None);
        assert!(Faults::none().parse_add("skip-padded-rows@later").is_err());
    }

    #[test]
    fn a_decode_fault_widened_to_both_phases_round_trips() {
        // Its bare name means decode only, so acting in both phases needs `@both`.
        let f = Faults::none().with(Fault::KvCacheOffByOne, Scope::All);
        assert_eq!(f.specs(), vec!["kv-cache-off-by-one@both".to_string()]);
        let again = Faults::none().parse_add(&f.specs()[0]).unwrap();
        assert_eq!(again, f);
        assert!(again.active(Fault::KvCacheOffByOne, Phase::Prefill));
        // Rescoping replaces the phases instead of adding to them.
        let g = f.with_scope(Fault::KvCacheOffByOne, Scope::Prefill);
        assert_eq!(g.scope(Fault::KvCacheOffByOne), Some(Scope::Prefill));
        assert_eq!(
            Faults::none()
                .parse_add("softmax-scale-latent@both")
                .unwrap()
                .specs(),
            vec!["softmax-scale-latent".to_string()]
        );
    }
}
