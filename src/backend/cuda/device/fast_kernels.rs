//! Typed launchers of the tensor-core MLA decode kernels (mla_decode*.cu): the paged decode with
//! its split merge, its TMA tensor maps made here (the causal prefill's are in
//! [`super::prefill_kernels`]).
//! The choice of variant and split count is `cuda::fast`'s; what a launch may touch is checked
//! here.

use super::kernels::{blocks, blocks_yz, need, prod};
pub use super::merge_kernels::{Merge, MergeFaults, SplitOutputs, COMBINE_ROWS_MAX};
use super::signature::{Param::*, Sig};
use super::{Arg, DevBuf, DevI32, Elem, Gpu, Launch, Launched};
use crate::error::{Error, Result};
use std::sync::OnceLock;

const DECODE: [super::signature::Param; 12] = [
    Bf16Ptr, Bf16Ptr, I32Ptr, Int, I32Ptr, Float, Bf16Ptr, F32Ptr, Int, Int, Bf16Ptr, F32Ptr,
];
const DECODE_TMA: [super::signature::Param; 13] = [
    Map, Bf16Ptr, Bf16Ptr, I32Ptr, Int, I32Ptr, Float, Bf16Ptr, F32Ptr, Int, Int, Bf16Ptr, F32Ptr,
];
/// The wgmma decode: the cache's tensor map, then the query's two (its latent and RoPE parts).
const DECODE_WGMMA: [super::signature::Param; 14] = [
    Map, Map, Map, Bf16Ptr, I32Ptr, Int, I32Ptr, Float, Bf16Ptr, F32Ptr, Int, Int, Bf16Ptr, F32Ptr,
];
/// The sparse twins: the dense list with the key lists (indices, topk) after the block table.
const SPARSE: [super::signature::Param; 14] = [
    Bf16Ptr, Bf16Ptr, I32Ptr, Int, I32Ptr, Int, I32Ptr, Float, Bf16Ptr, F32Ptr, Int, Int, Bf16Ptr,
    F32Ptr,
];
/// The sparse wgmma decode: the query's two tensor maps, then the sparse list.
const SPARSE_WGMMA: [super::signature::Param; 15] = [
    Map, Map, Bf16Ptr, I32Ptr, Int, I32Ptr, Int, I32Ptr, Float, Bf16Ptr, F32Ptr, Int, Int, Bf16Ptr,
    F32Ptr,
];
pub const MLA_DECODE_TILED: Sig = Sig::new("mla_decode_t*", &DECODE);
pub const MLA_DECODE_SPLIT_K: Sig = Sig::new("mla_decode_ks*", &DECODE);
/// The split-k kernels fed by TMA (`mla_decode_kt3`, `mla_decode_kt16`).
pub const MLA_DECODE_KT: Sig = Sig::new("mla_decode_kt*", &DECODE_TMA);
pub const MLA_DECODE_WGMMA: Sig = Sig::new("mla_decode_wgmma", &DECODE_WGMMA);
/// The sparse twin of [`MLA_DECODE_WGMMA`] (rows gathered by cp.async: the query's tensor map
/// alone).
pub const MLA_SPARSE_WGMMA: Sig = Sig::new("mla_sparse_wgmma", &SPARSE_WGMMA);
pub const MLA_SPARSE_TILED: Sig = Sig::new("mla_sparse_t*", &SPARSE);
pub const MLA_SPARSE_SPLIT_K: Sig = Sig::new("mla_sparse_ks*", &SPARSE);
pub const MLA_SPARSE_FEW_HEADS: Sig = Sig::new("mla_sparse_h*", &SPARSE);
/// Every launcher's declaration (compared with the `.cu` signatures by a test).
pub const SIGNATURES: &[&Sig] = &[
    &MLA_DECODE_TILED,
    &MLA_DECODE_SPLIT_K,
    &MLA_DECODE_KT,
    &MLA_DECODE_WGMMA,
    &MLA_SPARSE_WGMMA,
    &MLA_SPARSE_TILED,
    &MLA_SPARSE_SPLIT_K,
    &MLA_SPARSE_FEW_HEADS,
];

/// Latent width (kv_lora_rank) and RoPE width the decode kernels are built for.
pub const LATENT: usize = 512;
pub const ROPE: usize = 64;
/// Tokens per page of the paged latent cache.
pub const PAGE: usize = 64;
/// Heads one decode block handles. A head count off a multiple of it (a tensor-parallel rank's
/// share: 8 or 16) runs too: the kernels pad the last group and write only its real heads.
pub const HEAD_GROUP: usize = 64;
/// The most KV splits (the merge's shared array, mla_decode.cu's MAX_SPLITS).
pub const MAX_SPLITS: usize = 256;

/// Few-heads kernels with a fifth warp that only issues the copies (4 compute warps + 1; the
/// kernel traps on another block size rather than wait for a producer that is not there).
const PRODUCER_WARP: [&str; 2] = ["mla_sparse_h8", "mla_sparse_fp8_h8"];

/// The most rows of the few-heads kernels, which run four warps (the others run eight).
const FEW_HEADS: usize = 16;

/// The heads one block of a decode kernel takes and its threads: its variant's rows
/// (kernels/variants.cuh: [`HEAD_GROUP`], 32 for `mla_decode_kt16`, 8 or 16 for the few-heads
/// kernels) and eight warps, four for the few-heads kernels.
pub fn decode_block(kernel: &str) -> (usize, u32) {
    let heads = super::variants::variant(kernel).map_or(HEAD_GROUP, |v| v.rows);
    let threads = if PRODUCER_WARP.contains(&kernel) {
        160
    } else if heads <= FEW_HEADS {
        128
    } else {
        256
    };
    (heads, threads)
}

/// The key lists of a sparse decode, checked: every row's `topk` entries within -1..positions.
/// Returns the kernel arguments (the lists, topk).
pub(super) fn key_list_args(keys: SparseKeys, batch: usize, positions: i64) -> Result<[Arg; 2]> {
    let entries = prod(&[batch, keys.topk])?;
    if !keys.indices.values_within(entries, -1, positions) || keys.indices.len() < entries {
        return Err(Error::invalid(
            "MLA sparse decode: the key lists are short, or not known to lie in -1..max_pages·64",
        ));
    }
    Ok([
        Arg::Ptr(I32Ptr, keys.indices.ptr()),
        int(keys.topk, "topk")?,
    ])
}

/// The key lists of a sparse decode: sequence b attends to the token positions
/// `indices[b, 0..seq_lens[b]]` (-1: padding, masked), not to its first `seq_lens[b]` tokens.
#[derive(Clone, Copy)]
pub struct SparseKeys<'a> {
    /// [batch, topk] positions in -1..max_pages·64, each row's entries past its length unread.
    pub indices: &'a DevI32,
    pub topk: usize,
}

/// One decode launch: `batch` sequences of one query token each over a paged cache.
pub struct Decode<'a> {
    /// A kernel of [`MLA_DECODE_TILED`], [`MLA_DECODE_SPLIT_K`], [`MLA_DECODE_KT`] or
    /// [`MLA_DECODE_WGMMA`]; with `sparse`, of [`MLA_SPARSE_WGMMA`], [`MLA_SPARSE_TILED`],
    /// [`MLA_SPARSE_SPLIT_K`] or [`MLA_SPARSE_FEW_HEADS`].
    pub kernel: &'a str,
    pub shared: u32,
    pub batch: usize,
    /// At least 1, any count: the grid has ⌈heads / [`HEAD_GROUP`]⌉ groups.
    pub heads: usize,
    /// Columns of the block table.
    pub max_pages: usize,
    pub splits: usize,
    pub q: DecodeQuery<'a>,
    /// [pages·64, 576] bf16.
    pub cache: &'a DevBuf,
    /// [batch, max_pages] page numbers.
    pub block_table: &'a DevI32,
    /// [batch] lengths in tokens (with `sparse`: of the key lists, at most topk).
    pub seq_lens: &'a DevI32,
    /// The key lists of a sparse kernel; `None` for the dense ones.
    pub sparse: Option<SparseKeys<'a>>,
    pub scale_log2: f32,
    pub outputs: SplitOutputs<'a>,
    /// Two splits launched as clusters of two blocks that merge each other's results into `out`
    /// and `lse` (no partials, no merge kernel): the wgmma kernels at exactly two splits.
    pub pair_merge: bool,
}

/// A decode's query, bf16.
#[derive(Clone, Copy)]
pub enum DecodeQuery<'a> {
    /// [batch, heads, 576]: the latent part (q_nope·W_UK) and the RoPE part side by side.
    Joined(&'a DevBuf),
    /// The two parts where the engine made them, [rows, 512] and [rows, 64] for the first
    /// rows ≤ batch·heads (a padded batch's last sequences read zeros): read by the kernels that
    /// load the query by TMA ([`reads_query_by_tma`]), which then need no joined copy.
    Parts {
        latent: &'a DevBuf,
        rope: &'a DevBuf,
    },
}

impl<'a> From<&'a DevBuf> for DecodeQuery<'a> {
    fn from(q: &'a DevBuf) -> DecodeQuery<'a> {
        DecodeQuery::Joined(q)
    }
}

/// Whether a decode kernel loads its query by TMA (the wgmma kernels), so that it can read the
/// query's two parts where they lie ([`DecodeQuery::Parts`]).
pub fn reads_query_by_tma(kernel: &str) -> bool {
    MLA_DECODE_WGMMA.matches(kernel) || MLA_SPARSE_WGMMA.matches(kernel)
}

/// The kernels that merge their two splits themselves when launched in clusters of two
/// (kernels/mla_decode_sm90.cu, `pair_merge`).
pub const PAIR_MERGE_KERNELS: [&str; 2] = ["mla_decode_wgmma", "mla_sparse_wgmma"];

/// The split kernels that wait for the kernel before them (`wait_for_prior_kernel`) before they
/// read or write device memory, so that they may be launched as its dependents.
const SPLIT_WAITS_KERNELS: [&str; 4] = [
    "mla_decode_wgmma",
    "mla_sparse_wgmma",
    "mla_decode_wgmma_fp8",
    "mla_sparse_wgmma_fp8",
];

/// Whether `var` is set to `0` in the environment, which turns a launch choice off (read once
/// per process into `once`: the launch paths ask on every call).
pub fn switched_off(var: &str, once: &OnceLock<bool>) -> bool {
    *once.get_or_init(|| std::env::var(var).is_ok_and(|v| v == "0"))
}

/// A count set for experiments in environment variable `var` (`None` where unset or not a
/// count), read once per process into `once`, as [`switched_off`].
pub fn env_count(var: &str, once: &OnceLock<Option<usize>>) -> Option<usize> {
    *once.get_or_init(|| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
    })
}

/// The pointer arguments every decode kernel and merge share, checked.
struct DecodeArgs {
    /// The joined query's pointer (`None` for its parts, which only tensor maps read).
    q: Option<Arg>,
    cache: Arg,
    table: Arg,
    lens: Arg,
    /// The key lists and their row length (sparse kernels only).
    sparse: Option<[Arg; 2]>,
    /// [part_o, part_lse, out, lse] ([`SplitOutputs::args`]).
    outputs: [Arg; 4],
}

impl Decode<'_> {
    fn check(&self) -> Result<DecodeArgs> {
        let width = LATENT + ROPE;
        let (b, h, s) = (self.batch, self.heads, self.splits);
        // No sequences or heads would still launch one block (grids are at least 1), which
        // would read the lengths and q past their ends.
        if b == 0 || h == 0 || !(1..=MAX_SPLITS).contains(&s) {
            return Err(Error::invalid(format!(
                "MLA decode: {b} sequences, {h} heads (at least 1 each) and {s} splits (1 to {MAX_SPLITS})"
            )));
        }
        if !self.cache.len().is_multiple_of(PAGE * width) {
            return Err(Error::invalid(
                "MLA decode: the cache must be pages of 64 rows of 576",
            ));
        }
        // The kernels with page-index-overflow planted wrap their offsets at 4 GiB: only over a
        // larger pool does every wrapped address stay inside it.
        let bytes = self.cache.len() * self.cache.elem().size();
        if self.kernel.ends_with(crate::ops::PLANTED_OFFSET32) && bytes <= 1 << 32 {
            return Err(Error::invalid(format!(
                "{}: page-index-overflow is planted in it, and a cache of {bytes} bytes (at most \
                 4 GiB) would let its wrapped offsets fall outside",
                self.kernel
            )));
        }
        let pages = (self.cache.len() / (PAGE * width)) as i64;
        let table = prod(&[b, self.max_pages])?;
        let positions = (self.max_pages * PAGE) as i64;
        // Dense: lengths are token counts within the table; sparse: list lengths ≤ topk, whose
        // entries are positions within the table or -1.
        let len_limit = self.sparse.map_or(positions, |k| k.topk as i64);
        let sparse = match self.sparse {
            None => None,
            Some(k) => Some(key_list_args(k, b, positions)?),
        };
        if !self.block_table.values_within(table, 0, pages)
            || self.block_table.len() < table
            || !self.seq_lens.values_within(b, 0, len_limit + 1)
            || self.seq_lens.len() < b
        {
            return Err(Error::invalid(
                "MLA decode: the block table or the lengths are short, or not known to lie \
                 within the cache and the table",
            ));
        }
        let q = match self.q {
            DecodeQuery::Joined(q) => {
                Some(need("MLA decode q", q, prod(&[b, h, width])?, Elem::Bf16)?)
            }
            DecodeQuery::Parts { latent, rope } => {
                let rows = latent.len() / LATENT;
                let whole = rows * LATENT == latent.len() && rope.len() == rows * ROPE;
                if !whole
                    || rows > b * h
                    || !rows.is_multiple_of(h)
                    || !reads_query_by_tma(self.kernel)
                {
                    return Err(Error::invalid(format!(
                        "MLA decode: a query in parts of {} and {} values for {b} sequences of \
                         {h} heads ({} takes {})",
                        latent.len(),
                        rope.len(),
                        self.kernel,
                        match reads_query_by_tma(self.kernel) {
                            true => "whole rows of 512 and 64, at most a row per sequence and head",
                            false => "a joined query only",
                        }
                    )));
                }
                need("MLA decode q", latent, 0, Elem::Bf16)?;
                need("MLA decode q", rope, 0, Elem::Bf16)?;
                None
            }
        };
        Ok(DecodeArgs {
            q,
            cache: need("MLA decode cache", self.cache, 0, Elem::Bf16)?,
            table: Arg::Ptr(I32Ptr, self.block_table.ptr()),
            lens: Arg::Ptr(I32Ptr, self.seq_lens.ptr()),
            sparse,
            // Partials are written by a split launch that does not pair its splits.
            outputs: self.outputs.args((b, s, h), s > 1 && !self.pair_merge)?,
        })
    }
}

pub(super) fn int(v: usize, what: &str) -> Result<Arg> {
    i32::try_from(v)
        .map(Arg::I32)
        .map_err(|_| Error::invalid(format!("{what} {v} does not fit a kernel's int")))
}

impl Gpu {
    /// The tensor maps of a decode's query for the kernels that load it by TMA (the wgmma
    /// decodes, bf16 or FP8 cache): boxes of 64 rows (the MMAs') × 64 columns, eight of the
    /// latent part and one of the RoPE part (rows past the last come as zeros). `rows`: the
    /// rows of a joined query (sequences × heads); parts bring their own.
    pub(super) fn query_maps(&self, q: DecodeQuery, rows: usize) -> Result<[Arg; 2]> {
        let box_rows = HEAD_GROUP as u32;
        let width = LATENT + ROPE;
        let (latent, rope) = match q {
            DecodeQuery::Joined(q) => (
                self.tensor_map_rows(q, 0, [LATENT, rows], width, box_rows)?,
                self.tensor_map_rows(q, LATENT, [ROPE, rows], width, box_rows)?,
            ),
            DecodeQuery::Parts { latent, rope } => {
                let rows = latent.len() / LATENT;
                (
                    self.tensor_map_rows(latent, 0, [LATENT, rows], LATENT, box_rows)?,
                    self.tensor_map_rows(rope, 0, [ROPE, rows], ROPE, box_rows)?,
                )
            }
        };
        Ok([Arg::Map(latent), Arg::Map(rope)])
    }

    /// The decode kernel over every split (with one split it writes `out` and `lse` itself).
    pub fn mla_decode_splits(&self, d: &Decode) -> Result<Launched> {
        let a = d.check()?;
        // (signature, cache by TMA, sparse); the query by TMA: `reads_query_by_tma`.
        let (sig, tma, sparse) = [
            (&MLA_DECODE_WGMMA, true, false),
            (&MLA_DECODE_KT, true, false),
            (&MLA_SPARSE_WGMMA, false, true),
            (&MLA_DECODE_SPLIT_K, false, false),
            (&MLA_DECODE_TILED, false, false),
            (&MLA_SPARSE_SPLIT_K, false, true),
            (&MLA_SPARSE_TILED, false, true),
            (&MLA_SPARSE_FEW_HEADS, false, true),
        ]
        .into_iter()
        .find(|(s, ..)| s.matches(d.kernel))
        .ok_or_else(|| Error::invalid(format!("{} is no MLA decode kernel", d.kernel)))?;
        if sparse != a.sparse.is_some() {
            return Err(Error::invalid(format!(
                "{} takes {}key lists",
                d.kernel,
                if sparse { "" } else { "no " }
            )));
        }
        let q_tma = reads_query_by_tma(d.kernel);
        let mut args = Vec::with_capacity(15);
        let width = LATENT + ROPE;
        if tma {
            // Boxes of a tile's rows × 64 columns of the cache, in the 128-byte swizzle.
            let tile = super::variants::variant(d.kernel).map_or(32, |v| v.tile);
            args.push(Arg::Map(self.tensor_map_bf16(
                d.cache,
                &[width, d.cache.len() / width],
                tile as u32,
            )?));
        }
        if q_tma {
            args.extend(self.query_maps(d.q, d.batch * d.heads)?);
        }
        // The kernels that read the query by pointer take it joined (checked above).
        args.extend(a.q.filter(|_| !q_tma));
        args.extend([a.cache, a.table, int(d.max_pages, "pages")?]);
        args.extend(a.sparse.into_iter().flatten());
        let [part_o, part_lse, out, lse] = a.outputs;
        args.extend([
            a.lens,
            Arg::F32(d.scale_log2),
            part_o,
            part_lse,
            int(d.splits, "splits")?,
            int(d.heads, "heads")?,
            out,
            lse,
        ]);
        let (group, threads) = decode_block(d.kernel);
        let cfg = Launch {
            grid: (
                blocks("MLA decode", d.splits)?,
                blocks_yz("MLA decode", d.batch)?,
                blocks_yz("MLA decode", d.heads.div_ceil(group))?,
            ),
            block: threads,
            shared: d.shared,
        };
        static SPLIT_PDL_OFF: OnceLock<bool> = OnceLock::new();
        let dependent = SPLIT_WAITS_KERNELS.contains(&d.kernel)
            && !switched_off("MLADB_DECODE_SPLIT_PDL", &SPLIT_PDL_OFF);
        if d.pair_merge {
            if d.splits != 2 || !PAIR_MERGE_KERNELS.contains(&d.kernel) {
                return Err(Error::invalid(format!(
                    "{} with {} splits cannot merge its splits in clusters of two",
                    d.kernel, d.splits
                )));
            }
            // SAFETY: as below, except that block 1 of each cluster (split 1) writes its rows
            // into block 0's shared memory instead of partials, and block 0 writes `out` and
            // `lse` for the group's heads; the grid's x extent is the two splits. With
            // `dependent`, as the dependent launch below (the pair kernels wait too).
            return unsafe { self.launch_cluster(sig, d.kernel, cfg, &args, 2, dependent) };
        }
        if dependent {
            // SAFETY: as the plain launch below; the kernel reads and writes nothing before its
            // `wait_for_prior_kernel`.
            return unsafe { self.launch_dependent(sig, d.kernel, cfg, &args) };
        }
        // SAFETY: block (split, b, group) reads the group's heads of q of sequence b (the last
        // group's rows past `heads` are zeroed in shared memory, not read; the wgmma kernels'
        // TMA box reads the rows after them inside q, zeros past its end, and never writes
        // their results), pages
        // bt[b][0..⌈len_b/64⌉] of the cache (table entries in 0..pages, lengths ≤ max_pages·64:
        // the uploaded ranges) or, sparse, entries 0..len_b ≤ topk of row b of the key lists and
        // the pages bt[b][pos/64] of their positions pos ≥ 0 (all < max_pages·64), and writes
        // its split's partials (or out and lse) for those heads only; every extent checked in
        // `check`. A kernel with page-index-overflow planted reads row offsets taken modulo
        // 4 GiB, inside the cache because `check` wants it larger than 4 GiB.
        unsafe { self.launch_traced(sig, d.kernel, cfg, &args) }
    }
}

#[cfg(test)]
mod tests {
    use super::super::compile::{HOPPER_SOURCES, SOURCES};
    use super::super::signature::kernel_names;
    use super::SPLIT_WAITS_KERNELS;

    /// A split kernel launched as a dependent must wait for the kernel before it: each one
    /// listed is defined in a source that calls `wait_for_prior_kernel`.
    #[test]
    fn split_kernels_launched_as_dependents_wait_for_the_kernel_before() {
        for name in SPLIT_WAITS_KERNELS {
            let (file, src) = SOURCES
                .iter()
                .chain(HOPPER_SOURCES)
                .find(|(_, src)| kernel_names(src).iter().any(|n| n == name))
                .unwrap_or_else(|| panic!("{name} is defined in no kernel source"));
            assert!(
                src.contains("wait_for_prior_kernel();"),
                "{name} ({file}) never waits for the kernel before it"
            );
        }
    }
}
