//! One typed launcher per kernel of the debugger (elementwise.cu, norm.cu, rope.cu, mla.cu,
//! attention.cu, indexer.cu, router.cu, stats.cu, dequant.cu). Each checks every buffer against
//! the extent the kernel will index given the sizes it is passed (and the indices it will read
//! from device memory against the range they were uploaded with), then launches the kernel with
//! exactly the parameters of [`SIGNATURES`].

use super::signature::{Param::*, Sig};
use super::{grid_1d, Arg, DevBuf, DevBytes, DevI32, Elem, Gpu, Launch};
use crate::error::{Error, Result};
use crate::model::weights::Recipe;

pub const FILL_U32: Sig = Sig::new("fill_u32", &[U32Ptr, U32, U64]);
pub const FILL_U16: Sig = Sig::new("fill_u16", &[U16Ptr, U32, U64]);
pub const FILL_RANDOM: Sig = Sig::new("fill_random_{e}", &[Storage, U64, Float, U64]);
pub const SYNTHETIC_FILL: Sig = Sig::new(
    "synthetic_fill_{e}",
    &[Storage, U64, U64, Float, Float, U64],
);
pub const ADD: Sig = Sig::new("add_{e}", &[Storage, Storage, Storage, U64]);
/// The few-rows linear layer (gemv.cu): one token, and up to [`super::blas::GEMV_TOKENS`].
pub const GEMV1: Sig = Sig::new(
    "gemv1_{e}",
    &[Storage, Storage, Storage, U64, U64, U64, U64],
);
pub const GEMV8: Sig = Sig::new(
    "gemv8_{e}",
    &[Storage, Storage, Storage, U64, U64, U64, U64],
);
pub const SILU_MUL: Sig = Sig::new("silu_mul_{e}", &[Storage, Storage, Storage, U64]);
pub const SCALE: Sig = Sig::new("scale_{e}", &[Storage, Float, Storage, U64]);
pub const ADD_BIAS: Sig = Sig::new("add_bias_{e}", &[Storage, Storage, U64, U64]);
pub const SLICE_GROUPS: Sig = Sig::new(
    "slice_groups_{e}",
    &[Storage, Storage, U64, U64, U64, U64, U64],
);
pub const CONCAT_GROUPS: Sig = Sig::new(
    "concat_groups_{e}",
    &[Storage, Storage, Storage, U64, U64, U64],
);
pub const GATHER_ROWS: Sig = Sig::new("gather_rows_{e}", &[Storage, I32Ptr, Storage, U64, U64]);
pub const REPEAT_ROWS_I32: Sig = Sig::new("repeat_rows_i32", &[I32Ptr, I32Ptr, U64, U64]);
pub const SCATTER_ADD_ROWS: Sig = Sig::new(
    "scatter_add_rows_{e}",
    &[Storage, I32Ptr, Storage, F32Ptr, U64, U64],
);
pub const RMSNORM: Sig = Sig::new("rmsnorm_{e}", &[Storage, Storage, Storage, U64, Float]);
pub const LAYERNORM: Sig = Sig::new(
    "layernorm_{e}",
    &[Storage, Storage, Storage, Storage, U64, Float],
);
pub const ROPE: Sig = Sig::new(
    "rope_{e}",
    &[
        Storage, Storage, U64, U64, U64, U64, I32Ptr, F32Ptr, Float, Int,
    ],
);
const KV_B: [super::signature::Param; 9] =
    [Storage, Storage, Storage, U64, U64, U64, U64, U64, U64];
pub const ABSORB_QUERY: Sig = Sig::new("absorb_query_{e}", &KV_B);
pub const APPLY_W_UV: Sig = Sig::new("apply_w_uv_{e}", &KV_B);
pub const ASSEMBLE_KV: Sig = Sig::new(
    "assemble_kv_{e}",
    &[Storage, Storage, Storage, Storage, U64, U64, U64, U64, U64],
);
pub const ATTN_NAIVE: Sig = Sig::new(
    "attn_naive_{e}",
    &[
        Storage, Storage, Storage, I32Ptr, U8Ptr, Storage, F32Ptr, U64, U64, U64, U64, U64, Float,
        Int,
    ],
);
pub const ATTN_LATENT_PARTIAL: Sig = Sig::new(
    "attn_latent_partial_{e}",
    &[
        Storage, Storage, Storage, I32Ptr, I32Ptr, U8Ptr, F32Ptr, F32Ptr, F32Ptr, F32Ptr, U64, U64,
        U64, U64, U64, U64, Float, Int,
    ],
);
pub const ATTN_LATENT_MERGE: Sig = Sig::new(
    "attn_latent_merge_{e}",
    &[
        F32Ptr, F32Ptr, F32Ptr, I32Ptr, U8Ptr, Storage, F32Ptr, U64, U64, U64, U64, U64, Int, Int,
    ],
);
pub const INDEX_SCORES: Sig = Sig::new(
    "index_scores_{e}",
    &[
        Storage, Storage, Storage, I32Ptr, F32Ptr, U64, U64, U64, U64, Float,
    ],
);
pub const TOPK_SELECT: Sig = Sig::new("topk_select", &[F32Ptr, I32Ptr, U8Ptr, U64, U64]);
pub const ROUTE: Sig = Sig::new(
    "route_{e}",
    &[Storage, F32Ptr, U64, Int, Int, Int, Int, Int, Float, F32Ptr],
);
pub const STATS: Sig = Sig::new("stats_many", &[Jobs, F64Ptr, F64Ptr]);
pub const DEQUANT: Sig = Sig::new("dequant_*", &[U8Ptr, Storage, U64, Int]);
pub const LINEAR_QUANT: Sig = Sig::new(
    "linear_*",
    &[Storage, U8Ptr, Storage, U64, U64, U64, U64, Int],
);

/// Every launcher's declaration (compared with the `.cu` signatures by a test).
pub const SIGNATURES: &[&Sig] = &[
    &FILL_U32,
    &FILL_U16,
    &FILL_RANDOM,
    &SYNTHETIC_FILL,
    &ADD,
    &GEMV1,
    &GEMV8,
    &SILU_MUL,
    &SCALE,
    &ADD_BIAS,
    &SLICE_GROUPS,
    &CONCAT_GROUPS,
    &GATHER_ROWS,
    &REPEAT_ROWS_I32,
    &SCATTER_ADD_ROWS,
    &RMSNORM,
    &LAYERNORM,
    &ROPE,
    &ABSORB_QUERY,
    &APPLY_W_UV,
    &ASSEMBLE_KV,
    &ATTN_NAIVE,
    &ATTN_LATENT_PARTIAL,
    &ATTN_LATENT_MERGE,
    &INDEX_SCORES,
    &TOPK_SELECT,
    &ROUTE,
    &STATS,
    &DEQUANT,
    &LINEAR_QUANT,
];

/// Tensors of one statistics launch at most (stats.cu's STATS_JOBS).
pub const STATS_JOBS: usize = 16;

/// Values per row of the statistics partials (stats.cu's STATS).
pub const STATS_WIDTH: usize = 11;

/// Doubles per result row of the statistics pass (stats.cu's StatsRow): the statistics, then the
/// accumulator of the launch in flight (9 doubles' room; identity between launches).
pub const STATS_RESULT_WIDTH: usize = STATS_WIDTH + 9;

/// Doubles per block of the statistics pass's partials (its two sums).
pub const STATS_PARTIAL_WIDTH: usize = 2;

/// A result row as the kernel expects it between launches: its accumulator at identity (the
/// minimum's key at i32::MAX, the maximum's at i32::MIN, both in the first double after the
/// statistics; everything else zero).
pub fn fresh_stats_rows(rows: usize) -> Vec<f64> {
    let mut row = [0.0f64; STATS_RESULT_WIDTH];
    row[STATS_WIDTH] = f64::from_bits((i32::MIN as u32 as u64) << 32 | i32::MAX as u32 as u64);
    row.repeat(rows)
}

/// a · b · …, or an error when it overflows.
pub(super) fn prod(factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| Error::invalid(format!("kernel sizes {factors:?} overflow")))
}

/// `buf` holds at least `len` values of `elem`.
pub(super) fn need(what: &str, buf: &DevBuf, len: usize, elem: Elem) -> Result<Arg> {
    if buf.elem() != elem || buf.len() < len {
        return Err(Error::invalid(format!(
            "{what}: a {} buffer of {} elements where {len} {} elements are read or written",
            buf.elem().suffix(),
            buf.len(),
            elem.suffix()
        )));
    }
    Ok(Arg::Ptr(
        match elem {
            Elem::F32 => F32Ptr,
            Elem::Bf16 => Bf16Ptr,
        },
        buf.ptr(),
    ))
}

/// `buf` holds at least `len` i32 values, each (of the first `len`) in lo..hi when `range` is set.
pub(super) fn need_i32(
    what: &str,
    buf: &DevI32,
    len: usize,
    range: Option<(i64, i64)>,
) -> Result<Arg> {
    if buf.len() < len {
        return Err(Error::invalid(format!(
            "{what}: {} values where {len} are read",
            buf.len()
        )));
    }
    if let Some((lo, hi)) = range {
        if !buf.values_within(len, lo, hi) {
            return Err(Error::invalid(format!(
                "{what}: indices not known to lie in {lo}..{hi}"
            )));
        }
    }
    Ok(Arg::Ptr(I32Ptr, buf.ptr()))
}

pub(super) fn need_bytes(what: &str, buf: &DevBytes, len: usize) -> Result<Arg> {
    if buf.len() < len {
        return Err(Error::invalid(format!(
            "{what}: {} bytes where {len} are read or written",
            buf.len()
        )));
    }
    Ok(Arg::Ptr(U8Ptr, buf.ptr()))
}

pub(super) fn size(v: usize) -> Arg {
    Arg::U64(v as u64)
}

pub(super) fn int(what: &str, v: usize) -> Result<Arg> {
    i32::try_from(v)
        .map(Arg::I32)
        .map_err(|_| Error::invalid(format!("{what} {v} does not fit a kernel's int")))
}

/// A grid's x extent (at most 2³¹ − 1 blocks).
pub(super) fn blocks(what: &str, v: usize) -> Result<u32> {
    u32::try_from(v.max(1))
        .ok()
        .filter(|&b| b < 1 << 31)
        .ok_or_else(|| Error::invalid(format!("{what}: {v} blocks")))
}

/// A grid's y or z extent (at most 65535 blocks).
pub(super) fn blocks_yz(what: &str, v: usize) -> Result<u32> {
    u32::try_from(v.max(1))
        .ok()
        .filter(|&b| b <= 65_535)
        .ok_or_else(|| Error::invalid(format!("{what}: {v} blocks in a grid's y or z")))
}

pub(super) fn name(base: &str, elem: Elem) -> String {
    format!("{base}_{}", elem.suffix())
}

impl Gpu {
    /// Fills a buffer with the poison pattern (or zeros).
    pub fn fill(&self, buf: &DevBuf, poison: bool) -> Result<()> {
        let n = buf.len();
        let (sig, kind, value) = match buf.elem() {
            Elem::F32 => (&FILL_U32, U32Ptr, crate::tensor::POISON_BITS),
            Elem::Bf16 => (&FILL_U16, U16Ptr, super::buffer::POISON_BF16 as u32),
        };
        let args = [
            Arg::Ptr(kind, buf.ptr()),
            Arg::U32(if poison { value } else { 0 }),
            size(n),
        ];
        // SAFETY: the kernel writes elements 0..n of the buffer, which holds n.
        unsafe { self.launch(sig, sig.pattern, grid_1d(n), &args) }
    }

    /// Fills a buffer with uniform random values in [-amp, amp) (bench inputs).
    pub fn fill_random(&self, buf: &DevBuf, seed: u64, amp: f32) -> Result<()> {
        let n = buf.len();
        let e = buf.elem();
        let args = [
            need("fill", buf, n, e)?,
            Arg::U64(seed),
            Arg::F32(amp),
            size(n),
        ];
        // SAFETY: the kernel writes elements 0..n of the buffer, which holds n.
        unsafe { self.launch(&FILL_RANDOM, &name("fill_random", e), grid_1d(n), &args) }
    }

    /// Fills a buffer with the values `recipe` gives (element i: offset + scale ·
    /// normalish(key, first + i)), the CPU generator's values bit for bit.
    pub fn synthetic_fill(&self, buf: &DevBuf, recipe: Recipe) -> Result<()> {
        let n = buf.len();
        let e = buf.elem();
        let args = [
            need("synthetic fill", buf, n, e)?,
            Arg::U64(recipe.key),
            Arg::U64(recipe.first),
            Arg::F32(recipe.offset),
            Arg::F32(recipe.scale),
            size(n),
        ];
        // SAFETY: the kernel writes elements 0..n of the buffer, which holds n.
        unsafe {
            self.launch(
                &SYNTHETIC_FILL,
                &name("synthetic_fill", e),
                grid_1d(n),
                &args,
            )
        }
    }

    fn elementwise(&self, sig: &Sig, a: &DevBuf, b: &DevBuf, out: &DevBuf, n: usize) -> Result<()> {
        let e = out.elem();
        let base = sig.pattern.trim_end_matches("_{e}");
        let args = [
            need(base, a, n, e)?,
            need(base, b, n, e)?,
            need(base, out, n, e)?,
            size(n),
        ];
        // SAFETY: elements 0..n of each buffer, checked above.
        unsafe { self.launch(sig, &name(base, e), grid_1d(n), &args) }
    }

    /// out = a + b over n elements.
    pub fn add(&self, a: &DevBuf, b: &DevBuf, out: &DevBuf, n: usize) -> Result<()> {
        self.elementwise(&ADD, a, b, out, n)
    }

    /// out = SiLU(gate) · up over n elements.
    pub fn silu_mul(&self, gate: &DevBuf, up: &DevBuf, out: &DevBuf, n: usize) -> Result<()> {
        self.elementwise(&SILU_MUL, gate, up, out, n)
    }

    /// out = x · s over n elements.
    pub fn scale(&self, x: &DevBuf, s: f32, out: &DevBuf, n: usize) -> Result<()> {
        let e = out.elem();
        let args = [
            need("scale", x, n, e)?,
            Arg::F32(s),
            need("scale", out, n, e)?,
            size(n),
        ];
        // SAFETY: elements 0..n of each buffer, checked above.
        unsafe { self.launch(&SCALE, &name("scale", e), grid_1d(n), &args) }
    }

    /// x [rows, cols] += bias [cols], in place.
    pub fn add_bias(&self, x: &DevBuf, bias: &DevBuf, rows: usize, cols: usize) -> Result<()> {
        let e = x.elem();
        let total = prod(&[rows, cols])?;
        let args = [
            need("bias", x, total, e)?,
            need("bias", bias, cols, e)?,
            size(rows),
            size(cols),
        ];
        // SAFETY: x[0..rows·cols] and bias[0..cols], checked above.
        unsafe { self.launch(&ADD_BIAS, &name("add_bias", e), grid_1d(total), &args) }
    }

    /// x [rows, groups, group_width] → out [rows, groups, width], columns start..start+width.
    #[allow(clippy::too_many_arguments)]
    pub fn slice_groups(
        &self,
        x: &DevBuf,
        out: &DevBuf,
        rows: usize,
        groups: usize,
        group_width: usize,
        start: usize,
        width: usize,
    ) -> Result<()> {
        if start + width > group_width {
            return Err(Error::invalid("slice: columns past the group"));
        }
        let e = out.elem();
        let total = prod(&[rows, groups, width])?;
        let args = [
            need("slice", x, prod(&[rows, groups, group_width])?, e)?,
            need("slice", out, total, e)?,
            size(rows),
            size(groups),
            size(group_width),
            size(start),
            size(width),
        ];
        // SAFETY: the kernel reads x[g·gw + start + c] for g < rows·groups, c < width ≤ gw − start.
        unsafe {
            self.launch(
                &SLICE_GROUPS,
                &name("slice_groups", e),
                grid_1d(total),
                &args,
            )
        }
    }

    /// a [n, wa] and b [n, wb] → out [n, wa + wb].
    pub fn concat_groups(
        &self,
        a: &DevBuf,
        b: &DevBuf,
        out: &DevBuf,
        n: usize,
        wa: usize,
        wb: usize,
    ) -> Result<()> {
        let e = out.elem();
        let total = prod(&[n, wa + wb])?;
        let args = [
            need("concat", a, prod(&[n, wa])?, e)?,
            need("concat", b, prod(&[n, wb])?, e)?,
            need("concat", out, total, e)?,
            size(n),
            size(wa),
            size(wb),
        ];
        // A block per row (the kernel walks rows by the grid's stride).
        let cfg = Launch {
            grid: (n.clamp(1, 65_535) as u32, 1, 1),
            block: 256,
            shared: 0,
        };
        // SAFETY: rows 0..n of each, checked above.
        unsafe { self.launch(&CONCAT_GROUPS, &name("concat_groups", e), cfg, &args) }
    }

    /// out[i] = x[rows[i]] for `n` rows of `cols` elements.
    pub fn gather_rows(
        &self,
        x: &DevBuf,
        rows: &DevI32,
        out: &DevBuf,
        n: usize,
        cols: usize,
    ) -> Result<()> {
        let e = out.elem();
        let x_rows = x.len().checked_div(cols).unwrap_or(0) as i64;
        let total = prod(&[n, cols])?;
        let args = [
            need("gather", x, 0, e)?,
            need_i32("gather", rows, n, Some((0, x_rows)))?,
            need("gather", out, total, e)?,
            size(n),
            size(cols),
        ];
        // SAFETY: every row index read is in 0..x_rows (the uploaded range), so x is read within
        // x_rows·cols ≤ its length; out within n·cols.
        unsafe { self.launch(&GATHER_ROWS, &name("gather_rows", e), grid_1d(total), &args) }
    }

    /// `times` copies of the i32 buffer `row`, one after another, known to hold the values `row`
    /// was known to hold (the block table of a batch whose sequences share their pages).
    pub fn repeat_rows_i32(&self, row: &DevI32, times: usize) -> Result<DevI32> {
        let width = row.len();
        if width == 0 {
            return Err(Error::invalid("repeat: an empty row"));
        }
        let total = prod(&[width, times])?;
        let out = self.alloc_vec::<i32>(total)?;
        let args = [
            need_i32("repeat", row, width, None)?,
            need_i32("repeat", &out, total, None)?,
            size(width),
            size(total),
        ];
        // SAFETY: reads row[0..width) and writes out[0..total) (both checked above).
        unsafe {
            self.launch(
                &REPEAT_ROWS_I32,
                REPEAT_ROWS_I32.pattern,
                grid_1d(total),
                &args,
            )?
        };
        Ok(out.with_range_of(row))
    }

    /// acc[rows[i]] += w[i] · y[i] for `n` rows of `cols` elements.
    pub fn scatter_add_rows(
        &self,
        acc: &DevBuf,
        rows: &DevI32,
        y: &DevBuf,
        weights: &DevBuf,
        n: usize,
        cols: usize,
    ) -> Result<()> {
        let e = acc.elem();
        let acc_rows = acc.len().checked_div(cols).unwrap_or(0) as i64;
        let total = prod(&[n, cols])?;
        let args = [
            need("scatter", acc, 0, e)?,
            need_i32("scatter", rows, n, Some((0, acc_rows)))?,
            need("scatter", y, total, e)?,
            need("scatter weights", weights, n, Elem::F32)?,
            size(n),
            size(cols),
        ];
        // SAFETY: row indices in 0..acc_rows (the uploaded range); y and weights checked above.
        unsafe {
            self.launch(
                &SCATTER_ADD_ROWS,
                &name("scatter_add_rows", e),
                grid_1d(total),
                &args,
            )
        }
    }

    /// RMSNorm of `rows` rows of `cols`: one block per row.
    pub fn rmsnorm(
        &self,
        x: &DevBuf,
        weight: &DevBuf,
        out: &DevBuf,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<()> {
        self.row_norm(
            &RMSNORM,
            "rmsnorm",
            x,
            &[("rmsnorm weight", weight)],
            out,
            (rows, cols),
            eps,
        )
    }

    /// LayerNorm of `rows` rows of `cols`: one block per row.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm(
        &self,
        x: &DevBuf,
        weight: &DevBuf,
        bias: &DevBuf,
        out: &DevBuf,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<()> {
        let params = [("layernorm weight", weight), ("layernorm bias", bias)];
        self.row_norm(&LAYERNORM, "layernorm", x, &params, out, (rows, cols), eps)
    }

    /// A normalisation kernel `sig` over `rows` rows of `cols`, one block per row: its
    /// arguments are x, the per-column parameters (`cols` values each), out, cols and eps.
    #[allow(clippy::too_many_arguments)]
    fn row_norm(
        &self,
        sig: &Sig,
        base: &str,
        x: &DevBuf,
        params: &[(&str, &DevBuf)],
        out: &DevBuf,
        (rows, cols): (usize, usize),
        eps: f32,
    ) -> Result<()> {
        let e = out.elem();
        let total = prod(&[rows, cols])?;
        let mut args = vec![need(base, x, total, e)?];
        for &(what, param) in params {
            args.push(need(what, param, cols, e)?);
        }
        args.extend([need(base, out, total, e)?, size(cols), Arg::F32(eps)]);
        let cfg = Launch {
            grid: (blocks(base, rows)?, 1, 1),
            block: 256,
            shared: 0,
        };
        // SAFETY: block r reads row r of x and writes row r of out (r < rows), and `cols`
        // values of each parameter: all checked above, in the order `sig` takes them.
        unsafe { self.launch(sig, &name(base, e), cfg, &args) }
    }

    /// RoPE on x [n, heads, d]: the first 2·half values of each head rotated for the token's
    /// position; `inv_freq` f32 [half].
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &DevBuf,
        out: &DevBuf,
        (n, heads, d): (usize, usize, usize),
        half: usize,
        positions: &DevI32,
        inv_freq: &DevBuf,
        attention_factor: f32,
        interleaved: bool,
    ) -> Result<()> {
        if 2 * half > d {
            return Err(Error::invalid(
                "rope: more rotated values than the head holds",
            ));
        }
        let e = out.elem();
        let total = prod(&[n, heads, d])?;
        let args = [
            need("rope", x, total, e)?,
            need("rope", out, total, e)?,
            size(n),
            size(heads),
            size(d),
            size(half),
            need_i32("rope positions", positions, n, None)?,
            need("rope frequencies", inv_freq, half, Elem::F32)?,
            Arg::F32(attention_factor),
            Arg::I32(interleaved as i32),
        ];
        // SAFETY: x and out over n·heads·d, positions[0..n], inv_freq[0..half], 2·half ≤ d.
        unsafe { self.launch(&ROPE, &name("rope", e), grid_1d(total), &args) }
    }
}
