//! The tensor-core MLA decode over an fp8_ds_mla latent cache (656-byte rows: E4M3 latent values
//! in four scaled tiles, bf16 RoPE values), as production serves GLM-5. Two kinds of kernel:
//! - The few-heads kernels (sm_90 and later; kernels/mla_decode_fp8*.cu): f16 MMAs on operands
//!   converted straight from the raw rows, the scales applied outside the MMAs.
//!   `mla_decode_fp8_h8` takes up to 8 heads a block as the MMAs' columns (GLM-5 at TP 8),
//!   `mla_decode_fp8_h16` 16 as rows (DeepSeek-V3 at TP 8). Made for a tensor-parallel rank,
//!   where the 64-row kernels are mostly padding: the first choice up to 32 heads (sparse: 16).
//! - The bf16 decode variants whose tiles are dequantized into the same shared bf16 tiles
//!   (kernels/kv_fp8.cuh), their MMAs and results bit for bit their twin's over a bf16 copy of
//!   the decoded rows: `mla_decode_wgmma_fp8` (Hopper: raw rows by bulk copies, converted by
//!   the warpgroup that runs the second half of P·V; the first choice past 32 heads (sparse:
//!   16), where the few-heads kernels read the cache once per 16 heads), and the cp.async
//!   kernels, whose tile loader converts (taking their twin's shared memory). The TMA-fed
//!   split-k variants have no such form: TMA copies bytes as they are.

use super::device::fast_kernels::SparseKeys;
use super::device::fp8_kernels::Fp8Decode;
use super::device::{variants, DevBuf, DevBytes, DevI32, Gpu};
use super::fast::{on_wgmma, runs_on, traced, with_merge, DecodeShape, DecodeWork};
use crate::error::{Error, Result};
use crate::ops::KernelLaunch;

/// The FP8-cache kernels for a rank's few heads: up to 8 heads a block, and 16.
const EIGHT_HEADS: &str = "mla_decode_fp8_h8";
const FEW_HEADS: &str = "mla_decode_fp8_h16";
/// The FP8-cache decode on wgmma (Hopper), 64 heads a block.
const WGMMA: &str = "mla_decode_wgmma_fp8";

/// The FP8-cache variants, in order of preference for a rank's few heads ([`by_heads`] puts the
/// wgmma one first past them), each with the bf16 variant it mirrors (the few-heads kernels have
/// none).
const VARIANTS: [(&str, Option<&str>); 7] = [
    (EIGHT_HEADS, None),
    (FEW_HEADS, None),
    (WGMMA, Some("mla_decode_wgmma")),
    ("mla_decode_fp8_ks3", Some("mla_decode_ks3")),
    ("mla_decode_fp8_ks2", Some("mla_decode_ks2")),
    ("mla_decode_fp8_t32", Some("mla_decode_t32")),
    ("mla_decode_fp8_t16", Some("mla_decode_t16")),
];

/// The FP8-cache variants with their shared bytes (kernels/variants.cuh).
fn fp8_variants() -> Vec<(&'static str, u32)> {
    VARIANTS
        .iter()
        .map(|&(fp8, _)| (fp8, variants::shared_bytes(fp8)))
        .collect()
}

/// The FP8-cache variants this device runs, in order of preference.
pub fn fp8_decode_variants_for(gpu: &Gpu) -> Vec<&'static str> {
    fp8_variants()
        .into_iter()
        .filter(|&(name, bytes)| runs_on(gpu, name, bytes))
        .map(|(name, _)| name)
        .collect()
}

/// The sparse FP8-cache kernels (the few-heads kernels' sparse forms), in order of preference,
/// each with its dense form. The converting kernels have none.
const SPARSE_VARIANTS: [(&str, &str); 3] = [
    ("mla_sparse_fp8_h8", EIGHT_HEADS),
    ("mla_sparse_fp8_h16", FEW_HEADS),
    ("mla_sparse_wgmma_fp8", WGMMA),
];

/// `variants` in order of preference for `heads`: past `few_heads_up_to` heads the wgmma
/// kernel, 64 heads a block, first; up to it the few-heads kernels, a block per 8 or 16 heads,
/// each block reading the whole cache.
fn by_heads(
    mut variants: Vec<(&'static str, u32)>,
    heads: usize,
    few_heads_up_to: usize,
) -> Vec<(&'static str, u32)> {
    if heads > few_heads_up_to {
        // A stable sort: the wgmma kernels (dense or sparse) to the front.
        variants.sort_by_key(|&(name, _)| !on_wgmma(name));
    }
    variants
}

/// Up to how many heads the dense FP8 decode prefers the few-heads kernels ([`by_heads`]). At
/// 32 heads `h16` (two blocks a sequence, the cache read twice) beat the wgmma kernel on both
/// Hopper cards at batch 64 × 8k: on the H200 (2026-12-07) 206–209 µs against 214–226, on an
/// H100 (the same day, seven runs) 203–207 against 212–216, and on the H100 at batch 1 and 16
/// too. At 64 heads and more it loses by far (H100: 390–394 against 217–222 µs; H200
/// 2026-12-04: 425–467 against 228–248).
const DENSE_FEW_HEADS_UP_TO: usize = 32;

/// The same for the sparse FP8 decode, kept at one block of `h16`: at 32 heads, batch 64 over
/// top-2048 of 32k, the two were within a run's spread on an H100 (2026-12-07, four runs:
/// 90.4–92.2 µs forced against the wgmma kernel's 91.1–92.6), and the H200 is not measured
/// there.
const SPARSE_FEW_HEADS_UP_TO: usize = 16;

/// The sparse FP8-cache variants this device runs, in order of preference.
pub fn sparse_fp8_decode_variants_for(gpu: &Gpu) -> Vec<&'static str> {
    SPARSE_VARIANTS
        .iter()
        .map(|&(sparse, _)| sparse)
        .filter(|name| runs_on(gpu, name, variants::shared_bytes(name)))
        .collect()
}

/// The sparse FP8-cache kernel of a kernel that has one (named densely, sparsely, or as the
/// bf16 decode it mirrors: `mla_decode_wgmma`); `None` for the others.
pub fn sparse_fp8_form(kernel: &str) -> Option<&'static str> {
    SPARSE_VARIANTS
        .iter()
        .find(|&&(sparse, dense)| {
            kernel == sparse || kernel == dense || fp8_twin(dense) == Some(kernel)
        })
        .map(|&(sparse, _)| sparse)
}

/// Whether a decode kernel reads only an fp8_ds_mla cache (the few-heads kernels).
pub fn fp8_only(kernel: &str) -> bool {
    VARIANTS
        .iter()
        .any(|&(fp8, twin)| fp8 == kernel && twin.is_none())
}

/// The bf16 decode variant an FP8-cache variant mirrors (`None` for the few-heads kernel).
pub fn fp8_twin(variant: &str) -> Option<&'static str> {
    VARIANTS
        .iter()
        .find(|(fp8, _)| *fp8 == variant)
        .and_then(|&(_, twin)| twin)
}

/// The FP8-cache kernel for a forced variant, given as the bf16 kernel's name
/// (`mla_decode_ks3`, from `--decode-variant`) or its own; `Err` with the reason when it has
/// none (the TMA and wgmma variants).
pub fn fp8_kernel_of(variant: &str) -> Result<&'static str> {
    VARIANTS
        .iter()
        .find(|(fp8, twin)| *fp8 == variant || *twin == Some(variant))
        .map(|&(fp8, _)| fp8)
        .ok_or_else(|| {
            Error::invalid(format!(
                "{variant} has no form that reads an fp8_ds_mla cache (those are \
                 mla_decode_fp8_h8, mla_decode_fp8_h16, wgmma, ks3, ks2, t32, t16: the TMA-fed \
                 split-k kernels copy the bytes as they are, and the tiles need converting)"
            ))
        })
}

impl DecodeWork {
    /// The plan of an FP8-cache decode: the variant (`forced`, by its own name or its bf16
    /// twin's, or the device's first) and the split count chosen for the shape (`splits`
    /// overrides it, for tests).
    pub fn for_fp8(
        gpu: &Gpu,
        shape: DecodeShape,
        forced: Option<&str>,
        splits: Option<usize>,
    ) -> Result<DecodeWork> {
        let forced = forced.map(fp8_kernel_of).transpose()?;
        let variants = by_heads(fp8_variants(), shape.heads, DENSE_FEW_HEADS_UP_TO);
        DecodeWork::pick(gpu, shape, variants, forced, splits)
    }

    /// The plan of a sparse decode over an FP8 cache: `forced` (a few-heads kernel, by its
    /// dense or sparse name) or the device's first, `splits` or the count chosen for the shape
    /// (`max_len`: the longest list).
    pub fn for_fp8_sparse(
        gpu: &Gpu,
        shape: DecodeShape,
        forced: Option<&str>,
        splits: Option<usize>,
    ) -> Result<DecodeWork> {
        let forced = match forced {
            Some(f) => Some(sparse_fp8_form(f).ok_or_else(|| {
                Error::invalid(format!(
                    "{f} has no sparse form over an fp8_ds_mla cache (those are \
                     mla_decode_fp8_h8, mla_decode_fp8_h16 and wgmma)"
                ))
            })?),
            None => None,
        };
        let sparse = SPARSE_VARIANTS
            .iter()
            .map(|&(name, _)| (name, variants::shared_bytes(name)))
            .collect();
        let sparse = by_heads(sparse, shape.heads, SPARSE_FEW_HEADS_UP_TO);
        DecodeWork::pick(gpu, shape, sparse, forced, splits)
    }
}

/// Absorbed MLA decode over an fp8_ds_mla cache: `q` [batch, heads, 576] bf16, `cache` the paged
/// byte cache [pages·64 · 656], `block_table` [batch, max_pages], `seq_lens` [batch]. Writes
/// `out` [batch, heads, 512] bf16 and `lse` [batch, heads] f32, as [`super::fast::mla_decode`]
/// does; `work` from [`DecodeWork::for_fp8`]. Returns the split kernel's launch, then the
/// merge's when it split.
#[allow(clippy::too_many_arguments)]
pub fn mla_decode_fp8(
    gpu: &Gpu,
    shape: DecodeShape,
    q: &DevBuf,
    cache: &DevBytes,
    block_table: &DevI32,
    seq_lens: &DevI32,
    scale: f32,
    out: &DevBuf,
    lse: &DevBuf,
    work: &DecodeWork,
) -> Result<Vec<KernelLaunch>> {
    fp8_launches(
        gpu,
        shape,
        (q, cache, block_table, seq_lens, None),
        scale,
        (out, lse),
        work,
    )
}

/// Sparse absorbed MLA decode over an fp8_ds_mla cache: as [`mla_decode_fp8`], but sequence b
/// attends to the keys `indices[b, 0..seq_lens[b]]` ([batch, topk] token positions, -1 padding),
/// as [`super::fast::mla_decode_sparse`] does over a bf16 cache; `work` from
/// [`DecodeWork::for_fp8_sparse`].
#[allow(clippy::too_many_arguments)]
pub fn mla_decode_fp8_sparse(
    gpu: &Gpu,
    shape: DecodeShape,
    q: &DevBuf,
    cache: &DevBytes,
    block_table: &DevI32,
    (indices, topk): (&DevI32, usize),
    seq_lens: &DevI32,
    scale: f32,
    out: &DevBuf,
    lse: &DevBuf,
    work: &DecodeWork,
) -> Result<Vec<KernelLaunch>> {
    let keys = SparseKeys { indices, topk };
    fp8_launches(
        gpu,
        shape,
        (q, cache, block_table, seq_lens, Some(keys)),
        scale,
        (out, lse),
        work,
    )
}

/// The inputs of an FP8-cache decode: q, the byte cache, the block table, the lengths, and the
/// key lists when sparse.
pub(super) type Fp8Inputs<'a> = (
    &'a DevBuf,
    &'a DevBytes,
    &'a DevI32,
    &'a DevI32,
    Option<SparseKeys<'a>>,
);

/// The split kernel of an FP8-cache decode (dense or sparse), then the merge when it split.
pub(super) fn fp8_launches(
    gpu: &Gpu,
    shape: DecodeShape,
    (q, cache, block_table, seq_lens, sparse): Fp8Inputs,
    scale: f32,
    (out, lse): (&DevBuf, &DevBuf),
    work: &DecodeWork,
) -> Result<Vec<KernelLaunch>> {
    let known = match sparse {
        None => VARIANTS.iter().any(|(k, _)| *k == work.kernel),
        Some(_) => SPARSE_VARIANTS.iter().any(|(k, _)| *k == work.kernel),
    };
    if !known {
        return Err(Error::invalid(format!(
            "{} is no {}decode over an fp8_ds_mla cache",
            work.kernel,
            if sparse.is_some() { "sparse " } else { "" }
        )));
    }
    let launch = Fp8Decode {
        kernel: work.kernel,
        shared: work.shared,
        batch: shape.batch,
        heads: shape.heads,
        max_pages: shape.max_pages,
        splits: work.splits,
        q,
        cache,
        block_table,
        seq_lens,
        sparse,
        scale_log2: scale * std::f32::consts::LOG2_E,
        outputs: work.outputs(out, lse),
    };
    let split = traced(gpu.mla_decode_fp8_splits(&launch)?, work.splits);
    with_merge(gpu, shape, work, split, out, lse)
}

#[cfg(test)]
mod tests {
    use super::super::fast::head_group;
    use super::*;

    #[test]
    fn fp8_variants_are_described_with_their_twins_layouts_and_found_by_name() {
        for (&(fp8, twin), (_, bytes)) in VARIANTS.iter().zip(fp8_variants()) {
            assert_ne!(bytes, u32::MAX, "{fp8} has no row in kernels/variants.cuh");
            // The cp.async kernels convert in their twin's tiles; the wgmma one has raw stages.
            if let Some(twin) = twin.filter(|_| fp8 != WGMMA) {
                assert_eq!(bytes, variants::shared_bytes(twin), "{fp8}");
            }
        }
        assert_eq!(head_group(WGMMA), 64);
        assert_eq!(fp8_kernel_of("mla_decode_wgmma").unwrap(), WGMMA);
        assert_eq!(
            sparse_fp8_form("mla_decode_wgmma"),
            Some("mla_sparse_wgmma_fp8")
        );
        assert_eq!(sparse_fp8_form("mla_decode_fp8_ks3"), None);
        // Past the few heads the wgmma kernel comes first; up to them, after h16: dense up to
        // 32 heads, sparse up to 16.
        let names = |v: Vec<(&'static str, u32)>| v.into_iter().map(|(n, _)| n).collect::<Vec<_>>();
        let dense = |heads| names(by_heads(fp8_variants(), heads, DENSE_FEW_HEADS_UP_TO));
        assert_eq!(dense(33)[..3], [WGMMA, EIGHT_HEADS, FEW_HEADS]);
        assert_eq!(dense(32)[..3], [EIGHT_HEADS, FEW_HEADS, WGMMA]);
        assert_eq!(dense(16)[..3], [EIGHT_HEADS, FEW_HEADS, WGMMA]);
        let sparse = |heads| {
            let all = SPARSE_VARIANTS.iter().map(|&(n, _)| (n, 0)).collect();
            names(by_heads(all, heads, SPARSE_FEW_HEADS_UP_TO))
        };
        assert_eq!(sparse(17)[0], "mla_sparse_wgmma_fp8");
        assert_eq!(sparse(16)[..2], ["mla_sparse_fp8_h8", "mla_sparse_fp8_h16"]);
        assert_eq!(head_group(FEW_HEADS), 16);
        assert_eq!(head_group(EIGHT_HEADS), 8);
        for (sparse, dense) in SPARSE_VARIANTS {
            assert_eq!(
                variants::shared_bytes(sparse),
                variants::shared_bytes(dense)
            );
            assert_eq!(head_group(sparse), head_group(dense));
        }
        assert_eq!(
            fp8_kernel_of("mla_decode_ks3").unwrap(),
            "mla_decode_fp8_ks3"
        );
        assert_eq!(fp8_kernel_of(FEW_HEADS).unwrap(), FEW_HEADS);
        assert!(fp8_kernel_of("mla_decode_kt3").is_err());
        assert!(fp8_only(EIGHT_HEADS) && fp8_only(FEW_HEADS) && !fp8_only("mla_decode_fp8_ks3"));
    }
}
