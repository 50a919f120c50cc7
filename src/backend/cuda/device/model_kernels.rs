//! Typed launchers of the router (router.cu), the statistics pass (stats.cu) and the quantized
//! weights (dequant.cu). As in [`super::kernels`], every buffer is checked against what the
//! kernel will touch first.

use super::kernels::{
    blocks, blocks_yz, int, need, need_bytes, prod, size, DEQUANT, LINEAR_QUANT, ROUTE, STATS,
    STATS_JOBS, STATS_PARTIAL_WIDTH, STATS_RESULT_WIDTH,
};
use super::signature::Param::*;
use super::{grid_1d, Arg, DevBuf, DevBytes, DevF64, Elem, Gpu, Launch, StatsJobs};
use crate::error::{Error, Result};
use crate::gguf::GgmlType;

/// Shared memory the router may ask for without opting in.
const ROUTE_SHARED_MAX: usize = 48 << 10;

/// Up to this many elements a tensor's statistics take one block (32 a thread), which writes the
/// result itself: the multi-block pass's atomics, fences and last-block merge are round trips
/// that cost a small tensor more than its reads (a 64-value pass took 5.4 µs on the H200).
const STATS_ONE_BLOCK: usize = 256 * 32;

impl Gpu {
    /// MoE routing of `tokens` rows of router logits (storage type): per token, the top_k
    /// expert ids (as floats) then their weights, in `out` [tokens, 2·top_k]. One warp a token,
    /// its choices in shared memory.
    pub fn route(
        &self,
        logits: &DevBuf,
        bias: &DevBuf,
        moe: &crate::model::layout::MoeLayout,
        tokens: usize,
        out: &DevBuf,
    ) -> Result<()> {
        let (e, k, g) = (moe.n_routed_experts, moe.num_experts_per_tok, moe.n_group);
        if g == 0 || !e.is_multiple_of(g) || moe.topk_group > g || k > e {
            return Err(Error::invalid("route: experts not in equal groups"));
        }
        // choice and taken per expert, score and kept per group, in f32.
        let shared = 4 * (2 * e + 2 * g);
        if shared > ROUTE_SHARED_MAX {
            return Err(Error::invalid(format!(
                "route: {e} experts in {g} groups need {shared} bytes of shared memory (at most {ROUTE_SHARED_MAX})"
            )));
        }
        let elem = logits.elem();
        let args = [
            need("router logits", logits, prod(&[tokens, e])?, elem)?,
            need("router bias", bias, e, Elem::F32)?,
            size(tokens),
            int("experts", e)?,
            int("groups", g)?,
            int("groups kept", moe.topk_group)?,
            int("top-k", k)?,
            Arg::I32(moe.norm_topk_prob as i32),
            Arg::F32(moe.routed_scaling_factor as f32),
            need("routing", out, prod(&[tokens, 2 * k])?, Elem::F32)?,
        ];
        let launch = Launch {
            grid: (blocks("route", tokens)?, 1, 1),
            block: 32,
            shared: shared as u32,
        };
        // SAFETY: block t reads logits row t and bias, writes routing row t, and keeps its
        // 2·(experts + groups) floats in the shared memory launched with it; group g's experts
        // g·(e/g).. lie below e.
        unsafe { self.launch(&ROUTE, &format!("route_{}", elem.suffix()), launch, &args) }
    }

    /// Statistics of each of `bufs` (at most [`STATS_JOBS`]) into result row `first_row + i` of
    /// `results` (rows of [`STATS_RESULT_WIDTH`], as [`super::kernels::fresh_stats_rows`] made
    /// them or a launch left them), with `partials` as scratch (one row of
    /// [`STATS_PARTIAL_WIDTH`] per block). One launch: the blocks are shared out among the
    /// buffers, and each buffer's last block merges its rows.
    pub fn stats_many(
        &self,
        bufs: &[&DevBuf],
        partials: &DevF64,
        results: &DevF64,
        first_row: usize,
    ) -> Result<()> {
        if bufs.is_empty() || bufs.len() > STATS_JOBS {
            return Err(Error::invalid(format!(
                "statistics: {} tensors in one launch (1 to {STATS_JOBS})",
                bufs.len()
            )));
        }
        if (first_row + bufs.len()) * STATS_RESULT_WIDTH > results.len() {
            return Err(Error::invalid("statistics: no room for the results"));
        }
        let rows = partials.len() / STATS_PARTIAL_WIDTH;
        let mut jobs = StatsJobs::default();
        let mut first = 0usize;
        for (j, buf) in bufs.iter().enumerate() {
            let n = buf.len();
            // One block for a small tensor (its pass then needs no atomics or partials), else at
            // least 16 elements per thread (fewer rows for the last block to merge), and an
            // equal share of the partials' rows at most.
            let count = match n <= STATS_ONE_BLOCK {
                true => 1,
                false => n.div_ceil(256 * 16).clamp(1, (rows / STATS_JOBS).max(1)),
            };
            jobs.ptr[j] = buf.ptr();
            jobs.n[j] = n as u64;
            jobs.first_block[j] = first as u32;
            if buf.elem() == Elem::Bf16 {
                jobs.bf16_mask |= 1 << j;
            }
            first += count;
        }
        if first > rows {
            return Err(Error::invalid("statistics: no room for partials"));
        }
        jobs.first_block[bufs.len()] = first as u32;
        jobs.count = bufs.len() as u32;
        let args = [
            Arg::StatsJobs(jobs),
            Arg::Ptr(F64Ptr, partials.ptr()),
            Arg::Ptr(
                F64Ptr,
                results.ptr() + (first_row * STATS_RESULT_WIDTH * 8) as u64,
            ),
        ];
        let cfg = Launch {
            grid: (blocks("statistics", first)?, 1, 1),
            block: 256,
            shared: 0,
        };
        // SAFETY: block b writes partial row b < first <= rows; buffer j's last block reads its
        // rows and writes result row first_row + j and its counter, inside `results` (checked above); each
        // buffer is read over its own length.
        unsafe { self.launch(&STATS, STATS.pattern, cfg, &args) }
    }

    /// Decodes the blocks of a quantized weight of type `ty` into `n` values of `out`.
    pub fn dequant(
        &self,
        ty: GgmlType,
        blocks_buf: &DevBytes,
        out: &DevBuf,
        n: usize,
        fault: bool,
    ) -> Result<()> {
        let q = quant_kernel_name(ty)
            .ok_or_else(|| Error::invalid(format!("no dequantization kernel for {ty}")))?;
        let e = out.elem();
        let args = [
            need_bytes(
                "quantized blocks",
                blocks_buf,
                n.div_ceil(ty.block_size()) * ty.type_size(),
            )?,
            need("dequantized", out, n, e)?,
            size(n),
            Arg::I32(fault as i32),
        ];
        // SAFETY: value i reads block i / block_size, within the bytes checked above.
        unsafe {
            self.launch(
                &DEQUANT,
                &format!("dequant_{q}_{}", e.suffix()),
                grid_1d(n),
                &args,
            )
        }
    }

    /// y [n, rows] = x [n, k] · Wᵀ with W [rows, k] stored as blocks of `ty`, `row_bytes` a row.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_quant(
        &self,
        ty: GgmlType,
        x: &DevBuf,
        w: &DevBytes,
        y: &DevBuf,
        (n, k, rows): (usize, usize, usize),
        row_bytes: usize,
        fault: bool,
    ) -> Result<()> {
        let q = quant_kernel_name(ty)
            .ok_or_else(|| Error::invalid(format!("no quantized matmul kernel for {ty}")))?;
        if row_bytes < k.div_ceil(ty.block_size()) * ty.type_size() {
            return Err(Error::invalid(
                "quantized linear: rows shorter than their blocks",
            ));
        }
        let shared = u32::try_from(prod(&[k, 4])?)
            .ok()
            .filter(|&s| s as usize <= self.max_shared_per_block())
            .ok_or_else(|| Error::invalid("quantized linear: a row does not fit shared memory"))?;
        let e = y.elem();
        let args = [
            need("quantized linear x", x, prod(&[n, k])?, e)?,
            need_bytes("quantized weight", w, prod(&[rows, row_bytes])?)?,
            need("quantized linear y", y, prod(&[n, rows])?, e)?,
            size(n),
            size(k),
            size(rows),
            size(row_bytes),
            Arg::I32(fault as i32),
        ];
        let cfg = Launch {
            grid: (
                blocks("quantized linear", rows)?,
                blocks_yz("quantized linear", n.div_ceil(64))?,
                1,
            ),
            block: 256,
            shared,
        };
        // SAFETY: block (r, c) decodes weight row r (row_bytes, holding k values) into k floats of
        // shared memory and reads x rows of chunk c < ⌈n/64⌉; extents checked above.
        unsafe {
            self.launch(
                &LINEAR_QUANT,
                &format!("linear_{q}_{}", e.suffix()),
                cfg,
                &args,
            )
        }
    }
}

/// The name part of the dequantization kernels of a ggml type (kernels/dequant.cu).
pub fn quant_kernel_name(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q2_K => "q2_k",
        GgmlType::Q3_K => "q3_k",
        GgmlType::Q4_K => "q4_k",
        GgmlType::Q5_K => "q5_k",
        GgmlType::Q6_K => "q6_k",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        _ => return None,
    })
}
