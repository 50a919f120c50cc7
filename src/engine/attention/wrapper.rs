//! The attention wrapper, as production backends have one: it allocates the output buffer,
//! hands it to the kernel (the fast kernel where the run asks for it and the backend takes the
//! op, else the reference) and returns it, reporting what the kernel produced beside it (the
//! reference's probabilities, or a fast kernel's split partials, merge, log-sum-exps and padded
//! rows) as ops of their own. The output-buffer-disconnect fault is planted here.

use super::LayerCtx;
use crate::backend::{FastAttention, FastOutcome};
use crate::engine::sink::{Computed, Sink};
use crate::engine::trace::{BufferRef, OpKind};
use crate::error::Result;
use crate::ops::{AttnKernel, KernelInfo};
use crate::tensor::Tensor;

/// What one call of an attention kernel produced beside its output.
pub(super) enum KernelOutput {
    /// The reference kernel: the probabilities [heads, n, context], and on a device backend
    /// why the reference ran.
    Reference { probs: Tensor, why: Option<String> },
    /// A production kernel.
    Fast(Box<FastAttention>),
}

impl KernelOutput {
    /// Whether a merge joined split partials (a split fast decode), so that the buffer it wrote
    /// is reported as an op of its own.
    fn merged(&self) -> bool {
        matches!(self, KernelOutput::Fast(f) if f.partials.is_some())
    }

    /// The fast kernel where the run asks for it and the backend has one, else (or when it
    /// declines) the reference.
    pub(super) fn run(
        ctx: &LayerCtx,
        out: &mut Tensor,
        fast: impl FnOnce(&mut Tensor) -> Result<FastOutcome>,
        reference: impl FnOnce(&mut Tensor) -> Result<Tensor>,
    ) -> Result<KernelOutput> {
        let why = if !ctx.backend.has_fast_attention() {
            None
        } else if ctx.kernels.kernel == AttnKernel::Reference {
            Some("--attn-kernel reference".to_string())
        } else {
            match fast(out)? {
                FastOutcome::Ran(f) => return Ok(KernelOutput::Fast(f)),
                FastOutcome::Declined(why) => Some(why),
            }
        };
        let probs = reference(out)?;
        Ok(KernelOutput::Reference { probs, why })
    }
}

/// The events an attention call may report before its output: (op name, kind).
const PROBS: (&str, OpKind) = ("attn_probs", OpKind::AttentionProbs);
const PARTIALS: (&str, OpKind) = ("attn_partials", OpKind::AttentionPartials);
const PARTIALS_LSE: (&str, OpKind) = ("attn_partials_lse", OpKind::AttentionPartials);
const MERGE: (&str, OpKind) = ("attn_merge", OpKind::AttentionMerge);
const LSE: (&str, OpKind) = ("attn_lse", OpKind::AttentionLse);
const PADDING: (&str, OpKind) = ("attn_padding", OpKind::AttentionPadding);
const SIDE_OPS: [(&str, OpKind); 6] = [PROBS, PARTIALS, PARTIALS_LSE, MERGE, LSE, PADDING];

/// One event of an attention kernel call, before the output's.
struct Side {
    op: (&'static str, OpKind),
    tensor: Tensor,
    kernel: Option<KernelInfo>,
}

/// The events before the output (probabilities; or partials, the merge of a split decode,
/// log-sum-exps and a padded batch's extra rows), the kernel information of the output op, and
/// extra device reads. `merged` is the buffer the kernel wrote, which the merge op reports (given
/// where the kernel split: see [`KernelOutput::merged`]).
fn sides(
    output: KernelOutput,
    merged: Option<Tensor>,
) -> (Vec<Side>, Option<KernelInfo>, Vec<BufferRef>) {
    match output {
        KernelOutput::Reference { probs, why } => {
            let info = why.map(|why| KernelInfo {
                launches: Vec::new(),
                reference: Some(why),
            });
            let side = Side {
                op: PROBS,
                tensor: probs,
                kernel: info.clone(),
            };
            (vec![side], info, Vec::new())
        }
        KernelOutput::Fast(f) => {
            let f = *f;
            let info = KernelInfo {
                launches: f.launches,
                reference: None,
            };
            let first = KernelInfo {
                launches: info.launches.iter().take(1).cloned().collect(),
                reference: None,
            };
            let mut sides = Vec::new();
            if let Some((outputs, lse)) = f.partials {
                sides.push(Side {
                    op: PARTIALS,
                    tensor: outputs,
                    kernel: Some(first.clone()),
                });
                sides.push(Side {
                    op: PARTIALS_LSE,
                    tensor: lse,
                    kernel: Some(first),
                });
            }
            // The merge's launch and what it wrote (the wrapper's output, or under the
            // disconnect fault the phantom buffer the wrapper never returns).
            if let Some(tensor) = merged {
                sides.push(Side {
                    op: MERGE,
                    tensor,
                    kernel: Some(KernelInfo {
                        launches: info.launches.iter().skip(1).cloned().collect(),
                        reference: None,
                    }),
                });
            }
            sides.push(Side {
                op: LSE,
                tensor: f.lse,
                kernel: Some(info.clone()),
            });
            if let Some(padding) = f.padding {
                sides.push(Side {
                    op: PADDING,
                    tensor: padding,
                    kernel: Some(info.clone()),
                });
            }
            let reads = f
                .reads
                .iter()
                .map(|r| BufferRef::device_cache(r.id, r.address, r.bytes, r.device_index))
                .collect();
            (sides, Some(info), reads)
        }
    }
}

/// The attention wrapper: allocates the output buffer, hands it to the kernel and returns it,
/// reporting the kernel's results (the reference's probabilities, or a fast kernel's split
/// partials and log-sum-exps), then `output_op`. Under the disconnect fault the kernel is
/// handed a phantom buffer instead and the returned one stays unwritten.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_attention(
    ctx: &LayerCtx,
    sink: &mut Sink,
    inputs: &[&Tensor],
    cache_read: BufferRef,
    (output_op, output_kind): (&str, OpKind),
    out_shape: &[usize],
    disconnect: bool,
    kernel: impl Fn(&mut Tensor) -> Result<KernelOutput>,
) -> Result<Tensor> {
    let b = ctx.backend;
    let l = Some(ctx.layer);
    let name = ctx.name(&format!("self_attn.{output_op}"));
    let side_name = |op: &str| ctx.name(&format!("self_attn.{op}"));
    // An earlier run's events, replayed as they were: which of them it reported is its own.
    let mut replayed = Vec::new();
    while let Some(op) = SIDE_OPS
        .into_iter()
        .find(|(op, _)| sink.replays(replayed.len(), &side_name(op)))
    {
        replayed.push(op);
    }
    if sink.replays(replayed.len(), &name) {
        for (op, kind) in replayed {
            sink.op_with(l, &side_name(op), kind, inputs, |_| {
                Err(crate::Error::invalid("a replayed op was computed"))
            })?;
        }
        return sink.op_with(l, &name, output_kind, inputs, |_| {
            Err(crate::Error::invalid("a replayed op was computed"))
        });
    }
    let mut out = b.alloc(out_shape, ctx.poison)?;
    let (output, phantom) = if disconnect {
        let mut phantom = b.alloc(out_shape, ctx.poison)?;
        (kernel(&mut phantom)?, Some(phantom))
    } else {
        (kernel(&mut out)?, None)
    };
    let wrote = BufferRef::of(phantom.as_ref().unwrap_or(&out));
    let merged = output
        .merged()
        .then(|| phantom.unwrap_or_else(|| out.alias()));
    let (sides, info, device_reads) = sides(output, merged);
    let reads: Vec<BufferRef> = std::iter::once(cache_read).chain(device_reads).collect();
    // On a device, the statistics of every event of the call at once, with one wait for all
    // (unless the sink brings back those of many ops together).
    let mut stats = if sink.wants_stats() && !sink.defers_stats() && out.device().is_some() {
        let all: Vec<&Tensor> = sides.iter().map(|s| &s.tensor).chain([&out]).collect();
        b.stats_many(&all)
    } else {
        Vec::new()
    }
    .into_iter();
    sink.together(|sink| {
        for side in sides {
            let (op, kind) = side.op;
            let stats = stats.next();
            sink.op_with(l, &side_name(op), kind, inputs, |_| {
                Ok(Computed {
                    tensor: side.tensor,
                    kernel_wrote: None,
                    extra_reads: reads.clone(),
                    kernel: side.kernel,
                    stats,
                })
            })?;
        }
        let stats = stats.next();
        sink.op_with(l, &name, output_kind, inputs, |_| {
            Ok(Computed {
                tensor: out,
                kernel_wrote: Some(wrote),
                extra_reads: reads,
                kernel: info,
                stats,
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::KernelLaunch;

    fn launch(kernel: &str, splits: u32) -> KernelLaunch {
        KernelLaunch {
            kernel: kernel.into(),
            grid: [splits, 1, 1],
            block: [256, 1, 1],
            shared_bytes: 0,
            splits,
            cluster: 1,
        }
    }

    /// The launches the merge op reports for a split decode of `launches`.
    fn merge_launches(launches: Vec<KernelLaunch>) -> Vec<String> {
        let t = |shape: &[usize]| Tensor::zeros(shape).unwrap();
        let fast = FastAttention {
            lse: t(&[1, 8]),
            partials: Some((t(&[1, 4, 8, 512]), t(&[1, 4, 8]))),
            padding: None,
            launches,
            reads: Vec::new(),
        };
        let (sides, _, _) = sides(KernelOutput::Fast(Box::new(fast)), Some(t(&[1, 8, 512])));
        let merge = sides.iter().find(|s| s.op == MERGE).expect("a merge op");
        let info = merge.kernel.as_ref().unwrap();
        info.launches.iter().map(|l| l.kernel.clone()).collect()
    }

    /// The merge op names the launch that merged, the merge kernel after the split kernel, and
    /// not the split kernel.
    #[test]
    fn the_merge_op_names_the_launch_that_merged() {
        let apart = vec![
            launch("mla_decode_wgmma", 4),
            launch("mla_decode_combine_rows", 1),
        ];
        assert_eq!(merge_launches(apart), ["mla_decode_combine_rows"]);
    }
}
