//! How many splits a decode's keys are cut into: the split count of least cost for a shape.

use super::device::fast_kernels::{decode_block, env_count, MAX_SPLITS};
use super::device::Gpu;
use super::fast::{head_group, on_wgmma, reads_cache_by_tma, DecodeShape};
use std::sync::OnceLock;

/// How many KV splits for a shape: the fewest waves of blocks times the tokens each block
/// walks (plus a fixed cost per split for its start), plus the partials every split writes and
/// the merge reads back (512 values per sequence and head, twice), at no fewer than 64 tokens per
/// split, a block's tokens rounded up to whole tiles as the kernels round them. The partials
/// are weighed for the TMA-fed and wgmma kernels only, whose blocks walk their tokens fast
/// enough that they matter: on the H200 about two tokens of a block's time per split and group
/// of 64 heads
/// (a sweep of 16 to 128 splits over batches 1–8, contexts 1k–32k and 8, 64 and 128 heads on
/// 2026-12-04: B1 × 8k 18.6 → 17.5 µs against four tokens, B1 × 32k 29.6 → 28.2, B4 × 8k 30.4 →
/// 28.5), a share of that for fewer heads; the cp.async kernels (FP8 among them) went slower
/// with fewer splits (FP8 B1 × 8k: 25.5 → 34.5 µs), so they keep the plain count. The sweep
/// wrote the partials in f32; they are bf16 since 2026-12-06, half the bytes, and a second
/// sweep then (an H100: B1 × 8k forced to 43, 64, 86, 128 splits, and weights 0, 1, 2) still
/// found two tokens and its 64 splits the best.
pub(super) fn decode_splits(gpu: &Gpu, shape: DecodeShape, (kernel, shared): (&str, u32)) -> usize {
    // Blocks per multiprocessor: its shared memory over the block's (plus the 1 KB the driver
    // reserves per block), or fewer where the kernel's registers allow fewer.
    let by_shared = (gpu.max_shared_per_multiprocessor() / (shared as usize + 1024)).max(1);
    let per_sm = gpu
        .resident_blocks(kernel, decode_block(kernel).1, shared)
        .map_or(by_shared, |n| n.min(by_shared));
    let slots = gpu.multiprocessors() * per_sm;
    // The fixed cost in tokens; `MLADB_DECODE_SPLIT_COST` sets another, for experiments.
    static FIXED: OnceLock<Option<usize>> = OnceLock::new();
    let fixed = env_count("MLADB_DECODE_SPLIT_COST", &FIXED).unwrap_or(192);
    // The partials' cost per split and head group, in tokens; `MLADB_DECODE_MERGE_COST` sets
    // another, for experiments.
    static MERGE: OnceLock<Option<usize>> = OnceLock::new();
    let merge = env_count("MLADB_DECODE_MERGE_COST", &MERGE).unwrap_or(2)
        * usize::from(reads_cache_by_tma(kernel) || on_wgmma(kernel));
    let group = head_group(kernel);
    split_count(SplitCosts {
        slots,
        groups: shape.batch * shape.heads.div_ceil(group),
        max_len: shape.max_len,
        fixed,
        merge: partials_cost(merge, shape.batch, shape.heads, group),
    })
}

/// What one split's partials cost, in tokens of a block's time: `per_group` for each group of
/// `group` heads' rows. The partials are a row per head, so a group of fewer heads than the
/// kernel's rows (a rank's 8 of 64) writes and reads back that share of them.
fn partials_cost(per_group: usize, batch: usize, heads: usize, group: usize) -> usize {
    (per_group * batch * heads).div_ceil(group)
}

/// What [`decode_splits`] weighs: block slots on the device, blocks per split (sequences × head
/// groups), the longest sequence, and the per-split costs in tokens of a block's time: `fixed`
/// per block, `merge` for all the partials of one split.
struct SplitCosts {
    slots: usize,
    groups: usize,
    max_len: usize,
    fixed: usize,
    merge: usize,
}

/// The split count of least cost (see [`decode_splits`]).
fn split_count(c: SplitCosts) -> usize {
    let mut best = (usize::MAX, 1);
    for s in 1..=c.max_len.div_ceil(64).clamp(1, MAX_SPLITS) {
        // The kernels round a split's tokens up to whole 32-token tiles; a count whose last
        // splits would be left empty by that is a smaller count with the same work.
        let chunk = c.max_len.div_ceil(s).div_ceil(32) * 32;
        if c.max_len.div_ceil(chunk) < s {
            continue;
        }
        let waves = (c.groups * s).div_ceil(c.slots);
        let partials = if s > 1 { c.merge * s } else { 0 };
        // A block walks whole tiles: its share rounded up, as the kernels round it.
        let cost = waves * (chunk + c.fixed) + partials;
        if cost < best.0 {
            best = (cost, s);
        }
    }
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The H200's 132 multiprocessors, one 222 KB block each.
    fn h200(groups: usize, max_len: usize, merge: usize) -> usize {
        split_count(SplitCosts {
            slots: 132,
            groups,
            max_len,
            fixed: 192,
            merge: merge * groups,
        })
    }

    #[test]
    fn split_counts_weigh_the_partials_and_leave_no_split_empty() {
        // One sequence of 8k: 128 splits of 64 tokens without the partials' cost, 64 of 128
        // at two tokens a split (the best count of the H200 sweep of 2026-12-04), 43 of 192 at
        // four (the earlier weight).
        assert_eq!(h200(1, 8192, 0), 128);
        assert_eq!(h200(1, 8192, 2), 64);
        assert_eq!(h200(1, 8192, 4), 43);
        // 32k: 128 splits of 256 at two tokens (28.2 µs in the sweep, against 29.5 on 86).
        assert_eq!(h200(1, 32768, 2), 128);
        // Batch 4 × 8k: 32 splits, one wave of 128 blocks (28.5 µs, against 30.4 on 20).
        assert_eq!(h200(4, 8192, 2), 32);
        // 64 sequences fill a wave with two splits either way.
        assert_eq!(h200(64, 8192, 0), 2);
        assert_eq!(h200(64, 8192, 4), 2);
        assert_eq!(h200(64, 8192, 2), 2);
        // A long batch needs no split at all.
        assert_eq!(h200(128, 4096, 4), 1);
        assert_eq!(h200(128, 4096, 2), 1);
        // A rank's 8 heads in a group of 64 write an eighth of the partials: more splits pay
        // (batch 1 × 8k: 86 rather than 43; batch 64 × 1k: two rather than one).
        assert_eq!(partials_cost(4, 1, 64, 64), 4);
        assert_eq!(partials_cost(4, 64, 128, 64), 512);
        assert_eq!(partials_cost(4, 1, 8, 64), 1);
        let eighth = |batch, max_len| {
            split_count(SplitCosts {
                slots: 132,
                groups: batch,
                max_len,
                fixed: 192,
                merge: partials_cost(4, batch, 8, 64),
            })
        };
        assert_eq!(eighth(1, 8192), 86);
        assert_eq!(eighth(64, 1024), 2);
        assert_eq!(h200(64, 1024, 4), 1, "at 64 heads one split still");
        // No count leaves a split empty after the rounding to 32-token tiles.
        for len in [100, 1000, 4096, 5000, 8192, 32768] {
            for merge in [0, 2, 4] {
                let s = h200(1, len, merge);
                let chunk = len.div_ceil(s).div_ceil(32) * 32;
                assert_eq!(
                    len.div_ceil(chunk),
                    s,
                    "{len} tokens, merge {merge}: {s} splits"
                );
            }
        }
    }
}
