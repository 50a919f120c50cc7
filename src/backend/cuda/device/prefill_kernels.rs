//! Typed launchers of the tensor-core causal prefill kernels (flash_prefill*.cu), with their TMA
//! tensor maps made here. The choice of variant is `cuda::fast`'s; what a launch may touch is
//! checked here.

use super::fast_kernels::int;
use super::kernels::{blocks, blocks_yz, need, prod};
use super::signature::{Param::*, Sig};
use super::{Arg, DevBuf, Elem, Gpu, Launch, Launched};
use crate::error::{Error, Result};

pub const FLASH_PREFILL: Sig = Sig::new(
    "flash_prefill_r*",
    &[
        Bf16Ptr, Bf16Ptr, Bf16Ptr, Bf16Ptr, F32Ptr, Int, Int, Float, Int,
    ],
);
pub const FLASH_PREFILL_TMA: Sig = Sig::new(
    "flash_prefill_k*",
    &[
        Map, Map, Bf16Ptr, Bf16Ptr, Bf16Ptr, Bf16Ptr, F32Ptr, Int, Int, Float, Int,
    ],
);
pub const FLASH_PREFILL_WGMMA: Sig = Sig::new(
    "flash_prefill_wgmma_d256",
    &[Map, Map, Map, Bf16Ptr, F32Ptr, Int, Int, Float],
);

/// Every launcher's declaration (compared with the `.cu` signatures by a test).
pub const SIGNATURES: &[&Sig] = &[&FLASH_PREFILL, &FLASH_PREFILL_TMA, &FLASH_PREFILL_WGMMA];

impl Gpu {
    /// Causal prefill of one sequence with a portable kernel (`flash_prefill_r…`, or `…k…` with
    /// K/V by TMA): q, k [n, heads, dqk], v and out [n, heads, dv] bf16, lse [n, heads] f32. `v_drift` plants kv-stride-mismatch (see the kernel).
    #[allow(clippy::too_many_arguments)]
    pub fn flash_prefill(
        &self,
        kernel: &str,
        (rows, tile, shared): (usize, usize, u32),
        (n, heads, dqk, dv): (usize, usize, usize, usize),
        q: &DevBuf,
        k: &DevBuf,
        v: &DevBuf,
        out: &DevBuf,
        lse: Option<&DevBuf>,
        scale_log2: f32,
        v_drift: bool,
    ) -> Result<Launched> {
        let tma = FLASH_PREFILL_TMA.matches(kernel);
        let sig = if tma {
            &FLASH_PREFILL_TMA
        } else {
            &FLASH_PREFILL
        };
        if !sig.matches(kernel) || !kernel.ends_with(&format!("_d{dqk}")) {
            return Err(Error::invalid(format!(
                "{kernel} is no prefill kernel for head dim {dqk}"
            )));
        }
        let mut args = Vec::with_capacity(10);
        if tma {
            // K and V in boxes of 64 dims × 1 head × one tile of keys.
            args.push(Arg::Map(self.tensor_map_bf16(
                k,
                &[dqk, heads, n],
                tile as u32,
            )?));
            args.push(Arg::Map(self.tensor_map_bf16(
                v,
                &[dv, heads, n],
                tile as u32,
            )?));
        }
        args.extend(prefill_buffers((n, heads, dqk, dv), q, k, v, out, lse)?);
        args.extend([
            int(n, "tokens")?,
            int(heads, "heads")?,
            Arg::F32(scale_log2),
            Arg::I32(i32::from(v_drift)),
        ]);
        let cfg = Launch {
            grid: (
                blocks("prefill", n.div_ceil(rows))?,
                blocks_yz("prefill", heads)?,
                1,
            ),
            block: (rows * 2) as u32,
            shared,
        };
        // SAFETY: block (i, h) reads rows ≤ its last query row (< n) of head h and writes its
        // query rows of out and lse; extents checked above.
        unsafe { self.launch_traced(sig, kernel, cfg, &args) }
    }

    /// Causal prefill on the Hopper kernel (head dims 256/256, all of q, k, v by TMA).
    #[allow(clippy::too_many_arguments)]
    pub fn flash_prefill_wgmma(
        &self,
        shared: u32,
        (n, heads): (usize, usize),
        q: &DevBuf,
        k: &DevBuf,
        v: &DevBuf,
        out: &DevBuf,
        lse: Option<&DevBuf>,
        scale_log2: f32,
    ) -> Result<Launched> {
        let d = 256;
        // Check the pointers first (the maps below read the same extents).
        let checked = prefill_buffers((n, heads, d, d), q, k, v, out, lse)?;
        // [n, heads, 256] tensors read in boxes of 64 dims × 1 head × 64 tokens.
        let map = |buf: &DevBuf| self.tensor_map_bf16(buf, &[d, heads, n], 64).map(Arg::Map);
        let args = [
            map(q)?,
            map(k)?,
            map(v)?,
            checked[3],
            checked[4],
            int(n, "tokens")?,
            int(heads, "heads")?,
            Arg::F32(scale_log2),
        ];
        let cfg = Launch {
            grid: (
                blocks("prefill", n.div_ceil(128))?,
                blocks_yz("prefill", heads)?,
                1,
            ),
            block: 256,
            shared,
        };
        // SAFETY: as the portable prefill; the tensor maps cover exactly q, k and v.
        unsafe {
            self.launch_traced(
                &FLASH_PREFILL_WGMMA,
                FLASH_PREFILL_WGMMA.pattern,
                cfg,
                &args,
            )
        }
    }
}

/// q, k, v, out and lse of a prefill, checked: [q, k, v, out, lse (null when absent)].
fn prefill_buffers(
    (n, heads, dqk, dv): (usize, usize, usize, usize),
    q: &DevBuf,
    k: &DevBuf,
    v: &DevBuf,
    out: &DevBuf,
    lse: Option<&DevBuf>,
) -> Result<[Arg; 5]> {
    let qk = prod(&[n, heads, dqk])?;
    let vv = prod(&[n, heads, dv])?;
    Ok([
        need("prefill q", q, qk, Elem::Bf16)?,
        need("prefill k", k, qk, Elem::Bf16)?,
        need("prefill v", v, vv, Elem::Bf16)?,
        need("prefill out", out, vv, Elem::Bf16)?,
        match lse {
            Some(l) => need("prefill lse", l, prod(&[n, heads])?, Elem::F32)?,
            None => Arg::Ptr(F32Ptr, 0),
        },
    ])
}
