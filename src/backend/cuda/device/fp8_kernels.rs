//! Typed launchers of the KV cache writes and the fp8_ds_mla latent cache's kernels: the plain
//! write (kernels/cache_write.cu: rows scattered to the slot mapping's rows), the FP8 write
//! (kernels/kv_fp8.cu), which quantizes rows into the 656-byte slots of a paged byte cache, and
//! the tensor-core decode
//! reading such a cache (`mla_decode_fp8_*` in mla_decode.cu, mla_decode_splitk.cu and
//! mla_decode_fp8*.cu), whose
//! splits the one merge of every decode joins (`Gpu::mla_decode_merge`). What a launch may touch
//! is checked here; the variant and split count are `cuda::fast_fp8`'s.

use super::fast_kernels::{
    decode_block, key_list_args, DecodeQuery, SparseKeys, SplitOutputs, LATENT, MAX_SPLITS, PAGE,
    ROPE,
};
use super::kernels::{blocks, blocks_yz, int, need, need_bytes, need_i32, prod, FILL_U32};
use super::signature::{Param::*, Sig};
use super::{grid_1d, Arg, DevBuf, DevBytes, DevI32, Elem, Gpu, Launch, Launched};
use crate::error::{Error, Result};
use crate::ops::kv_fp8::TOKEN_BYTES;

pub const KV_FP8_WRITE: Sig = Sig::new("kv_fp8_write_{e}", &[Storage, I32Ptr, U8Ptr, Int, Int]);
pub const KV_CACHE_WRITE: Sig =
    Sig::new("kv_cache_write_{e}", &[Storage, I32Ptr, Storage, Int, Int]);
pub const MLA_DECODE_FP8: Sig = Sig::new(
    "mla_decode_fp8_*",
    &[
        Bf16Ptr, U8Ptr, I32Ptr, Int, I32Ptr, Float, Bf16Ptr, F32Ptr, Int, Int, Bf16Ptr, F32Ptr,
    ],
);

/// The sparse forms of the few-heads kernels: the key lists (indices, topk) after the table.
pub const MLA_SPARSE_FP8: Sig = Sig::new(
    "mla_sparse_fp8_*",
    &[
        Bf16Ptr, U8Ptr, I32Ptr, Int, I32Ptr, Int, I32Ptr, Float, Bf16Ptr, F32Ptr, Int, Int,
        Bf16Ptr, F32Ptr,
    ],
);

/// The wgmma forms (Hopper, kernels/mla_decode_sm90.cu): the query's two tensor maps (its
/// latent and RoPE parts) in place of its pointer, then as the others.
pub const MLA_DECODE_WGMMA_FP8: Sig = Sig::new(
    "mla_decode_wgmma_fp8",
    &[
        Map, Map, U8Ptr, I32Ptr, Int, I32Ptr, Float, Bf16Ptr, F32Ptr, Int, Int, Bf16Ptr, F32Ptr,
    ],
);
pub const MLA_SPARSE_WGMMA_FP8: Sig = Sig::new(
    "mla_sparse_wgmma_fp8",
    &[
        Map, Map, U8Ptr, I32Ptr, Int, I32Ptr, Int, I32Ptr, Float, Bf16Ptr, F32Ptr, Int, Int,
        Bf16Ptr, F32Ptr,
    ],
);

/// Every launcher's declaration here (compared with the `.cu` signatures by a test).
pub const SIGNATURES: &[&Sig] = &[
    &KV_FP8_WRITE,
    &KV_CACHE_WRITE,
    &MLA_DECODE_FP8,
    &MLA_SPARSE_FP8,
    &MLA_DECODE_WGMMA_FP8,
    &MLA_SPARSE_WGMMA_FP8,
];

/// Whether an FP8-cache decode kernel reads the query by TMA (the wgmma forms).
fn wgmma_form(kernel: &str) -> bool {
    MLA_DECODE_WGMMA_FP8.matches(kernel) || MLA_SPARSE_WGMMA_FP8.matches(kernel)
}

impl Gpu {
    /// Fills a byte buffer with `byte` (its length a multiple of 4, as a byte cache's is).
    pub fn fill_bytes(&self, buf: &DevBytes, byte: u8) -> Result<()> {
        if !buf.len().is_multiple_of(4) {
            return Err(Error::invalid(
                "byte fill: a length that is not whole words",
            ));
        }
        let words = buf.len() / 4;
        let args = [
            Arg::Ptr(U32Ptr, buf.ptr()),
            Arg::U32(u32::from_le_bytes([byte; 4])),
            Arg::U64(words as u64),
        ];
        // SAFETY: the kernel writes words 0..len/4 of the buffer, which holds len bytes.
        unsafe { self.launch(&FILL_U32, FILL_U32.pattern, grid_1d(words), &args) }
    }

    /// Writes rows 0..n of `rows` ([n, width]) into the cache ([slots, width], same storage) at
    /// rows `slots[0..n]`: the slot mapping's scatter (kernels/cache_write.cu).
    pub fn kv_cache_write(
        &self,
        rows: &DevBuf,
        slots: &DevI32,
        cache: &DevBuf,
        n: usize,
        width: usize,
    ) -> Result<Launched> {
        let elem = cache.elem();
        if width == 0 || !cache.len().is_multiple_of(width) {
            return Err(Error::invalid(format!(
                "cache write: a cache of {} values is no whole number of rows of {width}",
                cache.len()
            )));
        }
        let slot_count = (cache.len() / width) as i64;
        let args = [
            need("cache write rows", rows, prod(&[n, width])?, elem)?,
            need_i32("cache write slots", slots, n, Some((0, slot_count)))?,
            need("cache write cache", cache, 0, elem)?,
            int("rows", n)?,
            int("width", width)?,
        ];
        let cfg = Launch {
            grid: (blocks("cache write", n.min(65_535))?, 1, 1),
            block: 128,
            shared: 0,
        };
        let name = format!("kv_cache_write_{}", elem.suffix());
        // SAFETY: block b reads rows b, b + grid, … < n of `rows` (n · width values of the cache's
        // storage, checked) and slots[row] (n values, each in 0..rows of the cache: the uploaded
        // range), and writes values slot·width .. slot·width + width of the cache.
        unsafe { self.launch_traced(&KV_CACHE_WRITE, &name, cfg, &args) }
    }

    /// Quantizes rows 0..n of `rows` ([n, 576], f32 or bf16) into slots `slots[0..n]` of the
    /// byte cache (slots of 656 bytes), with the codec faults `faults` (bit 0 fp8-scale-default,
    /// bit 1 fp8-amax-padded-rows).
    pub fn kv_fp8_write(
        &self,
        rows: &DevBuf,
        slots: &DevI32,
        cache: &DevBytes,
        n: usize,
        faults: u32,
    ) -> Result<Launched> {
        if !cache.len().is_multiple_of(TOKEN_BYTES) || faults > 3 {
            return Err(Error::invalid(format!(
                "fp8 cache write: a cache of {} bytes (whole slots of {TOKEN_BYTES}) and faults {faults} (0 to 3)",
                cache.len()
            )));
        }
        let slot_count = (cache.len() / TOKEN_BYTES) as i64;
        let elem = rows.elem();
        let args = [
            need(
                "fp8 cache write rows",
                rows,
                prod(&[n, LATENT + ROPE])?,
                elem,
            )?,
            need_i32("fp8 cache write slots", slots, n, Some((0, slot_count)))?,
            need_bytes("fp8 cache write cache", cache, 0)?,
            int("rows", n)?,
            Arg::I32(faults as i32),
        ];
        let cfg = Launch {
            grid: (blocks("fp8 cache write", n.min(65_535))?, 1, 1),
            block: 128,
            shared: 0,
        };
        let name = format!("kv_fp8_write_{}", elem.suffix());
        // SAFETY: block b reads rows b, b + grid, … < n of `rows` (n · 576 values, checked) and
        // slots[row] (n values, each in 0..slots of the cache: the uploaded range), and writes
        // bytes slot·656 .. slot·656 + 656 of the cache.
        unsafe { self.launch_traced(&KV_FP8_WRITE, &name, cfg, &args) }
    }
}

/// One decode launch over an fp8_ds_mla cache: `batch` sequences of one query token each.
pub struct Fp8Decode<'a> {
    /// A kernel of [`MLA_DECODE_FP8`] or [`MLA_DECODE_WGMMA_FP8`], or with `sparse` of
    /// [`MLA_SPARSE_FP8`] or [`MLA_SPARSE_WGMMA_FP8`].
    pub kernel: &'a str,
    pub shared: u32,
    pub batch: usize,
    /// At least 1: the grid has ⌈heads / rows⌉ groups, the rows of the kernel's variant (64 as
    /// the bf16 decode's; 16 or 8 for the few-heads kernels).
    pub heads: usize,
    pub max_pages: usize,
    pub splits: usize,
    /// q [batch, heads, 576] bf16.
    pub q: &'a DevBuf,
    /// [pages·64 · 656] bytes.
    pub cache: &'a DevBytes,
    /// [batch, max_pages] page numbers and [batch] lengths (with `sparse`: of the key lists).
    pub block_table: &'a DevI32,
    pub seq_lens: &'a DevI32,
    /// The key lists of a sparse kernel ([`MLA_SPARSE_FP8`]); `None` for the dense ones.
    pub sparse: Option<SparseKeys<'a>>,
    pub scale_log2: f32,
    pub outputs: SplitOutputs<'a>,
}

/// The checked pointers of a launch: q, cache, table, lens, part_o, part_lse, out, lse, and
/// the key lists with their row length when sparse.
type Fp8Args = ([Arg; 8], Option<[Arg; 2]>);

impl Fp8Decode<'_> {
    fn check(&self) -> Result<Fp8Args> {
        let (b, h, s) = (self.batch, self.heads, self.splits);
        if b == 0 || h == 0 || !(1..=MAX_SPLITS).contains(&s) {
            return Err(Error::invalid(format!(
                "MLA decode (fp8 cache): {b} sequences, {h} heads (at least 1 each) and {s} splits (1 to {MAX_SPLITS})"
            )));
        }
        if !self.cache.len().is_multiple_of(PAGE * TOKEN_BYTES) {
            return Err(Error::invalid(
                "MLA decode (fp8 cache): the cache must be pages of 64 slots of 656 bytes",
            ));
        }
        let pages = (self.cache.len() / (PAGE * TOKEN_BYTES)) as i64;
        let table = prod(&[b, self.max_pages])?;
        let positions = (self.max_pages * PAGE) as i64;
        // Dense: lengths are token counts within the table; sparse: list lengths ≤ topk, whose
        // entries are positions within the table or -1.
        let longest = self.sparse.map_or(positions, |k| k.topk as i64) + 1;
        let sparse = match self.sparse {
            None => None,
            Some(k) => Some(key_list_args(k, b, positions)?),
        };
        if sparse.is_some() != self.kernel.starts_with("mla_sparse_") {
            return Err(Error::invalid(format!(
                "{} takes {}key lists",
                self.kernel,
                if sparse.is_some() { "no " } else { "" }
            )));
        }
        let [part_o, part_lse, out, lse] = self.outputs.args((b, s, h), s > 1)?;
        let dense = [
            need(
                "MLA decode q",
                self.q,
                prod(&[b, h, LATENT + ROPE])?,
                Elem::Bf16,
            )?,
            need_bytes("MLA decode cache", self.cache, 0)?,
            need_i32(
                "MLA decode block table",
                self.block_table,
                table,
                Some((0, pages)),
            )?,
            need_i32("MLA decode lengths", self.seq_lens, b, Some((0, longest)))?,
            part_o,
            part_lse,
            out,
            lse,
        ];
        Ok((dense, sparse))
    }
}

impl Gpu {
    /// The decode kernel over every split of an fp8_ds_mla cache (one split: it writes `out` and
    /// `lse` itself).
    pub fn mla_decode_fp8_splits(&self, d: &Fp8Decode) -> Result<Launched> {
        let ([q, cache, table, lens, part_o, part_lse, out, lse], sparse) = d.check()?;
        let mut args = Vec::with_capacity(15);
        if wgmma_form(d.kernel) {
            args.extend(self.query_maps(DecodeQuery::Joined(d.q), d.batch * d.heads)?);
        } else {
            args.push(q);
        }
        args.extend([cache, table, int("pages", d.max_pages)?]);
        args.extend(sparse.into_iter().flatten());
        args.extend([
            lens,
            Arg::F32(d.scale_log2),
            part_o,
            part_lse,
            int("splits", d.splits)?,
            int("heads", d.heads)?,
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
        let sig = match (d.sparse.is_some(), wgmma_form(d.kernel)) {
            (true, false) => &MLA_SPARSE_FP8,
            (false, false) => &MLA_DECODE_FP8,
            (true, true) => &MLA_SPARSE_WGMMA_FP8,
            (false, true) => &MLA_DECODE_WGMMA_FP8,
        };
        // SAFETY: as the bf16 decode's: block (split, b, group) reads its heads of q, the slots
        // of pages bt[b][0..⌈len_b/64⌉] (table entries in 0..pages, lengths ≤ max_pages·64: the
        // uploaded ranges) or, sparse, entries 0..len_b ≤ topk of row b of the key lists and the
        // slots bt[b][pos/64]·64 + pos%64 of their positions pos ≥ 0 (< max_pages·64), 656
        // bytes each, and writes its split's partials (or out and lse) for those heads only;
        // every extent checked in `check`. The wgmma forms read q through its tensor maps,
        // made here over the checked [batch·heads, 576] rows (zeros past the last).
        unsafe { self.launch_traced(sig, d.kernel, cfg, &args) }
    }
}
