//! Typed launchers of the MLA kernels the debugger runs (mla.cu, attention.cu, indexer.cu): the
//! kv_b_proj projections, K/V assembly, both attention paths and the DSA indexer. As in
//! [`super::kernels`], every buffer is checked against what the kernel will touch first.

use super::kernels::{
    blocks, blocks_yz, name, need, need_bytes, need_i32, prod, size, ABSORB_QUERY, APPLY_W_UV,
    ASSEMBLE_KV, ATTN_LATENT_MERGE, ATTN_LATENT_PARTIAL, ATTN_NAIVE, INDEX_SCORES, TOPK_SELECT,
};
use super::signature::Param::*;
use super::{grid_1d, Arg, DevBuf, DevBytes, DevI32, Elem, Gpu, Launch};
use crate::error::{Error, Result};

/// Threads of one attention block (a block per query and head).
const ATTN_THREADS: u32 = 128;
/// Keys per split of the latent attention (attention.cu's SPLIT).
pub const SPLIT_KV_BLOCK: usize = 8;
/// Rows per page of a paged cache (attention.cu's PAGE).
const PAGE: usize = crate::ops::PAGE_SIZE;

/// The pieces of one latent-attention launch (see [`Gpu::attn_latent`]).
pub struct LatentAttention<'a> {
    pub q_lat: &'a DevBuf,
    pub q_pe: &'a DevBuf,
    /// Rows of L + R, in pages of 64 reached through `block_table`.
    pub cache: &'a DevBuf,
    pub block_table: &'a DevI32,
    pub positions: &'a DevI32,
    /// [n, context] bytes, 1 where the query may see the key; causal when absent.
    pub mask: Option<&'a DevBytes>,
    pub out: &'a DevBuf,
    /// [heads, n, context] f32.
    pub probs: &'a DevBuf,
    pub n: usize,
    pub heads: usize,
    pub latent: usize,
    pub rope: usize,
    pub context: usize,
    pub scale: f32,
    pub lse_base_mismatch: bool,
    pub skip_padded_rows: bool,
}

/// The pieces of one naive-attention launch (see [`Gpu::attn_naive`]).
pub struct NaiveAttention<'a> {
    pub q: &'a DevBuf,
    pub k: &'a DevBuf,
    pub v: &'a DevBuf,
    pub positions: &'a DevI32,
    pub mask: Option<&'a DevBytes>,
    pub out: &'a DevBuf,
    pub probs: &'a DevBuf,
    pub n: usize,
    pub heads: usize,
    /// q·k width per head.
    pub d: usize,
    /// v width per head.
    pub dv: usize,
    pub context: usize,
    pub scale: f32,
    pub skip_padded_rows: bool,
}

impl Gpu {
    /// absorb_query (`apply` false: x [n, heads, P] → out [n, heads, L] through W_UK at row
    /// `w_row` of each head's block) or apply_w_uv (`apply` true: x [n, heads, L] → out
    /// [n, heads, V] through W_UV); `w` is kv_b_proj [heads·(P+V), L].
    #[allow(clippy::too_many_arguments)]
    pub fn kv_b_projection(
        &self,
        apply: bool,
        x: &DevBuf,
        w: &DevBuf,
        out: &DevBuf,
        (n, heads, nope, v, latent): (usize, usize, usize, usize, usize),
        w_row: usize,
    ) -> Result<()> {
        let (sig, base, x_width, out_width, rows) = if apply {
            (&APPLY_W_UV, "apply_w_uv", latent, v, v)
        } else {
            (&ABSORB_QUERY, "absorb_query", nope, latent, nope)
        };
        if w_row + rows > nope + v {
            return Err(Error::invalid(format!(
                "{base}: rows {w_row}..{} of a {}-row head block",
                w_row + rows,
                nope + v
            )));
        }
        let e = out.elem();
        let total = prod(&[n, heads, out_width])?;
        let args = [
            need(base, x, prod(&[n, heads, x_width])?, e)?,
            need(base, w, prod(&[heads, nope + v, latent])?, e)?,
            need(base, out, total, e)?,
            size(n),
            size(heads),
            size(nope),
            size(v),
            size(latent),
            size(w_row),
        ];
        // apply_w_uv runs a warp per output, absorb_query a thread.
        let threads = if apply { prod(&[total, 32])? } else { total };
        // SAFETY: x, w and out over the extents checked above; the weight rows read are
        // h·(P+V) + w_row + (0..rows) with w_row + rows ≤ P+V.
        unsafe { self.launch(sig, &name(base, e), grid_1d(threads), &args) }
    }

    /// kv [n, heads·(P+V)] and k_pe [n, R] → k [n, heads·(P+R)] and v [n, heads·V].
    #[allow(clippy::too_many_arguments)]
    pub fn assemble_kv(
        &self,
        kv: &DevBuf,
        k_pe: &DevBuf,
        k: &DevBuf,
        v: &DevBuf,
        (n, heads, nope, rope, vd): (usize, usize, usize, usize, usize),
    ) -> Result<()> {
        let e = k.elem();
        let total = prod(&[n, heads, nope + rope + vd])?;
        let args = [
            need("assemble_kv", kv, prod(&[n, heads, nope + vd])?, e)?,
            need("assemble_kv k_pe", k_pe, prod(&[n, rope])?, e)?,
            need("assemble_kv", k, prod(&[n, heads, nope + rope])?, e)?,
            need("assemble_kv", v, prod(&[n, heads, vd])?, e)?,
            size(n),
            size(heads),
            size(nope),
            size(rope),
            size(vd),
        ];
        // SAFETY: every buffer over the extent checked above.
        unsafe { self.launch(&ASSEMBLE_KV, &name("assemble_kv", e), grid_1d(total), &args) }
    }

    /// Attention over per-head K/V rows: one block per (query, head).
    pub fn attn_naive(&self, a: &NaiveAttention) -> Result<()> {
        let e = a.out.elem();
        let (n, h, ctx) = (a.n, a.heads, a.context);
        let args = [
            need("attention q", a.q, prod(&[n, h, a.d])?, e)?,
            need("attention k", a.k, prod(&[ctx, h, a.d])?, e)?,
            need("attention v", a.v, prod(&[ctx, h, a.dv])?, e)?,
            need_i32("attention positions", a.positions, n, None)?,
            match a.mask {
                Some(m) => need_bytes("attention mask", m, prod(&[n, ctx])?)?,
                None => Arg::Ptr(U8Ptr, 0),
            },
            need("attention out", a.out, prod(&[n, h, a.dv])?, e)?,
            need(
                "attention probabilities",
                a.probs,
                prod(&[h, n, ctx])?,
                Elem::F32,
            )?,
            size(n),
            size(h),
            size(a.d),
            size(a.dv),
            size(ctx),
            Arg::F32(a.scale),
            Arg::I32(a.skip_padded_rows as i32),
        ];
        let cfg = Launch {
            grid: (blocks("attention", prod(&[n, h])?)?, 1, 1),
            block: ATTN_THREADS,
            shared: 0,
        };
        // SAFETY: keys j < context only; every extent checked above; positions are compared,
        // never used as indices; a null mask means causal.
        unsafe { self.launch(&ATTN_NAIVE, &name("attn_naive", e), cfg, &args) }
    }

    /// Absorbed attention over the paged latent cache: split-KV partials, then their merge.
    pub fn attn_latent(&self, a: &LatentAttention) -> Result<()> {
        let e = a.out.elem();
        let (n, h, l, r, ctx) = (a.n, a.heads, a.latent, a.rope, a.context);
        let splits = ctx.div_ceil(SPLIT_KV_BLOCK).max(1);
        let pages = a.cache.len() / prod(&[l + r, PAGE])?.max(1);
        let acc = self.alloc(prod(&[n, h, splits, l])?, Elem::F32)?;
        let maxes = self.alloc(prod(&[n, h, splits])?, Elem::F32)?;
        let sums = self.alloc(prod(&[n, h, splits])?, Elem::F32)?;
        let mask = match a.mask {
            Some(m) => need_bytes("attention mask", m, prod(&[n, ctx])?)?,
            None => Arg::Ptr(U8Ptr, 0),
        };
        let positions = need_i32("attention positions", a.positions, n, None)?;
        let probs = need(
            "attention probabilities",
            a.probs,
            prod(&[h, n, ctx])?,
            Elem::F32,
        )?;
        let acc_arg = need("latent partials", &acc, acc.len(), Elem::F32)?;
        let max_arg = need("latent maxima", &maxes, maxes.len(), Elem::F32)?;
        let sum_arg = need("latent sums", &sums, sums.len(), Elem::F32)?;
        let partial = [
            need("attention q_lat", a.q_lat, prod(&[n, h, l])?, e)?,
            need("attention q_pe", a.q_pe, prod(&[n, h, r])?, e)?,
            need("latent cache", a.cache, 0, e)?,
            need_i32(
                "block table",
                a.block_table,
                ctx.div_ceil(PAGE),
                Some((0, pages as i64)),
            )?,
            positions,
            mask,
            acc_arg,
            max_arg,
            sum_arg,
            probs,
            size(n),
            size(h),
            size(l),
            size(r),
            size(ctx),
            size(splits),
            Arg::F32(a.scale),
            Arg::I32(a.skip_padded_rows as i32),
        ];
        let cfg = Launch {
            grid: (
                blocks("attention", prod(&[n, h])?)?,
                blocks_yz("attention", splits)?,
                1,
            ),
            block: 64,
            shared: 0,
        };
        // SAFETY: keys j < context only, each at cache row bt[j/64]·64 + j%64 with bt's first
        // ⌈context/64⌉ entries in 0..pages (the uploaded range), so within the cache; partials
        // of n·heads·splits rows allocated above; the rest checked above.
        unsafe {
            self.launch(
                &ATTN_LATENT_PARTIAL,
                &name("attn_latent_partial", e),
                cfg,
                &partial,
            )?
        };
        let merge = [
            acc_arg,
            max_arg,
            sum_arg,
            positions,
            mask,
            need("attention out", a.out, prod(&[n, h, l])?, e)?,
            probs,
            size(n),
            size(h),
            size(l),
            size(ctx),
            size(splits),
            Arg::I32(a.lse_base_mismatch as i32),
            Arg::I32(a.skip_padded_rows as i32),
        ];
        let shared =
            u32::try_from(splits * 4).map_err(|_| Error::invalid("attention: too many splits"))?;
        let cfg = Launch {
            grid: (blocks("attention", prod(&[n, h])?)?, 1, 1),
            block: ATTN_THREADS,
            shared,
        };
        // SAFETY: the same extents; the kernel's shared array holds one float per split. The
        // partials live until the merge has run (drops are ordered on the stream).
        unsafe {
            self.launch(
                &ATTN_LATENT_MERGE,
                &name("attn_latent_merge", e),
                cfg,
                &merge,
            )
        }
    }

    /// DSA indexer scores: q [n, heads, d], w [n, heads], keys [context, d] → out f32 [n, context].
    #[allow(clippy::too_many_arguments)]
    pub fn index_scores(
        &self,
        q: &DevBuf,
        weights: &DevBuf,
        keys: &DevBuf,
        positions: &DevI32,
        out: &DevBuf,
        (n, heads, d, context): (usize, usize, usize, usize),
        scale: f32,
    ) -> Result<()> {
        let e = q.elem();
        let total = prod(&[n, context])?;
        let args = [
            need("index q", q, prod(&[n, heads, d])?, e)?,
            need("index weights", weights, prod(&[n, heads])?, e)?,
            need("index keys", keys, prod(&[context, d])?, e)?,
            need_i32("index positions", positions, n, None)?,
            need("index scores", out, total, Elem::F32)?,
            size(n),
            size(heads),
            size(d),
            size(context),
            Arg::F32(scale),
        ];
        // SAFETY: every extent checked above; positions are only compared. A warp per score.
        unsafe {
            self.launch(
                &INDEX_SCORES,
                &name("index_scores", e),
                grid_1d(prod(&[total, 32])?),
                &args,
            )
        }
    }

    /// DSA top-k: one block per row of `scores` f32 [n, context]; flags [n, context] bytes.
    pub fn topk_select(
        &self,
        scores: &DevBuf,
        positions: &DevI32,
        selected: &DevBytes,
        (n, context): (usize, usize),
        k: usize,
    ) -> Result<()> {
        let total = prod(&[n, context])?;
        let args = [
            need("top-k scores", scores, total, Elem::F32)?,
            need_i32("top-k positions", positions, n, None)?,
            need_bytes("top-k flags", selected, total)?,
            size(context),
            size(k),
        ];
        let cfg = Launch {
            grid: (blocks("top-k", n)?, 1, 1),
            block: 256,
            shared: 0,
        };
        // SAFETY: block t reads and writes row t of n; a position only bounds the row (clamped
        // to the context).
        unsafe { self.launch(&TOPK_SELECT, TOPK_SELECT.pattern, cfg, &args) }
    }
}
