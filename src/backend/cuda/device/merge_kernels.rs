//! Typed launchers of the split decode's merge kernels (kernels/mla_decode.cu), run after a split
//! kernel; which one runs is `cuda::fast`'s choice.

use super::fast_kernels::{int, LATENT, MAX_SPLITS};
use super::kernels::{blocks, blocks_yz, need, prod};
use super::signature::{Param::*, Sig};
use super::{Arg, DevBuf, Elem, Gpu, Launch, Launched};
use crate::error::{Error, Result};

pub const MLA_DECODE_COMBINE: Sig = Sig::new(
    "mla_decode_combine",
    &[Bf16Ptr, F32Ptr, Bf16Ptr, F32Ptr, Int, Int, Int],
);
pub const MLA_DECODE_COMBINE_ROWS: Sig = Sig::new(
    "mla_decode_combine_rows",
    &[Bf16Ptr, F32Ptr, Bf16Ptr, F32Ptr, Int, Int, Int, Int],
);
/// Every launcher's declaration here (compared with the `.cu` signatures by a test).
pub const SIGNATURES: &[&Sig] = &[&MLA_DECODE_COMBINE, &MLA_DECODE_COMBINE_ROWS];

/// The most splits the per-row merge takes (a split per lane).
pub const COMBINE_ROWS_MAX: usize = 32;

/// Where a split decode writes (any decode: bf16, sparse or FP8 cache, and its merge): each
/// split's partials and the merged result.
#[derive(Clone, Copy)]
pub struct SplitOutputs<'a> {
    /// [batch, splits, heads, 512] bf16 and [batch, splits, heads] f32 (natural log-sum-exps):
    /// each split's normalised output, which the merge reads.
    pub part_o: &'a DevBuf,
    pub part_lse: &'a DevBuf,
    /// [batch, heads, 512] bf16 and [batch, heads] f32: the merged result.
    pub out: &'a DevBuf,
    pub lse: &'a DevBuf,
}

impl SplitOutputs<'_> {
    /// The four pointers [part_o, part_lse, out, lse] of a launch over `batch` sequences,
    /// `splits` and `heads`, each checked to hold what it touches; `partials`: whether the
    /// launch touches the partials (a launch that writes its result itself may pass empty ones).
    pub(super) fn args(
        &self,
        (b, s, h): (usize, usize, usize),
        partials: bool,
    ) -> Result<[Arg; 4]> {
        let touched = |dims: &[usize]| if partials { prod(dims) } else { Ok(0) };
        Ok([
            need(
                "MLA decode workspace",
                self.part_o,
                touched(&[b, s, h, LATENT])?,
                Elem::Bf16,
            )?,
            need(
                "MLA decode workspace",
                self.part_lse,
                touched(&[b, s, h])?,
                Elem::F32,
            )?,
            need(
                "MLA decode out",
                self.out,
                prod(&[b, h, LATENT])?,
                Elem::Bf16,
            )?,
            need("MLA decode lse", self.lse, prod(&[b, h])?, Elem::F32)?,
        ])
    }
}

/// A split decode's merge: the partials it reads, the output it writes.
pub struct Merge<'a> {
    pub batch: usize,
    pub heads: usize,
    pub splits: usize,
    pub outputs: SplitOutputs<'a>,
    pub faults: MergeFaults,
}

/// The faults the debugger plants in the split merges (kernels/mla_decode.cu, `FAULT_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MergeFaults {
    /// lse-base-mismatch: the splits' natural-log LSEs weighed as base 2.
    pub lse_base: bool,
    /// skip-padded-rows: rows with no keys in any split (a batch's zero-length padding)
    /// left unwritten.
    pub skip_empty_rows: bool,
}

impl MergeFaults {
    pub fn any(self) -> bool {
        self.lse_base || self.skip_empty_rows
    }

    fn bits(self) -> Arg {
        Arg::I32(i32::from(self.lse_base) | (i32::from(self.skip_empty_rows) << 1))
    }
}

impl Gpu {
    /// Merges a split decode's partials (any decode: bf16, sparse or FP8 cache) into `out` and
    /// `lse`: a warp per (sequence, head) when `per_row` (at most 32 splits), else a block per
    /// (sequence, head, quarter of the dims).
    pub fn mla_decode_merge(&self, m: &Merge, per_row: bool) -> Result<Launched> {
        let (b, h, s) = (m.batch, m.heads, m.splits);
        if b == 0 || h == 0 || !(1..=MAX_SPLITS).contains(&s) {
            return Err(Error::invalid(format!(
                "MLA decode merge: {b} sequences, {h} heads, {s} splits (1 to {MAX_SPLITS})"
            )));
        }
        let mut args = m.outputs.args((b, s, h), true)?.to_vec();
        args.extend([int(s, "splits")?, int(h, "heads")?]);
        let rows = prod(&[b, h])?;
        if per_row {
            if s > COMBINE_ROWS_MAX {
                return Err(Error::invalid(
                    "MLA decode: the per-row merge takes 32 splits",
                ));
            }
            args.push(int(rows, "rows")?);
            args.push(m.faults.bits());
            let cfg = Launch {
                grid: (blocks("MLA decode merge", rows.div_ceil(8))?, 1, 1),
                block: 256,
                shared: 0,
            };
            let sig = &MLA_DECODE_COMBINE_ROWS;
            // SAFETY: warp w of block x merges row 8x + w < rows (the kernel returns past it),
            // reading its ≤ 32 splits; extents checked above.
            return unsafe { self.launch_dependent(sig, sig.pattern, cfg, &args) };
        }
        args.push(m.faults.bits());
        let cfg = Launch {
            grid: (
                blocks("MLA decode merge", b)?,
                blocks_yz("MLA decode merge", h)?,
                (LATENT / 128) as u32,
            ),
            block: 256,
            shared: 0,
        };
        let sig = &MLA_DECODE_COMBINE;
        // SAFETY: block (b, h, quarter) reads the ≤ 256 splits of (b, h) (the kernel's shared
        // array holds 256) and writes a quarter of out row (b, h); extents checked above. Both
        // merges wait for the split kernel before they read its partials.
        unsafe { self.launch_dependent(sig, sig.pattern, cfg, &args) }
    }
}
