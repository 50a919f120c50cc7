//! The flags a debugging session varies, one at a time: MLA disable, the path of each phase,
//! force-dequantize, device, dtype, the attention kernels on the GPU and fault injections. A flag change knows the first op it
//! affects, so a re-execution can take everything before it from the previous run.

use crate::engine::faults::{Fault, Faults};
use crate::engine::trace::{OpEvent, OpKind, Phase};
use crate::engine::{EngineOptions, MlaPath, MlaPaths, StorageDtype};
use crate::error::{Error, Result};
use crate::ops::{AttnKernel, AttnKernels, KvCacheDtype};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::Range;

/// Where ops run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DeviceFlag {
    #[default]
    Cpu,
    Cuda,
}

/// The name `--device` takes (`cpu`, `cuda`).
impl fmt::Display for DeviceFlag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            DeviceFlag::Cpu => "cpu",
            DeviceFlag::Cuda => "cuda",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Flags {
    /// Route attention around the MLA backend: naive everywhere (`VLLM_MLA_DISABLE=1`).
    pub mla_disable: bool,
    /// Paths while MLA is enabled (production: naive prefill, absorbed decode).
    pub prefill_path: MlaPath,
    pub decode_path: MlaPath,
    /// Dequantize kv_b_proj once at load instead of deriving W_UK/W_UV through the identity
    /// trick. Only quantized weights give it something to do.
    pub force_dequant: bool,
    pub device: DeviceFlag,
    pub dtype: StorageDtype,
    pub faults: Faults,
    /// The attention kernels on the GPU: fast (production) or reference, and forced variants.
    /// The CPU has the reference alone. Absent from sessions saved before it existed.
    #[serde(default)]
    pub kernels: AttnKernels,
    /// How the latent cache stores its rows (bf16, or fp8_ds_mla as production serves GLM-5).
    /// Absent from sessions saved before it existed.
    #[serde(default)]
    pub kv_cache: KvCacheDtype,
    /// Tensor-parallel ranks (1: none). Absent from sessions saved before it existed.
    #[serde(default = "one_rank")]
    pub tp: usize,
    /// An op for each chosen routed expert (`mlp.experts.E`) before their sum. Off by default
    /// (a full-size prefill would add 256 a layer); absent from sessions saved before it existed.
    #[serde(default, skip_serializing_if = "is_false")]
    pub expert_ops: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn one_rank() -> usize {
    1
}

impl Default for Flags {
    fn default() -> Flags {
        Flags {
            mla_disable: false,
            prefill_path: MlaPath::Naive,
            decode_path: MlaPath::Absorbed,
            force_dequant: false,
            device: DeviceFlag::Cpu,
            dtype: StorageDtype::F32,
            faults: Faults::none(),
            kernels: AttnKernels::default(),
            kv_cache: KvCacheDtype::Bf16,
            tp: 1,
            expert_ops: false,
        }
    }
}

fn parse_bool(key: &str, value: &str) -> Result<bool> {
    match value {
        "" | "on" | "true" | "1" | "yes" => Ok(true),
        "off" | "false" | "0" | "no" => Ok(false),
        other => Err(Error::invalid(format!("{key}: '{other}' is not on or off"))),
    }
}

fn parse_path(key: &str, value: &str) -> Result<MlaPath> {
    match value {
        "naive" => Ok(MlaPath::Naive),
        "absorbed" => Ok(MlaPath::Absorbed),
        other => Err(Error::invalid(format!(
            "{key}: '{other}' is not naive or absorbed"
        ))),
    }
}

pub use crate::model::shard::MAX_TP;

fn parse_tp(value: &str) -> Result<usize> {
    match value.parse::<usize>() {
        Ok(n) if (1..=MAX_TP).contains(&n) => Ok(n),
        _ => Err(Error::invalid(format!(
            "tp: '{value}' is not a rank count from 1 to {MAX_TP}"
        ))),
    }
}

/// What force-dequantize says on a model whose kv_b_proj is not quantized.
pub const FORCE_DEQUANT_IDLE: &str = "force-dequant has nothing to act on: kv_b_proj is not \
     quantized in this model (quantized weights come from GGUF files or --quant)";

/// The flag names `set` understands, for help texts.
pub const FLAG_NAMES: &[&str] = &[
    "mla-disable",
    "prefill-path",
    "decode-path",
    "force-dequant",
    "device",
    "dtype",
    "inject",
    "attn-kernel",
    "decode-variant",
    "prefill-variant",
    "kv-cache-dtype",
    "tp",
];

impl Flags {
    /// The attention path of each phase.
    pub fn paths(&self) -> MlaPaths {
        if self.mla_disable {
            MlaPaths::disabled()
        } else {
            MlaPaths {
                prefill: self.prefill_path,
                decode: self.decode_path,
            }
        }
    }

    pub fn path_of(&self, phase: Phase) -> MlaPath {
        match phase {
            Phase::Prefill => self.paths().prefill,
            Phase::Decode(_) => self.paths().decode,
        }
    }

    /// Engine options for these flags.
    pub fn engine_options(&self, layers: Range<usize>, poison: bool) -> Result<EngineOptions> {
        Ok(EngineOptions {
            paths: self.paths(),
            layers,
            mla_disabled: self.mla_disable,
            faults: self.faults,
            poison,
            storage: self.dtype,
            force_dequant: self.force_dequant,
            forced: Default::default(),
            kernels: self.kernels,
            kv_cache: self.kv_cache,
            tp: self.tp,
            expert_ops: self.expert_ops,
        })
    }

    /// Whether these flags fit a layout: an fp8_ds_mla cache needs GLM-5's latent rows, and
    /// tensor parallelism heads, widths and experts that divide by the ranks.
    pub fn check_layout(&self, layout: &crate::model::Layout) -> Result<()> {
        self.kv_cache
            .check_layout(layout.kv_lora_rank, layout.qk_rope_head_dim)?;
        crate::model::shard::check_tp(layout, self.tp)
    }

    /// Sets one flag from text (`:set FLAG VALUE`, `--a FLAG=VALUE`). `inject` adds a fault
    /// (`NAME` or `NAME@phase`), `inject -NAME` removes one, `inject none` clears them all.
    /// Returns a note when the change has nothing to act on.
    pub fn set(&mut self, key: &str, value: &str) -> Result<Option<String>> {
        match key {
            "mla-disable" => self.mla_disable = parse_bool(key, value)?,
            "prefill-path" => self.prefill_path = parse_path(key, value)?,
            "decode-path" => self.decode_path = parse_path(key, value)?,
            "force-dequant" => self.force_dequant = parse_bool(key, value)?,
            "expert-ops" => self.expert_ops = parse_bool(key, value)?,
            "device" => {
                self.device = match value {
                    "cpu" => DeviceFlag::Cpu,
                    "cuda" => {
                        crate::backend::cuda::probe()
                            .map_err(|why| Error::invalid(format!("device cuda: {why}")))?;
                        DeviceFlag::Cuda
                    }
                    other => {
                        return Err(Error::invalid(format!(
                            "device: '{other}' is not cpu or cuda"
                        )))
                    }
                }
            }
            "dtype" => self.dtype = value.parse()?,
            "attn-kernel" => self.kernels.kernel = value.parse()?,
            "decode-variant" => {
                self.kernels.decode = (value != "auto").then(|| value.parse()).transpose()?
            }
            "prefill-variant" => {
                self.kernels.prefill = (value != "auto").then(|| value.parse()).transpose()?
            }
            "kv-cache-dtype" => self.kv_cache = value.parse()?,
            "tp" => self.tp = parse_tp(value)?,
            "inject" => match value {
                "none" => self.faults = Faults::none(),
                v if v.starts_with('-') => {
                    let name = v[1..].split('@').next().unwrap_or_default();
                    self.faults = self.faults.without(name.parse::<Fault>()?);
                }
                v => self.faults = self.faults.parse_add(v)?,
            },
            other => {
                return Err(Error::invalid(format!(
                    "unknown flag '{other}' (flags: {})",
                    FLAG_NAMES.join(", ")
                )))
            }
        }
        Ok(None)
    }

    /// Flags from a comma-separated list of `FLAG` or `FLAG=VALUE` (empty: the defaults).
    pub fn parse(text: &str) -> Result<Flags> {
        let mut flags = Flags::default();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = item.split_once('=').unwrap_or((item, ""));
            flags.set(k.trim(), v.trim())?;
        }
        Ok(flags)
    }

    /// The index of the first event of `events` (a run with `self`) whose output `new` could
    /// change, or `None` when no op of that run is affected. Conservative: an op that might
    /// change counts as changed, so reusing the ops before it is always exact.
    pub fn first_affected(&self, new: &Flags, events: &[OpEvent]) -> Option<usize> {
        // Other ranks run other shards from the first op on.
        if self.dtype != new.dtype || self.device != new.device || self.tp != new.tp {
            return (!events.is_empty()).then_some(0);
        }
        events.iter().position(|e| self.affects(new, e))
    }

    fn affects(&self, new: &Flags, e: &OpEvent) -> bool {
        let attention_path_op = matches!(e.kind, OpKind::Decompress | OpKind::AbsorbQuery)
            || attention_kernel(e)
            || e.name.ends_with("self_attn.kv_cache");
        if self.path_of(e.phase) != new.path_of(e.phase) && attention_path_op {
            return true;
        }
        // Where a quantized kv_b_proj is first used or turned into a plain weight.
        let kv_b_op = matches!(
            e.kind,
            OpKind::Dequantize | OpKind::Decompress | OpKind::AbsorbQuery
        );
        if self.force_dequant != new.force_dequant && kv_b_op {
            return true;
        }
        // The experts' ops appear or go, from the first of a layer's on.
        let experts_op = matches!(e.kind, OpKind::Expert | OpKind::Experts);
        if self.expert_ops != new.expert_ops && experts_op {
            return true;
        }
        // The kernels only differ on the GPU; there they run every attention op.
        if self.kernels != new.kernels && self.device == DeviceFlag::Cuda && attention_kernel(e) {
            return true;
        }
        // The latent cache write, and every attention op after it, which reads the cache.
        if self.kv_cache != new.kv_cache && (latent_write(e) || attention_path_op) {
            return true;
        }
        Fault::ALL.into_iter().any(|f| {
            let (was, is) = (self.fault_acts(f, e.phase), new.fault_acts(f, e.phase));
            was != is && fault_touches(f, e, if was { self } else { new })
        })
    }

    /// Whether fault `f` acts in `phase` under these flags.
    fn fault_acts(&self, f: Fault, phase: Phase) -> bool {
        let mla_only = matches!(f, Fault::OutputBufferDisconnect | Fault::SkipPaddedRows);
        let without_fp8 = f.needs_fp8_cache() && self.kv_cache != KvCacheDtype::Fp8DsMla;
        let without_tp = f.needs_tp() && self.tp < 2;
        let routed_around = mla_only && self.mla_disable;
        self.faults.active(f, phase) && !(routed_around || without_fp8 || without_tp)
    }
}

/// Whether `e` is a layer's latent cache write.
pub fn latent_write(e: &OpEvent) -> bool {
    e.name.ends_with("self_attn.latent_cache")
}

/// Whether `e` is written by an attention kernel (the reference's probabilities, the fast
/// kernels' log-sum-exps, split partials, merge and padded rows, the output of either).
pub fn attention_kernel(e: &OpEvent) -> bool {
    matches!(
        e.kind,
        OpKind::AttentionProbs
            | OpKind::AttentionLse
            | OpKind::AttentionPartials
            | OpKind::AttentionPadding
            | OpKind::AttentionMerge
            | OpKind::Attention
            | OpKind::AttentionLatent
    )
}

/// The first ops a fault can change, under the flags it acts with.
fn fault_touches(f: Fault, e: &OpEvent, flags: &Flags) -> bool {
    let absorbed = flags.path_of(e.phase) == MlaPath::Absorbed;
    let kernel = attention_kernel(e);
    match f {
        Fault::OutputBufferDisconnect | Fault::SkipPaddedRows => kernel,
        Fault::SoftmaxScaleLatent | Fault::LseBaseMismatch => absorbed && kernel,
        Fault::AbsorbWrongSplit => absorbed && e.kind == OpKind::AbsorbQuery,
        Fault::RopeNoninterleaved => e.name.ends_with("self_attn.q_rope"),
        Fault::KvCacheOffByOne | Fault::Fp8ScaleDefault | Fault::Fp8AmaxPaddedRows => {
            latent_write(e)
        }
        Fault::Q4kScaleUnpack => matches!(
            e.kind,
            OpKind::Dequantize | OpKind::Decompress | OpKind::AbsorbQuery
        ),
        Fault::Exp2Scale | Fault::YarnMscale | Fault::KvStrideMismatch => kernel,
        Fault::IndexerRopeLayout => e.name.ends_with("self_attn.indexer.q_rope"),
        Fault::PageIndexOverflow => absorbed && kernel,
        Fault::TpHeadOffset => matches!(e.kind, OpKind::Decompress | OpKind::AbsorbQuery),
        Fault::TpAbsorbUnsliced => absorbed && e.kind == OpKind::AbsorbQuery,
        Fault::TpMissingAllreduce | Fault::TpDoubleReduce => {
            e.kind == OpKind::AllReduce && e.name.ends_with("self_attn.o_proj.all_reduce")
        }
    }
}

impl Flags {
    /// What changed from `self` to `new`, e.g. `mla-disable off → on`.
    pub fn changes_to(&self, new: &Flags) -> String {
        let onoff = |b: bool| if b { "on" } else { "off" };
        let mut out = Vec::new();
        if self.mla_disable != new.mla_disable {
            out.push(format!(
                "mla-disable {} → {}",
                onoff(self.mla_disable),
                onoff(new.mla_disable)
            ));
        }
        let (a, b) = (self.paths(), new.paths());
        if !self.mla_disable && !new.mla_disable {
            if a.prefill != b.prefill {
                out.push(format!("prefill {} → {}", a.prefill, b.prefill));
            }
            if a.decode != b.decode {
                out.push(format!("decode {} → {}", a.decode, b.decode));
            }
        }
        if self.force_dequant != new.force_dequant {
            out.push(format!(
                "force-dequant {} → {}",
                onoff(self.force_dequant),
                onoff(new.force_dequant)
            ));
        }
        if self.expert_ops != new.expert_ops {
            out.push(format!(
                "expert-ops {} → {}",
                onoff(self.expert_ops),
                onoff(new.expert_ops)
            ));
        }
        if self.device != new.device {
            out.push(format!("device {} → {}", self.device, new.device));
        }
        if self.dtype != new.dtype {
            out.push(format!("dtype {} → {}", self.dtype, new.dtype));
        }
        if self.faults != new.faults {
            out.push(format!("inject {} → {}", self.faults, new.faults));
        }
        if self.kernels != new.kernels {
            out.push(format!(
                "attn-kernel {} → {}",
                kernels_text(&self.kernels),
                kernels_text(&new.kernels)
            ));
        }
        if self.kv_cache != new.kv_cache {
            out.push(format!(
                "kv-cache-dtype {} → {}",
                self.kv_cache, new.kv_cache
            ));
        }
        if out.is_empty() {
            "same flags".to_string()
        } else {
            out.join(", ")
        }
    }
}

/// `fast`, `fast (decode ks3, prefill r64t32)`, `reference`.
pub fn kernels_text(k: &AttnKernels) -> String {
    let forced: Vec<String> = [
        k.decode.map(|v| format!("decode {}", v.tag())),
        k.prefill.map(|v| format!("prefill {}", v.tag())),
    ]
    .into_iter()
    .flatten()
    .collect();
    if forced.is_empty() || k.kernel == AttnKernel::Reference {
        k.kernel.to_string()
    } else {
        format!("{} ({})", k.kernel, forced.join(", "))
    }
}

impl fmt::Display for Flags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The README's words: `prefill naive · decode absorbed`, `cpu · f32`.
        write!(
            f,
            "mla-disable {} · {} · force-dequant {} · {} · {} · inject {}",
            if self.mla_disable { "on" } else { "off" },
            self.paths(),
            if self.force_dequant { "on" } else { "off" },
            self.device,
            self.dtype,
            self.faults
        )?;
        // The kernel choice means something on the GPU only.
        if self.device == DeviceFlag::Cuda {
            write!(f, " · attn-kernel {}", kernels_text(&self.kernels))?;
        }
        if self.kv_cache != KvCacheDtype::default() {
            write!(f, " · kv-cache-dtype {}", self.kv_cache)?;
        }
        if self.expert_ops {
            write!(f, " · expert-ops on")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_set() {
        let f = Flags::parse("mla-disable, inject=softmax-scale-latent, dtype=bf16").unwrap();
        assert!(f.mla_disable && f.dtype == StorageDtype::Bf16);
        assert!(f.faults.contains(Fault::SoftmaxScaleLatent));
        assert_eq!(f.paths(), MlaPaths::disabled());
        let mut g = f;
        g.set("inject", "-softmax-scale-latent").unwrap();
        assert!(g.faults.is_empty());
        assert!(g.set("force-dequant", "on").unwrap().is_none());
        assert!(g.force_dequant);
        assert!(g.set("device", "cuda").is_err());
        assert!(g.set("colour", "red").is_err());
        assert!(Flags::parse("decode-path=sideways").is_err());
    }

    #[test]
    fn the_kv_cache_dtype_is_a_flag_shown_only_when_not_bf16() {
        let mut f = Flags::default();
        assert!(!f.to_string().contains("kv-cache"));
        f.set("kv-cache-dtype", "fp8_ds_mla").unwrap();
        assert_eq!(f.kv_cache, KvCacheDtype::Fp8DsMla);
        assert!(
            f.to_string().ends_with(" · kv-cache-dtype fp8_ds_mla"),
            "{f}"
        );
        assert_eq!(
            Flags::default().changes_to(&f),
            "kv-cache-dtype bf16 → fp8_ds_mla"
        );
        assert!(f.set("kv-cache-dtype", "fp16").is_err());
        assert!(FLAG_NAMES.contains(&"kv-cache-dtype"));
        // Sessions saved before the flag load with a bf16 cache.
        let old = "(mla_disable: false, prefill_path: naive, decode_path: absorbed, \
                   force_dequant: false, device: cpu, dtype: f32, faults: [])";
        let loaded: Flags = ron::from_str(old).unwrap();
        assert_eq!(loaded.kv_cache, KvCacheDtype::Bf16);
        let saved = ron::to_string(&f).unwrap();
        assert!(saved.contains("kv_cache:fp8_ds_mla"), "{saved}");
        assert_eq!(ron::from_str::<Flags>(&saved).unwrap(), f);
    }
}
