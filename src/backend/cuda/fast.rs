//! The tensor-core MLA kernels (kernels/mla_decode.cu, kernels/flash_prefill.cu) on raw device
//! buffers: the decode and prefill that a serving engine runs, for `mladb bench` and for the
//! checks against the CPU reference. bf16 storage, f32 accumulation.
//!
//! The debugger's own attention kernels (attention.cu) also write the attention probabilities
//! and take fault injections; these do neither, and are built for speed.

use super::device::fast_kernels::decode_block;
pub use super::device::fast_kernels::PAIR_MERGE_KERNELS;
use super::device::fast_kernels::{
    env_count, switched_off, Decode, Merge, SparseKeys, SplitOutputs, COMBINE_ROWS_MAX,
};
pub use super::device::fast_kernels::{reads_query_by_tma, DecodeQuery, MergeFaults, MAX_SPLITS};
pub use super::device::fast_kernels::{HEAD_GROUP, LATENT, PAGE, ROPE};
use super::device::{variants, DevBuf, DevI32, Elem, Gpu, Launched};
pub use super::fast_fp8::{
    fp8_decode_variants_for, fp8_only, fp8_twin, mla_decode_fp8, mla_decode_fp8_sparse,
    sparse_fp8_decode_variants_for, sparse_fp8_form,
};
pub use super::fast_prefill::{
    flash_prefill_planted, flash_prefill_variant, prefill_shared_bytes, prefill_variants_for,
    PREFILL_DIMS, PREFILL_VARIANTS,
};
pub use super::fast_sparse::{
    key_lists, mla_decode_sparse, sparse_decode_variants_for, sparse_twin, KeyLists,
};
pub(super) use super::fast_splits::decode_splits;
use crate::error::{Error, Result};
use crate::ops::KernelLaunch;
use std::sync::OnceLock;

/// A launch as the trace records it; `splits` for the decode's split kernel.
pub(super) fn traced(l: Launched, splits: usize) -> KernelLaunch {
    KernelLaunch {
        kernel: l.kernel,
        grid: [l.grid.0, l.grid.1, l.grid.2],
        block: [l.block, 1, 1],
        shared_bytes: l.shared,
        splits: splits as u32,
        cluster: l.cluster,
    }
}

/// One decode launch: `batch` sequences of one query token each.
#[derive(Clone, Copy, Debug)]
pub struct DecodeShape {
    pub batch: usize,
    /// Query heads per sequence, any count from 1: a tensor-parallel rank holds the model's
    /// heads / TP (GLM-5 at TP 8: 8). Blocks take [`HEAD_GROUP`] at a time, the last padded.
    pub heads: usize,
    /// Columns of the block table (pages per sequence at most).
    pub max_pages: usize,
    /// The longest sequence (tokens; sparse: the longest key list), to choose the KV split.
    pub max_len: usize,
}

/// The decode kernel variants, in order of preference, with their shared bytes per block from
/// kernels/variants.cuh (where each is described once):
/// `mla_decode_wgmma` (Hopper only, kernels/mla_decode_sm90.cu: TMA and warpgroup MMAs, 222 KB);
/// `mla_decode_kt3` (the split-k mma.sync kernel with its tiles by TMA: sm_90 and later, 221 KB);
/// `mla_decode_ks3` (split-k S, P·V by output dims, three stages: 222 KB, Hopper and B200);
/// `mla_decode_ks2` (the same in two stages, 185 KB); `mla_decode_kt16` (the split-k kernel for
/// 32 heads with Q in registers and four 16-token stages by TMA, 84 KB: sm_120);
/// `mla_decode_t32` (32-token tiles in two stages, 152 KB: A100); `mla_decode_t16` (16-token
/// tiles in one stage, 96 KB: sm_86/89). kernels/mla_decode.cu says how they differ.
pub(super) fn decode_variants() -> [(&'static str, u32); 7] {
    [
        "mla_decode_wgmma",
        "mla_decode_kt3",
        "mla_decode_ks3",
        "mla_decode_ks2",
        "mla_decode_kt16",
        "mla_decode_t32",
        "mla_decode_t16",
    ]
    .map(|kernel| (kernel, variants::shared_bytes(kernel)))
}

/// The decode kernel variants this device's shared memory allows, in order of preference.
pub fn decode_variants_for(gpu: &Gpu) -> Vec<&'static str> {
    decode_variants()
        .into_iter()
        .filter(|&(name, bytes)| runs_on(gpu, name, bytes))
        .map(|(name, _)| name)
        .collect()
}

/// Whether a variant can run on a device: it was built for it (Hopper-only kernels exist on
/// Hopper alone), the device has TMA if the kernel uses it, and its shared memory fits.
pub(super) fn runs_on(gpu: &Gpu, name: &str, shared: u32) -> bool {
    gpu.has_kernel(name)
        && (!needs_sm90(name) || has_tma(gpu))
        && shared as usize <= gpu.max_shared_per_block()
}

/// The decode kernels that read the cache through a TMA tensor map (their first argument).
pub(super) fn reads_cache_by_tma(kernel: &str) -> bool {
    matches!(
        kernel,
        "mla_decode_wgmma" | "mla_decode_kt3" | "mla_decode_kt16"
    )
}

/// The decode kernels on Hopper's warpgroup MMAs (bf16 or FP8 cache, dense or sparse).
pub(super) fn on_wgmma(kernel: &str) -> bool {
    kernel.contains("wgmma")
}

/// The decode kernels that need sm_90 or later: those fed by TMA, the few-heads kernels (fewer
/// rows than [`HEAD_GROUP`]), fed by bulk copies, and the other wgmma kernels (sparse, FP8).
fn needs_sm90(kernel: &str) -> bool {
    reads_cache_by_tma(kernel) || head_group(kernel) < HEAD_GROUP || on_wgmma(kernel)
}

/// TMA exists from compute capability 9.0 on (Hopper, B200, sm_120).
pub(super) fn has_tma(gpu: &Gpu) -> bool {
    gpu.arch.parse::<u32>().is_ok_and(|a| a >= 90)
}

/// The decode variant for a device: `forced` (a kernel name, from `--decode-variant`) if given,
/// else the first that runs on it.
fn decode_variant(gpu: &Gpu, forced: Option<&str>) -> Result<(&'static str, u32)> {
    pick_variant(gpu, &decode_variants(), forced)
}

/// The variant of `variants` for a device: `forced` if given (an error when it cannot run),
/// else the first that runs.
pub(super) fn pick_variant(
    gpu: &Gpu,
    variants: &[(&'static str, u32)],
    forced: Option<&str>,
) -> Result<(&'static str, u32)> {
    let limit = gpu.max_shared_per_block() as u32;
    if let Some(want) = forced {
        let &(name, bytes) = variants
            .iter()
            .find(|(name, _)| *name == want)
            .ok_or_else(|| Error::invalid(format!("no MLA decode kernel variant {want}")))?;
        if !gpu.has_kernel(name) || (needs_sm90(name) && !has_tma(gpu)) {
            return Err(Error::invalid(format!(
                "{name} does not run on this device (it needs TMA, or Hopper's wgmma)"
            )));
        }
        if bytes > limit {
            return Err(Error::invalid(format!(
                "{name} needs {bytes} bytes of shared memory per block; this device allows {limit}"
            )));
        }
        return Ok((name, bytes));
    }
    variants
        .iter()
        .copied()
        .find(|&(name, bytes)| runs_on(gpu, name, bytes))
        .ok_or_else(|| {
            Error::invalid(format!(
                "the MLA decode kernel needs {} bytes of shared memory per block; this device allows {limit}",
                variants[variants.len() - 1].1
            ))
        })
}

/// The decode kernel a launch on this device uses: `forced` if given, else the first that runs.
pub fn decode_kernel(gpu: &Gpu, forced: Option<&str>) -> Result<&'static str> {
    decode_variant(gpu, forced).map(|(name, _)| name)
}

/// The decode kernels with page-index-overflow planted, in order of preference: the dense
/// variants `ks3` and `t16` with their page offsets in 32 bits (kernels/common.cuh `paged_row`).
pub const PLANTED_DECODE: [&str; 2] = ["mla_decode_ks3_o32", "mla_decode_t16_o32"];

/// The first page past 4 GiB of a bf16 pool: pages from here on are where 32-bit byte offsets
/// wrap (58 255 pages of 64 rows of 576).
pub const OVERFLOW_PAGE: usize = (1usize << 32).div_ceil(PAGE * (LATENT + ROPE) * 2);

/// The plan of a decode with page-index-overflow planted: the planted kernel `forced` (one of
/// [`PLANTED_DECODE`], for tests) or the first the device runs, `splits` or the count chosen for
/// the shape.
pub fn planted_decode_work(
    gpu: &Gpu,
    shape: DecodeShape,
    splits: Option<usize>,
    forced: Option<&str>,
) -> Result<DecodeWork> {
    let planted = PLANTED_DECODE.map(|kernel| (kernel, variants::shared_bytes(kernel)));
    DecodeWork::pick(gpu, shape, planted.to_vec(), forced, splits)
}

/// The heads a block of a decode kernel takes: its variant's rows ([`HEAD_GROUP`] for the
/// dense decodes, fewer for a rank's kernels).
pub(super) fn head_group(kernel: &str) -> usize {
    decode_block(kernel).0
}

/// `variants` without the 8-head kernels when a group of 8 does not hold every head (they would
/// read the cache once per 8 heads instead of once per 16 or 64), unless one is `forced`.
fn for_heads(
    variants: Vec<(&'static str, u32)>,
    heads: usize,
    forced: Option<&str>,
) -> Vec<(&'static str, u32)> {
    variants
        .into_iter()
        .filter(|&(name, _)| forced.is_some() || head_group(name) > 8 || heads <= 8)
        .collect()
}

/// A decode launch plan: the kernel variant for the device, the split count, and the scratch
/// (per-split outputs and log-sum-exps), chosen once and reused by every launch of the shape.
pub struct DecodeWork {
    pub kernel: &'static str,
    pub(super) shared: u32,
    /// Allocated only where the launch writes them ([`DecodeWork::writes_partials`]): a split
    /// decode that merges with the merge kernel; one split, or a pair merged inside the kernel,
    /// leaves them empty.
    pub(super) part_o: DevBuf,
    pub(super) part_lse: DevBuf,
    /// Sequences × heads of the shape the partials are for.
    rows: usize,
    pub splits: usize,
    /// Faults planted in the merge (the debugger's; none by default): set by
    /// [`DecodeWork::plant_merge_faults`].
    merge_faults: MergeFaults,
}

impl DecodeWork {
    /// The plan of one of `variants` (in order of preference, those the head count wants:
    /// [`for_heads`]): `forced`, or the device's first ([`pick_variant`]); `splits`, or the
    /// count chosen for the shape.
    pub(super) fn pick(
        gpu: &Gpu,
        shape: DecodeShape,
        variants: Vec<(&'static str, u32)>,
        forced: Option<&str>,
        splits: Option<usize>,
    ) -> Result<DecodeWork> {
        let candidates = for_heads(variants, shape.heads, forced);
        let variant = pick_variant(gpu, &candidates, forced)?;
        let splits = splits.unwrap_or_else(|| decode_splits(gpu, shape, variant));
        DecodeWork::scratch(gpu, shape, splits, variant)
    }

    pub fn new(gpu: &Gpu, shape: DecodeShape) -> Result<DecodeWork> {
        DecodeWork::for_variant(gpu, shape, None)
    }

    /// The plan for a forced variant (a kernel name; `None`: the device's first), with the
    /// split count chosen for the shape.
    pub fn for_variant(gpu: &Gpu, shape: DecodeShape, variant: Option<&str>) -> Result<DecodeWork> {
        let chosen = decode_variant(gpu, variant)?;
        DecodeWork::with_variant(gpu, shape, decode_splits(gpu, shape, chosen), variant)
    }

    /// Whether the launch merges its splits inside the kernel, in clusters of two blocks (the
    /// wgmma kernels at two splits on sm_90, unless a merge fault is planted: those live in the
    /// merge kernel): then it leaves no partials. `MLADB_DECODE_PAIR_MERGE=0` turns it off.
    pub fn pairs_splits(&self, gpu: &Gpu) -> bool {
        static PAIR_MERGE_OFF: OnceLock<bool> = OnceLock::new();
        self.splits == 2
            && PAIR_MERGE_KERNELS.contains(&self.kernel)
            && has_tma(gpu)
            && !self.merge_faults.any()
            && !switched_off("MLADB_DECODE_PAIR_MERGE", &PAIR_MERGE_OFF)
    }

    /// Where a launch of this plan writes: its partials, and `out` and `lse`.
    pub(super) fn outputs<'a>(&'a self, out: &'a DevBuf, lse: &'a DevBuf) -> SplitOutputs<'a> {
        SplitOutputs {
            part_o: &self.part_o,
            part_lse: &self.part_lse,
            out,
            lse,
        }
    }

    /// The split partials the launch left, as device buffers: outputs [batch, splits, heads,
    /// 512] in bf16 and natural log-sum-exps [batch, splits, heads] in f32 (meaningful when it
    /// split the keys).
    pub fn into_partials(self) -> (DevBuf, DevBuf) {
        (self.part_o, self.part_lse)
    }

    /// Whether the launch writes split partials for the merge kernel to read: it splits the
    /// keys and does not merge its two splits inside the kernel.
    pub fn writes_partials(&self, gpu: &Gpu) -> bool {
        self.splits > 1 && !self.pairs_splits(gpu)
    }

    /// Plants faults in the merge (the merge kernel then runs, so the partials are made).
    pub fn plant_merge_faults(&mut self, gpu: &Gpu, faults: MergeFaults) -> Result<()> {
        self.merge_faults = faults;
        self.make_partials(gpu)
    }

    /// The faults planted in the merge.
    pub fn merge_faults(&self) -> MergeFaults {
        self.merge_faults
    }

    /// The partials' buffers, at their size, where the launch writes them and they are not
    /// there yet.
    fn make_partials(&mut self, gpu: &Gpu) -> Result<()> {
        let len = self.rows * self.splits * LATENT;
        if self.writes_partials(gpu) && self.part_o.len() < len {
            self.part_o = gpu.alloc(len, Elem::Bf16)?;
            self.part_lse = gpu.alloc(self.rows * self.splits, Elem::F32)?;
        }
        Ok(())
    }

    /// Scratch for a chosen number of splits (1 to 256; tests use it to cover both the
    /// single-split path, which writes the result directly, and the merge).
    pub fn with_splits(gpu: &Gpu, shape: DecodeShape, splits: usize) -> Result<DecodeWork> {
        DecodeWork::with_variant(gpu, shape, splits, None)
    }

    /// The same with a chosen kernel variant (a name from [`decode_variants_for`]), for tests.
    pub fn with_variant(
        gpu: &Gpu,
        shape: DecodeShape,
        splits: usize,
        variant: Option<&str>,
    ) -> Result<DecodeWork> {
        DecodeWork::scratch(gpu, shape, splits, decode_variant(gpu, variant)?)
    }

    /// The plan of a chosen (kernel, shared bytes) with scratch for `splits` (1 to 256).
    pub(super) fn scratch(
        gpu: &Gpu,
        shape: DecodeShape,
        splits: usize,
        (kernel, shared): (&'static str, u32),
    ) -> Result<DecodeWork> {
        if !(1..=MAX_SPLITS).contains(&splits) {
            return Err(Error::invalid(format!(
                "MLA decode: {splits} splits (1 to {MAX_SPLITS})"
            )));
        }
        let mut work = DecodeWork {
            kernel,
            shared,
            part_o: gpu.alloc(0, Elem::Bf16)?,
            part_lse: gpu.alloc(0, Elem::F32)?,
            rows: shape.batch * shape.heads,
            splits,
            merge_faults: MergeFaults::default(),
        };
        work.make_partials(gpu)?;
        Ok(work)
    }
}

/// Absorbed MLA decode: `q` [batch, heads, 576] bf16 (q_nope·W_UK then q_pe; or the two parts
/// apart, [`DecodeQuery::Parts`], for the kernels that read the query by TMA), `cache` the paged
/// latent cache [pages·64, 576] bf16, `block_table` [batch, max_pages] i32, `seq_lens` [batch]
/// i32. Writes `out` [batch, heads, 512] bf16 (the latent output, before W_UV) and `lse`
/// [batch, heads] f32. Returns the launches: the split kernel, then the merge when it split.
#[allow(clippy::too_many_arguments)]
pub fn mla_decode<'q>(
    gpu: &Gpu,
    shape: DecodeShape,
    q: impl Into<DecodeQuery<'q>>,
    cache: &DevBuf,
    block_table: &DevI32,
    seq_lens: &DevI32,
    scale: f32,
    out: &DevBuf,
    lse: &DevBuf,
    work: &DecodeWork,
) -> Result<Vec<KernelLaunch>> {
    decode_launches(
        gpu,
        shape,
        q.into(),
        cache,
        block_table,
        seq_lens,
        None,
        scale,
        out,
        lse,
        work,
    )
}

/// The split kernel (dense, or sparse with `sparse`), then the merge when it split.
#[allow(clippy::too_many_arguments)]
pub(super) fn decode_launches(
    gpu: &Gpu,
    shape: DecodeShape,
    q: DecodeQuery<'_>,
    cache: &DevBuf,
    block_table: &DevI32,
    seq_lens: &DevI32,
    sparse: Option<SparseKeys>,
    scale: f32,
    out: &DevBuf,
    lse: &DevBuf,
    work: &DecodeWork,
) -> Result<Vec<KernelLaunch>> {
    let launch = Decode {
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
        pair_merge: work.pairs_splits(gpu),
    };
    let split = traced(gpu.mla_decode_splits(&launch)?, work.splits);
    if launch.pair_merge {
        return Ok(vec![split]);
    }
    with_merge(gpu, shape, work, split, out, lse)
}

/// A split kernel's launch, then the merge of its partials into `out` and `lse` when it split
/// (with one split the kernel wrote the result itself): the same for every decode kernel.
pub(super) fn with_merge(
    gpu: &Gpu,
    shape: DecodeShape,
    work: &DecodeWork,
    split: KernelLaunch,
    out: &DevBuf,
    lse: &DevBuf,
) -> Result<Vec<KernelLaunch>> {
    if work.splits == 1 {
        return Ok(vec![split]);
    }
    // Few splits over many rows: a warp per (sequence, head), no block barriers (the whole
    // decode at batch 64 × 1k, 2 splits, on the H200: 58 µs instead of 86). Under 64 blocks of
    // rows the block-wide merge spreads wider (batch 1 × 1k, 16 splits: 16.3 µs against 19–20).
    let per_row = work.splits <= combine_rows_max() && shape.batch * shape.heads >= 512;
    let merge = Merge {
        batch: shape.batch,
        heads: shape.heads,
        splits: work.splits,
        outputs: work.outputs(out, lse),
        faults: work.merge_faults,
    };
    let merge = traced(gpu.mla_decode_merge(&merge, per_row)?, 1);
    Ok(vec![split, merge])
}

/// Up to how many splits the per-row merge runs (at most 32, a split per lane);
/// `MLADB_COMBINE_ROWS_MAX` sets another bound, for experiments (0: never).
fn combine_rows_max() -> usize {
    static SET: OnceLock<Option<usize>> = OnceLock::new();
    env_count("MLADB_COMBINE_ROWS_MAX", &SET)
        .unwrap_or(16)
        .min(COMBINE_ROWS_MAX)
}

/// The f64 reference the fast kernels are checked against: softmax(scale · q·kᵢ) over the
/// given (key, value) rows, times the values. Keys may be wider than q (only q's width is used).
pub fn reference_attention<'a>(
    q: &[f32],
    rows: impl Iterator<Item = (&'a [f32], &'a [f32])>,
    scale: f64,
) -> Vec<f64> {
    let rows: Vec<(&[f32], &[f32])> = rows.collect();
    let scores: Vec<f64> = rows
        .iter()
        .map(|(k, _)| {
            q.iter()
                .zip(k.iter())
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>()
                * scale
        })
        .collect();
    let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
    let total: f64 = weights.iter().sum();
    let width = rows.first().map_or(0, |(_, v)| v.len());
    let mut out = vec![0.0; width];
    for (w, (_, v)) in weights.iter().zip(&rows) {
        for (o, &x) in out.iter_mut().zip(v.iter()) {
            *o += w / total * x as f64;
        }
    }
    out
}

/// ‖a − b‖ / ‖b‖, with NaN (an unwritten or broken element) giving infinity.
pub fn relative_error(a: &[f32], b: &[f64]) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        if !x.is_finite() {
            return f64::INFINITY;
        }
        diff += (x as f64 - y).powi(2);
        norm += y * y;
    }
    (diff / norm.max(1e-300)).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_decode_variant_the_launchers_pick_from_is_described() {
        for (kernel, bytes) in decode_variants() {
            assert_ne!(
                bytes,
                u32::MAX,
                "{kernel} has no row in kernels/variants.cuh"
            );
            // A block takes a whole head group, or half of one (the 32-head form for 99 KB
            // parts), so that the padded rows of a rank's few heads stay in one block.
            let rows = variants::variant(kernel).unwrap().rows;
            assert!(
                rows == HEAD_GROUP || (kernel == "mla_decode_kt16" && rows == HEAD_GROUP / 2),
                "{kernel}: {rows} rows"
            );
        }
    }
}
