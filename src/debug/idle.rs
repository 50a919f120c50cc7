//! Flags and faults that had nothing to act on in a run: a decode-scoped fault in a run without
//! decode steps, a fault of the absorbed path when no op ran on it, `lse-base-mismatch` when no
//! context spans two split-KV blocks, force-dequantize with a plain kv_b_proj, the FP8 cache's
//! codec faults on a bf16 cache, and so on.
//!
//! Decided in one place from what the run executed (its op events) and from the model (how each
//! kv_b_proj is stored), so that `check` (a note), `run` (stderr or its JSON summary) and the
//! debugger (its log and header) say the same thing: a flag that is on but did nothing is
//! never shown as if it had acted.

use super::flags::Flags;
use crate::backend::cpu::attention::SPLIT_KV_BLOCK;
use crate::engine::faults::{Fault, Scope};
use crate::engine::trace::{OpEvent, OpKind, Phase};
use crate::engine::MlaPath;
use crate::error::Result;
use crate::model::catalog::layer_prefix;
use crate::model::Model;
use crate::ops::{KvCacheDtype, PLANTED_OFFSET32};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::Range;

/// What was on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subject {
    MlaDisable,
    /// `prefill-path absorbed` (the non-default prefill path).
    PrefillPath,
    /// `decode-path naive` (the non-default decode path).
    DecodePath,
    ForceDequant,
    Fault(Fault),
}

impl fmt::Display for Subject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Subject::MlaDisable => write!(f, "mla-disable"),
            Subject::PrefillPath => write!(f, "prefill-path absorbed"),
            Subject::DecodePath => write!(f, "decode-path naive"),
            Subject::ForceDequant => write!(f, "force-dequant"),
            Subject::Fault(fault) => write!(f, "inject {}", fault.name()),
        }
    }
}

/// A flag or fault that was on and had nothing to act on, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Idle {
    pub subject: Subject,
    pub why: String,
}

impl fmt::Display for Idle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} had nothing to act on: {}", self.subject, self.why)
    }
}

/// How kv_b_proj is stored in each layer of a run: its quantized type's name (`Q4_K`), or
/// `None` when plain. Sessions record it, so that replays judge flags as the live run did; an
/// older session that lacks it leaves the flags that depend on it unjudged.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvBStorage {
    layers: Vec<(usize, Option<String>)>,
    #[serde(skip)]
    unknown: bool,
    /// The model's YaRN `mscale` and `mscale_all_dim` (what the yarn-mscale fault swaps), when
    /// it scales RoPE by YaRN with both set; absent from older sessions (then never idle).
    #[serde(default)]
    yarn_mscales: Option<Option<(f64, f64)>>,
}

impl KvBStorage {
    pub fn of(model: &Model, layers: &Range<usize>) -> Result<KvBStorage> {
        let layers = layers
            .clone()
            .map(|l| {
                let name = format!("{}.self_attn.kv_b_proj.weight", layer_prefix(l));
                let ty = model
                    .weights
                    .quantized(&name)?
                    .map(|q| q.ty.name().to_string());
                Ok((l, ty))
            })
            .collect::<Result<_>>()?;
        let yarn = match &model.layout.rope.scaling {
            crate::model::layout::RopeScaling::Yarn {
                mscale: Some(m),
                mscale_all_dim: Some(all),
                ..
            } => Some((*m, *all)),
            _ => None,
        };
        Ok(KvBStorage {
            layers,
            unknown: false,
            yarn_mscales: Some(yarn),
        })
    }

    /// Storage not known (a session recorded before it was): force-dequantize and the
    /// quantization fault are then never reported idle.
    pub fn unknown() -> KvBStorage {
        KvBStorage {
            layers: Vec::new(),
            unknown: true,
            yarn_mscales: None,
        }
    }

    fn any_quantized(&self) -> bool {
        self.unknown || self.layers.iter().any(|(_, t)| t.is_some())
    }

    fn is_q4k(&self, layer: Option<usize>) -> bool {
        self.unknown
            || self
                .layers
                .iter()
                .any(|(l, t)| Some(*l) == layer && t.as_deref() == Some(Q4_K))
    }

    fn any_q4k(&self) -> bool {
        self.unknown || self.layers.iter().any(|(_, t)| t.as_deref() == Some(Q4_K))
    }

    /// `plain`, or the types it is stored in (`Q8_0`, `Q4_0 and plain`).
    fn describe(&self) -> String {
        let mut names: Vec<&str> = self
            .layers
            .iter()
            .map(|(_, t)| t.as_deref().unwrap_or("plain"))
            .collect();
        names.sort_unstable();
        names.dedup();
        names.join(" and ")
    }
}

const Q4_K: &str = "Q4_K";

/// The flags and faults of `flags` that had nothing to act on in the run whose op events are
/// `events`. Until the run has `finished`, only what no later op could change is reported
/// (a plain kv_b_proj, paths that MLA disable overrides, faults MLA disable routes around).
pub fn idle_flags(
    flags: &Flags,
    kv_b: &KvBStorage,
    events: &[OpEvent],
    finished: bool,
) -> Vec<Idle> {
    let run = Run {
        flags,
        kv_b,
        events,
    };
    let mut out = Vec::new();
    let mut idle = |subject, why: Option<String>| {
        if let Some(why) = why {
            out.push(Idle { subject, why });
        }
    };
    if flags.mla_disable {
        idle(Subject::MlaDisable, run.mla_disable(finished));
    }
    if flags.prefill_path != Flags::default().prefill_path {
        idle(Subject::PrefillPath, run.path_flag(finished, false));
    }
    if flags.decode_path != Flags::default().decode_path {
        idle(Subject::DecodePath, run.path_flag(finished, true));
    }
    if flags.force_dequant {
        idle(Subject::ForceDequant, run.force_dequant(finished));
    }
    for fault in Fault::ALL {
        if flags.faults.contains(fault) {
            idle(Subject::Fault(fault), run.fault(fault, finished));
        }
    }
    out
}

/// The same as lines for `check`'s notes and `run`'s stderr.
pub fn idle_lines(flags: &Flags, kv_b: &KvBStorage, events: &[OpEvent]) -> Vec<String> {
    idle_flags(flags, kv_b, events, true)
        .iter()
        .map(Idle::to_string)
        .collect()
}

/// `check`'s notes on a job's checked run.
pub fn check_notes(job: &super::runner::Job, run: &super::RunRecord) -> Result<Vec<String>> {
    let kv_b = KvBStorage::of(job.model, job.layers)?;
    Ok(idle_lines(&run.flags, &kv_b, &run.events))
}

struct Run<'a> {
    flags: &'a Flags,
    kv_b: &'a KvBStorage,
    events: &'a [OpEvent],
}

const ROUTED_AROUND: &str =
    "MLA disable routes attention around the MLA backend, where this fault lives";

/// Why a fault of the FP8 cache's codec idles on a bf16 cache.
pub const NEEDS_FP8_CACHE: &str = "it lives in the FP8 latent cache's codec, and this run's \
     latent cache is bf16 (--kv-cache-dtype fp8_ds_mla, on a layout with kv_lora_rank 512 and \
     qk_rope_head_dim 64 such as glm5-rank8)";

/// Why a tensor-parallel fault idles in a run of one rank.
pub const NEEDS_TP: &str = "it lives in tensor parallelism, and this run has one rank (--tp 2 \
     or more, on a layout whose heads, MLP widths and experts divide by it)";

fn is_decode(phase: Phase) -> bool {
    matches!(phase, Phase::Decode(_))
}

impl Run<'_> {
    fn has_prefill(&self) -> bool {
        self.events.iter().any(|e| e.phase == Phase::Prefill)
    }

    fn has_decode(&self) -> bool {
        self.events.iter().any(|e| is_decode(e.phase))
    }

    /// Whether an op of a phase `fault` acts in satisfies `pred` (given the op's index).
    fn any_in_scope(&self, fault: Fault, pred: impl Fn(usize, &OpEvent) -> bool) -> bool {
        self.events
            .iter()
            .enumerate()
            .any(|(i, e)| self.flags.faults.active(fault, e.phase) && pred(i, e))
    }

    /// Why no phase of the fault's scope ran, if none did.
    fn out_of_scope(&self, fault: Fault) -> Option<String> {
        if self.any_in_scope(fault, |_, _| true) {
            return None;
        }
        Some(match self.flags.faults.scope(fault) {
            Some(Scope::Decode) => "it acts in decode, and the run has no decode steps".into(),
            Some(Scope::Prefill) => "it acts in prefill, and the run prefilled nothing".into(),
            _ => "the run executed no op".into(),
        })
    }

    /// Why no op ran on the absorbed path in the phases `scope` covers.
    fn naive_everywhere(&self, scope: Scope, finished: bool) -> Option<String> {
        if self.flags.mla_disable {
            return Some("MLA disable makes every path naive".into());
        }
        let paths = self.flags.paths();
        let mut reasons = Vec::new();
        for (decode, path, ran, name) in [
            (false, paths.prefill, self.has_prefill(), "prefill"),
            (true, paths.decode, self.has_decode(), "decode"),
        ] {
            let covered = match scope {
                Scope::All => true,
                Scope::Prefill => !decode,
                Scope::Decode => decode,
            };
            if !covered {
                continue;
            }
            match (path, ran) {
                (MlaPath::Naive, _) => reasons.push(format!("{name} runs the naive path")),
                (MlaPath::Absorbed, false) if finished => reasons.push(if decode {
                    "the run has no decode steps".to_string()
                } else {
                    "the run prefilled nothing".to_string()
                }),
                (MlaPath::Absorbed, _) => return None,
            }
        }
        Some(format!(
            "no op ran on the absorbed path ({})",
            reasons.join("; ")
        ))
    }

    /// The longest context an absorbed attention attended over in the phases `fault` acts in:
    /// a reference kernel's probabilities ([heads, tokens, context], just before the latent
    /// output); a fast kernel writes none, and its last query saw every key up to its position.
    fn longest_absorbed_context(&self, fault: Fault) -> usize {
        self.events
            .iter()
            .enumerate()
            .filter(|(_, e)| {
                e.kind == OpKind::AttentionLatent && self.flags.faults.active(fault, e.phase)
            })
            .filter_map(|(i, e)| {
                if e.ran_fast_kernel() {
                    return Some(e.positions.1);
                }
                let p = &self.events[i.checked_sub(1)?];
                (p.kind == OpKind::AttentionProbs).then(|| p.shape.last().copied())?
            })
            .max()
            .unwrap_or(0)
    }

    /// Why the first attention op that ran a reference kernel did, as ` (why)`, or nothing.
    fn first_reference_reason(&self) -> String {
        self.events
            .iter()
            .find_map(|e| e.reference_reason())
            .map_or(String::new(), |w| format!(" ({w})"))
    }

    /// Why every attention op of the run takes the reference kernels, where the faults that live
    /// in the fast ones have nothing to act on; `None` on the GPU with the fast kernels asked.
    fn reference_kernels_only(&self) -> Option<&'static str> {
        if self.flags.device == super::flags::DeviceFlag::Cpu {
            Some("the CPU runs the reference kernels")
        } else if self.flags.kernels.kernel == crate::ops::AttnKernel::Reference {
            Some("--attn-kernel reference runs the reference kernels")
        } else {
            None
        }
    }

    fn mla_disable(&self, finished: bool) -> Option<String> {
        let mut without = *self.flags;
        without.mla_disable = false;
        // It keeps the MLA backend's faults out of the phases they act in.
        let routes_around = [Fault::OutputBufferDisconnect, Fault::SkipPaddedRows]
            .into_iter()
            .any(|f| {
                self.flags.faults.contains(f) && (!finished || self.any_in_scope(f, |_, _| true))
            });
        if routes_around {
            return None;
        }
        let base = without.paths();
        if base.prefill == MlaPath::Naive && base.decode == MlaPath::Naive {
            return Some("prefill and decode run the naive path without it too".into());
        }
        if !finished {
            return None;
        }
        let absorbed_phase_ran = self.events.iter().any(|e| {
            matches!(e.kind, OpKind::AttentionProbs | OpKind::AttentionLse)
                && without.path_of(e.phase) == MlaPath::Absorbed
        });
        (!absorbed_phase_ran).then(|| {
            let why = if base.prefill == MlaPath::Naive {
                "prefill runs the naive path without it too, and the run has no decode steps"
            } else {
                "no attention ran in the phases it turns naive"
            };
            why.to_string()
        })
    }

    fn path_flag(&self, finished: bool, decode: bool) -> Option<String> {
        if self.flags.mla_disable {
            return Some("MLA disable makes every path naive".into());
        }
        if !finished {
            return None;
        }
        match (decode, self.has_decode(), self.has_prefill()) {
            (true, false, _) => Some("the run has no decode steps".into()),
            (false, _, false) => Some("the run prefilled nothing".into()),
            _ => None,
        }
    }

    fn force_dequant(&self, finished: bool) -> Option<String> {
        if !self.kv_b.any_quantized() {
            return Some(
                "kv_b_proj is not quantized in this model (quantized weights come from GGUF \
                 files or --quant)"
                    .into(),
            );
        }
        let dequantized = self
            .events
            .iter()
            .any(|e| e.kind == OpKind::Dequantize && e.name.ends_with("kv_b_dequant"));
        (finished && !dequantized && !self.kv_b.unknown)
            .then(|| "no op used the quantized kv_b_proj".into())
    }

    fn fault(&self, fault: Fault, finished: bool) -> Option<String> {
        let scope = self.flags.faults.scope(fault)?;
        // What the model and the flags decide, whatever the run executes.
        let fixed = match fault {
            Fault::OutputBufferDisconnect | Fault::SkipPaddedRows if self.flags.mla_disable => {
                Some(ROUTED_AROUND.to_string())
            }
            Fault::SoftmaxScaleLatent | Fault::AbsorbWrongSplit | Fault::LseBaseMismatch => {
                self.naive_everywhere(scope, false)
            }
            f if f.needs_fp8_cache() && self.flags.kv_cache != KvCacheDtype::Fp8DsMla => {
                Some(NEEDS_FP8_CACHE.to_string())
            }
            f if f.needs_tp() && self.flags.tp < 2 => Some(NEEDS_TP.to_string()),
            Fault::TpAbsorbUnsliced => self.naive_everywhere(scope, false),
            Fault::Exp2Scale | Fault::KvStrideMismatch => self.reference_kernels_only().map(|off| {
                let lives = match fault {
                    Fault::Exp2Scale => "the fast GPU kernels (softmax in exp2)",
                    _ => "the fast GPU prefill (its value tile loader)",
                };
                format!("it lives in {lives}; {off}")
            }),
            Fault::PageIndexOverflow => self
                .reference_kernels_only()
                .map(|off| format!("it lives in the fast GPU decode (its page addressing); {off}"))
                .or_else(|| self.naive_everywhere(scope, false)),
            Fault::YarnMscale => match self.kv_b.yarn_mscales {
                Some(None) => Some("the model does not scale RoPE by YaRN with mscale and mscale_all_dim".into()),
                Some(Some((m, all))) if m == all => Some(format!(
                    "mscale and mscale_all_dim are equal in this model ({m}), so taking one for the \
                     other changes nothing"
                )),
                _ => None,
            },
            Fault::Q4kScaleUnpack if !self.kv_b.any_q4k() => Some(format!(
                "kv_b_proj is not Q4_K in this model ({}); it acts on a Q4_K kv_b_proj, e.g. \
                 --layout glm5-tiny-wide --quant q4_k",
                self.kv_b.describe()
            )),
            _ => None,
        };
        if fixed.is_some() || !finished {
            return fixed;
        }
        if let Some(why) = self.out_of_scope(fault) {
            return Some(why);
        }
        let absorbed = |_: usize, e: &OpEvent| e.kind == OpKind::AttentionLatent;
        match fault {
            Fault::OutputBufferDisconnect => (!self
                .any_in_scope(fault, |_, e| e.kernel_wrote.is_some()))
            .then(|| "no attention kernel ran in its phases".into()),
            Fault::SkipPaddedRows => (!self
                .any_in_scope(fault, |_, e| super::flags::attention_kernel(e)))
            .then(|| "no attention kernel ran in its phases".into()),
            Fault::SoftmaxScaleLatent => {
                if !self.any_in_scope(fault, absorbed) {
                    return self.naive_everywhere(scope, true);
                }
                // A softmax over one key is 1 at any scale.
                let longest = self.longest_absorbed_context(fault);
                (longest < 2).then(|| {
                    "every query on the absorbed path attended to a single key, whose \
                     probability is 1 at any scale"
                        .into()
                })
            }
            Fault::AbsorbWrongSplit => (!self
                .any_in_scope(fault, |_, e| e.kind == OpKind::AbsorbQuery))
            .then(|| self.naive_everywhere(scope, true))
            .flatten(),
            Fault::LseBaseMismatch => {
                if !self.any_in_scope(fault, absorbed) {
                    return self.naive_everywhere(scope, true);
                }
                let longest = self.longest_absorbed_context(fault);
                (longest <= SPLIT_KV_BLOCK).then(|| {
                    format!(
                        "no context on the absorbed path spanned two split-KV blocks of \
                         {SPLIT_KV_BLOCK} positions (the longest was {longest})"
                    )
                })
            }
            Fault::Exp2Scale => {
                (!self.any_in_scope(fault, |_, e| e.ran_fast_kernel())).then(|| {
                    let why = self.first_reference_reason();
                    format!(
                    "no attention op in its phases ran a fast kernel{why}; the reference kernels \
                     compute in exp"
                )
                })
            }
            Fault::IndexerRopeLayout => {
                let q_rope = |e: &OpEvent| e.name.ends_with("self_attn.indexer.q_rope");
                if self.any_in_scope(fault, |_, e| q_rope(e) && e.positions.1 >= 2) {
                    None
                } else if self.any_in_scope(fault, |_, e| q_rope(e)) {
                    Some("its phases rotated the indexer's query at position 0 only, where RoPE is the identity".into())
                } else {
                    Some("no DSA indexer ran in its phases".into())
                }
            }
            Fault::YarnMscale
            | Fault::TpHeadOffset
            | Fault::TpMissingAllreduce
            | Fault::TpDoubleReduce => None,
            Fault::TpAbsorbUnsliced => (!self
                .any_in_scope(fault, |_, e| e.kind == OpKind::AbsorbQuery))
            .then(|| self.naive_everywhere(scope, true))
            .flatten(),
            Fault::PageIndexOverflow => {
                let planted = |e: &OpEvent| {
                    e.kernel.as_ref().is_some_and(|k| {
                        k.launches
                            .iter()
                            .any(|l| l.kernel.ends_with(PLANTED_OFFSET32))
                    })
                };
                (!self.any_in_scope(fault, |_, e| planted(e))).then(|| {
                    let why = self.first_reference_reason();
                    format!(
                        "no attention op in its phases ran the fast dense bf16 decode, where it \
                         is planted{why}"
                    )
                })
            }
            Fault::KvStrideMismatch => {
                // (kernel, keys) of every flash prefill in its phases.
                let prefills: Vec<(String, usize)> = self
                    .events
                    .iter()
                    .filter(|e| self.flags.faults.active(fault, e.phase))
                    .filter_map(|e| {
                        let launch = e.kernel.as_ref()?.launches.first()?;
                        let keys = e.positions.1 - e.positions.0;
                        (launch.kernel.starts_with("flash_prefill_"))
                            .then(|| (launch.kernel.clone(), keys))
                    })
                    .collect();
                // The key tile of a prefill kernel (`flash_prefill_k128t64_d192`: 64).
                let tile = |k: &str| {
                    k.split('_')
                        .nth(2)
                        .and_then(|v| v.split('t').nth(1))
                        .and_then(|t| t.parse::<usize>().ok())
                        .unwrap_or(0)
                };
                if prefills.is_empty() {
                    Some("no attention op in its phases ran the flash prefill".into())
                } else if prefills.iter().all(|(k, _)| k.ends_with("_d256")) {
                    Some(
                        "the prefill's qk and v head dims are equal (256/256): the two strides \
                         agree"
                            .into(),
                    )
                } else if prefills.iter().all(|(k, n)| *n <= tile(k)) {
                    Some("every flash prefill in its phases fit in one key tile, where nothing drifts yet".into())
                } else {
                    None
                }
            }
            Fault::RopeNoninterleaved => {
                let q_rope = |e: &OpEvent| e.name.ends_with("self_attn.q_rope");
                if self.any_in_scope(fault, |_, e| q_rope(e) && e.positions.1 >= 2) {
                    None
                } else if self.any_in_scope(fault, |_, e| q_rope(e)) {
                    // RoPE at position 0 rotates by nothing, in either layout.
                    Some("its phases rotated the query at position 0 only, where RoPE is the identity".into())
                } else {
                    Some("no query RoPE ran in its phases".into())
                }
            }
            Fault::KvCacheOffByOne => {
                // It acts where a token lands one slot early (from any position but 0) in a
                // latent cache that a later op reads: the absorbed attention, or the backfill of
                // the naive path's cache. Naive attention reads its own decompressed cache.
                let latent_write = |e: &OpEvent| e.name.ends_with("self_attn.latent_cache");
                let moved: Vec<usize> = (0..self.events.len())
                    .filter(|&i| {
                        let e = &self.events[i];
                        self.flags.faults.active(fault, e.phase)
                            && latent_write(e)
                            && e.positions.1 >= 2
                    })
                    .collect();
                let read_later = moved.iter().any(|&w| {
                    let id = self.events[w].output.id;
                    self.events[w + 1..]
                        .iter()
                        .any(|e| e.inputs.iter().any(|r| r.id == id))
                });
                if read_later {
                    None
                } else if !moved.is_empty() {
                    Some(
                        "no op read the latent cache after a token was written one slot early \
                         (naive attention reads its own decompressed cache)"
                            .into(),
                    )
                } else if self.any_in_scope(fault, |_, e| latent_write(e)) {
                    Some(
                        "its phases wrote the latent cache at position 0 only, where one slot \
                         early is the same slot"
                            .into(),
                    )
                } else {
                    Some("no latent-cache write ran in its phases".into())
                }
            }
            Fault::Fp8ScaleDefault | Fault::Fp8AmaxPaddedRows => (!self
                .any_in_scope(fault, |_, e| super::flags::latent_write(e)))
            .then(|| "no latent-cache write ran in its phases".into()),
            Fault::Q4kScaleUnpack => {
                // The blocks are decoded by the dequantize op (force-dequantize, or the identity
                // matrix of the absorbed path) and, without force-dequantize, by every naive
                // decompression.
                let decodes_blocks = |_: usize, e: &OpEvent| {
                    self.kv_b.is_q4k(e.layer)
                        && (e.kind == OpKind::Dequantize
                            || (e.kind == OpKind::Decompress && !self.flags.force_dequant))
                };
                (!self.any_in_scope(fault, decodes_blocks) && !self.kv_b.unknown)
                    .then(|| "no op decoded the Q4_K kv_b_proj in its phases".into())
            }
        }
    }
}
