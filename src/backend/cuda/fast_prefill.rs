//! The flash prefill (kernels/flash_prefill.cu, and kernels/flash_prefill_sm90.cu on Hopper):
//! causal attention of one whole sequence over decompressed K/V, the naive path's prefill, on
//! the variant the device's shared memory allows (kernels/variants.cuh describes each).
//! Re-exported by [`super::fast`].

use super::device::{variants, DevBuf, Gpu};
use super::fast::{has_tma, traced};
use crate::error::{Error, Result};
use crate::ops::KernelLaunch;

/// The prefill head dimensions the kernel is built for: (q·k width, v width).
pub const PREFILL_DIMS: [(usize, usize); 2] = [(256, 256), (192, 128)];

/// The portable prefill variants, in the order of preference: (tag, K/V by TMA). Each warp owns
/// 16 query rows and all output dims; kernels/variants.cuh gives each kernel's rows per block,
/// KV tile, stages and shared memory. `k…` is `r…` with its K/V tiles copied by TMA (sm_90 and
/// later) instead of cp.async.
pub const PREFILL_VARIANTS: [(&str, bool); 6] = [
    ("k128t64", true),
    ("r128t64", false),
    ("k64t32", true),
    ("r64t64", false),
    ("r128t32", false),
    ("r64t32", false),
];

/// The kernel of a prefill variant for head dims (dqk, dv), as kernels/variants.cuh describes it.
fn prefill_kernel(tag: &str, dqk: usize, dv: usize) -> Option<&'static variants::Variant> {
    let dims = match (dqk, dv) {
        (256, 256) => "d256",
        (192, 128) => "d192",
        _ => return None,
    };
    variants::variant(&format!("flash_prefill_{tag}_{dims}"))
}

/// Shared memory of a prefill variant (kernels/variants.cuh).
pub fn prefill_shared_bytes(tag: &str, dqk: usize, dv: usize) -> Option<u32> {
    prefill_kernel(tag, dqk, dv).map(|v| v.shared)
}

/// The prefill variant for the device's shared memory: (kernel, rows per block, bytes). `forced`
/// (a tag of [`PREFILL_VARIANTS`]) picks one; otherwise the first that fits.
fn prefill_variant(
    gpu: &Gpu,
    dqk: usize,
    dv: usize,
    forced: Option<&str>,
) -> Result<(&'static str, usize, usize, u32, bool)> {
    let limit = gpu.max_shared_per_block() as u32;
    if !PREFILL_DIMS.contains(&(dqk, dv)) {
        return Err(Error::invalid(format!(
            "the prefill kernel is built for head dims 256/256 and 192/128, not {dqk}/{dv}"
        )));
    }
    if let Some(f) = forced {
        if !PREFILL_VARIANTS.iter().any(|v| v.0 == f) {
            return Err(Error::invalid(format!("no prefill variant {f}")));
        }
    }
    for &(tag, tma) in &PREFILL_VARIANTS {
        if forced.is_some_and(|f| f != tag) || (tma && !has_tma(gpu)) {
            continue;
        }
        if let Some(v) = prefill_kernel(tag, dqk, dv).filter(|v| v.shared <= limit) {
            return Ok((v.kernel, v.rows, v.tile, v.shared, tma));
        }
    }
    Err(Error::invalid(format!(
        "the prefill kernel{} needs more shared memory than this device's {limit} bytes",
        forced.map_or(String::new(), |f| format!(" variant {f}"))
    )))
}

/// The Hopper prefill kernel (kernels/flash_prefill_sm90.cu: TMA and warpgroup MMAs), built for
/// head dims 256/256 on compute capability 9.0 only.
const HOPPER_PREFILL: &str = "flash_prefill_wgmma_d256";

/// The prefill variants a device can run for these head dims, in order of preference: `wgmma`
/// (Hopper, 256/256) and then the tags of [`PREFILL_VARIANTS`] whose shared memory fits.
pub fn prefill_variants_for(gpu: &Gpu, dqk: usize, dv: usize) -> Vec<&'static str> {
    let limit = gpu.max_shared_per_block() as u32;
    let hopper = ((dqk, dv) == (256, 256) && gpu.has_kernel(HOPPER_PREFILL)).then_some("wgmma");
    hopper
        .into_iter()
        .chain(
            PREFILL_VARIANTS
                .iter()
                .filter(|v| !v.1 || has_tma(gpu))
                .filter(|v| prefill_shared_bytes(v.0, dqk, dv).is_some_and(|b| b <= limit))
                .map(|v| v.0),
        )
        .collect()
}

/// Causal prefill of one sequence: `q`, `k` [n, heads, dqk] bf16, `v` [n, heads, dv] bf16;
/// writes `out` [n, heads, dv] bf16 and, if given, `lse` [n, heads] f32, on the variant given (a
/// tag; `None`: the first the device runs). Returns the launch (none for an empty sequence).
#[allow(clippy::too_many_arguments)]
pub fn flash_prefill_variant(
    gpu: &Gpu,
    variant: Option<&str>,
    n: usize,
    heads: usize,
    dims: (usize, usize),
    q: &DevBuf,
    k: &DevBuf,
    v: &DevBuf,
    scale: f32,
    out: &DevBuf,
    lse: Option<&DevBuf>,
) -> Result<Option<KernelLaunch>> {
    let buffers = (q, k, v, out, lse);
    flash_prefill_planted(gpu, variant, false, n, heads, dims, buffers, scale)
}

/// [`flash_prefill_variant`], with the kv-stride-mismatch fault planted when `v_drift` (it acts
/// where the qk and v head dims differ; the Hopper kernel runs 256/256 only).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn flash_prefill_planted(
    gpu: &Gpu,
    variant: Option<&str>,
    v_drift: bool,
    n: usize,
    heads: usize,
    (dqk, dv): (usize, usize),
    (q, k, v, out, lse): (&DevBuf, &DevBuf, &DevBuf, &DevBuf, Option<&DevBuf>),
    scale: f32,
) -> Result<Option<KernelLaunch>> {
    let variant = match variant {
        Some(v) => Some(v),
        None => prefill_variants_for(gpu, dqk, dv).first().copied(),
    };
    if variant == Some("wgmma") {
        return hopper_prefill(gpu, n, heads, (dqk, dv), (q, k, v, out, lse), scale);
    }
    let (name, rows, tile, smem, _) = prefill_variant(gpu, dqk, dv, variant)?;
    if n == 0 {
        return Ok(None);
    }
    let launched = gpu.flash_prefill(
        name,
        (rows, tile, smem),
        (n, heads, dqk, dv),
        q,
        k,
        v,
        out,
        lse,
        scale * std::f32::consts::LOG2_E,
        v_drift,
    )?;
    Ok(Some(traced(launched, 1)))
}

/// [`flash_prefill_variant`] on the Hopper kernel (buffers already checked by the caller).
#[allow(clippy::type_complexity)]
fn hopper_prefill(
    gpu: &Gpu,
    n: usize,
    heads: usize,
    (dqk, dv): (usize, usize),
    (q, k, v, out, lse): (&DevBuf, &DevBuf, &DevBuf, &DevBuf, Option<&DevBuf>),
    scale: f32,
) -> Result<Option<KernelLaunch>> {
    if (dqk, dv) != (256, 256) || !gpu.has_kernel(HOPPER_PREFILL) {
        return Err(Error::invalid(
            "the Hopper prefill kernel runs head dims 256/256 on compute capability 9.0 only",
        ));
    }
    if n == 0 {
        return Ok(None);
    }
    let launched = gpu.flash_prefill_wgmma(
        variants::shared_bytes(HOPPER_PREFILL),
        (n, heads),
        q,
        k,
        v,
        out,
        lse,
        scale * std::f32::consts::LOG2_E,
    )?;
    Ok(Some(traced(launched, 1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_prefill_variant_is_described() {
        for (dqk, dv) in PREFILL_DIMS {
            for (tag, _) in PREFILL_VARIANTS {
                assert!(
                    prefill_shared_bytes(tag, dqk, dv).is_some(),
                    "{tag} {dqk}/{dv}"
                );
            }
        }
        assert_ne!(variants::shared_bytes(HOPPER_PREFILL), u32::MAX);
    }
}
