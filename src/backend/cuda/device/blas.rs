//! The two other foreign calls on device buffers: the cuBLAS GEMM behind every linear layer (a
//! kernel of mladb's own for the few rows of a decode step), and the driver's encoding of TMA
//! tensor maps for the Hopper kernels. Both check their buffers.

use super::kernels::{name, need, GEMV1, GEMV8};
use super::{Arg, DevBuf, Elem, Gpu, Launch};
use crate::backend::DriverCall;
use crate::error::{CudaError, Error, Result};
use std::collections::HashMap;
use std::sync::Mutex;

/// Rows of x up to which [`Gpu::gemm_xwt`] runs gemv.cu instead of cuBLAS (its GEMV_TOKENS).
pub const GEMV_TOKENS: usize = 8;

/// A Hopper TMA descriptor (CUtensorMap: 128 opaque bytes, 64-byte aligned), made on the host
/// by the driver and passed to a kernel by value.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub struct TensorMap([u64; 16]);

// SAFETY: plain bytes with the size and alignment of CUtensorMap, copied into the kernel's
// parameter space as they are.
unsafe impl cudarc::driver::DeviceRepr for TensorMap {}

/// The tensor maps the decodes asked for, by what they were made from: the driver's encode is a
/// pure function of the address and geometry, and a decode call needs three (the cache's and
/// the query's two), every call, over the same buffers. Made again they cost the host 0.1–0.2
/// µs each on the H100 hosts of 2026-12-06 (`mladb bench --device cuda`'s `maps` column), and a
/// driver call each, which a traced call counts; looked up, nothing. Cleared when full, so that
/// it stays small whatever buffers come and go.
#[derive(Default)]
pub(super) struct MapCache(Mutex<HashMap<MapKey, TensorMap>>);

/// A tensor map's inputs: base address, sizes and byte strides (unused entries 0), box rows.
type MapKey = (u64, [u64; 3], [u64; 2], u32);

/// Maps kept at most before the cache starts over.
const MAPS_KEPT: usize = 256;

impl MapCache {
    fn get_or_make(
        &self,
        key: MapKey,
        make: impl FnOnce() -> Result<TensorMap>,
    ) -> Result<TensorMap> {
        let mut maps = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(map) = maps.get(&key) {
            return Ok(*map);
        }
        let map = make()?;
        if maps.len() >= MAPS_KEPT {
            maps.clear();
        }
        maps.insert(key, map);
        Ok(map)
    }
}

fn dim(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid(format!("GEMM: {what} {v} past cuBLAS's int")))
}

impl Gpu {
    /// y [n, out] = x [n, k] · wᵀ (w [out, k]), all row-major in one storage type, f32
    /// accumulation.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_xwt(
        &self,
        x: &DevBuf,
        w: &DevBuf,
        y: &DevBuf,
        n: usize,
        k: usize,
        out: usize,
    ) -> Result<()> {
        use cudarc::cublas::sys::{
            cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
        };
        let elem = y.elem();
        let fits =
            |b: &DevBuf, len: Option<usize>| b.elem() == elem && len.is_some_and(|l| b.len() >= l);
        if !fits(x, n.checked_mul(k))
            || !fits(w, out.checked_mul(k))
            || !fits(y, n.checked_mul(out))
        {
            return Err(Error::invalid(format!(
                "GEMM: buffers of {}, {} and {} elements for [{n}, {k}] · [{out}, {k}]ᵀ",
                x.len(),
                w.len(),
                y.len()
            )));
        }
        let (ni, ki, oi) = (dim(n, "rows")?, dim(k, "inner size")?, dim(out, "columns")?);
        if n == 0 || out == 0 {
            return Ok(());
        }
        if n <= GEMV_TOKENS && k.is_multiple_of(16 / elem.size()) {
            return self.gemv(x, w, y, n, k, out);
        }
        // cuBLAS runs on the context current to the thread; another rank's device may be.
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("context"))?;
        let ty = match elem {
            Elem::F32 => cudaDataType_t::CUDA_R_32F,
            Elem::Bf16 => cudaDataType_t::CUDA_R_16BF,
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Row-major y [n, out] is, column-major, y' (out × n) = w' (read transposed, lda = k)
        // times x' (ldb = k); alpha and beta are host f32 as CUBLAS_COMPUTE_32F expects.
        // SAFETY: the three buffers are live and hold n·k, out·k and n·out elements of the type
        // passed (checked above); alpha and beta outlive the call.
        super::ledger::LEDGER
            .time(DriverCall::Gemm, || unsafe {
                cudarc::cublas::result::gemm_ex(
                    *self.blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    oi,
                    ni,
                    ki,
                    (&alpha) as *const f32 as *const _,
                    w.ptr() as *const _,
                    ty,
                    ki,
                    x.ptr() as *const _,
                    ty,
                    ki,
                    (&beta) as *const f32 as *const _,
                    y.ptr() as *mut _,
                    ty,
                    oi,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            })
            .map_err(CudaError::blas("GEMM"))
    }

    /// [`Gpu::gemm_xwt`] for at most [`GEMV_TOKENS`] rows, `k` a multiple of 16 bytes of
    /// values: a weight-streaming kernel (gemv.cu) in place of cuBLAS, whose host call costs a
    /// decode step's linear layers several times a launch.
    fn gemv(
        &self,
        x: &DevBuf,
        w: &DevBuf,
        y: &DevBuf,
        n: usize,
        k: usize,
        out: usize,
    ) -> Result<()> {
        let e = y.elem();
        // Warps sharing each band of 4 rows, each a share of k: the fewest that make two blocks
        // a multiprocessor (a layer of few rows would leave most of the GPU idle otherwise).
        let target = 2 * self.multiprocessors();
        let parts = [1usize, 2, 4, 8]
            .into_iter()
            .find(|p| (out * p).div_ceil(32) >= target)
            .unwrap_or(8);
        let args = [
            need("gemv", x, n * k, e)?,
            need("gemv", w, out * k, e)?,
            need("gemv", y, n * out, e)?,
            Arg::U64(n as u64),
            Arg::U64(k as u64),
            Arg::U64(out as u64),
            Arg::U64(parts as u64),
        ];
        // The kernel loads 16 bytes at a time from every row of x and w.
        if ![x, w].iter().all(|b| b.ptr().is_multiple_of(16)) {
            return Err(Error::invalid("gemv: buffers not 16-byte aligned"));
        }
        let (sig, base) = match n {
            1 => (&GEMV1, "gemv1"),
            _ => (&GEMV8, "gemv8"),
        };
        // 8 warps a block (gemv.cu's GEMV_THREADS), bands of 4 rows (GEMV_ROWS), `parts` warps
        // a band.
        let cfg = Launch {
            grid: ((out * parts).div_ceil(32) as u32, 1, 1),
            block: 256,
            shared: 0,
        };
        // SAFETY: the kernel reads n·k values of x and out·k of w (a band's rows past `out`
        // read its first row again, in bounds) and writes n·out of y, all checked above; its 16-byte
        // loads need k a multiple of the vector (the caller's condition) and aligned buffers
        // (checked above).
        unsafe { self.launch(sig, &name(base, e), cfg, &args) }
    }

    /// A tensor map over a dense row-major bf16 tensor at `buf` with dimensions `dims`
    /// (innermost first; 2 or 3 of them), read in boxes of 64 elements (128 bytes) of the
    /// innermost dimension × 1 × … × `box_rows` of the outermost, with the 128-byte swizzle
    /// that warpgroup MMAs read: for TMA copies (`cp.async.bulk.tensor`) on Hopper. Boxes past
    /// the end of a dimension are filled with zeros.
    pub(super) fn tensor_map_bf16(
        &self,
        buf: &DevBuf,
        dims: &[usize],
        box_rows: u32,
    ) -> Result<TensorMap> {
        let count = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if !(2..=3).contains(&dims.len()) || count.is_none_or(|c| buf.len() < c) {
            return Err(Error::invalid(
                "tensor map: the buffer is not a bf16 tensor of whole 64-element boxes",
            ));
        }
        // Bytes between consecutive indices of each dimension but the innermost.
        let strides: Vec<u64> = (1..dims.len())
            .map(|i| (dims[..i].iter().product::<usize>() * 2) as u64)
            .collect();
        self.encode_bf16(buf, 0, dims, &strides, box_rows)
    }

    /// The same over rows of `dims[0]` columns that lie `row_stride` elements apart from
    /// element `offset` of `buf` on (`dims` = [columns, rows]): a column range of a wider
    /// tensor, such as the RoPE part of a joined query.
    pub(super) fn tensor_map_rows(
        &self,
        buf: &DevBuf,
        offset: usize,
        dims: [usize; 2],
        row_stride: usize,
        box_rows: u32,
    ) -> Result<TensorMap> {
        // The last row's end, which must lie within the buffer.
        let end = dims[1]
            .checked_sub(1)
            .and_then(|r| r.checked_mul(row_stride))
            .and_then(|e| e.checked_add(offset + dims[0]));
        if dims[0] > row_stride || end.is_none_or(|e| buf.len() < e) || !offset.is_multiple_of(8) {
            return Err(Error::invalid(
                "tensor map: rows that do not lie within the buffer (or start off 16 bytes)",
            ));
        }
        self.encode_bf16(buf, offset, &dims, &[(row_stride * 2) as u64], box_rows)
    }

    /// cuTensorMapEncodeTiled for a bf16 tensor from element `offset` of `buf`, with byte
    /// `strides` for every dimension but the innermost, in the layout of [`Self::tensor_map_bf16`].
    fn encode_bf16(
        &self,
        buf: &DevBuf,
        offset: usize,
        dims: &[usize],
        strides: &[u64],
        box_rows: u32,
    ) -> Result<TensorMap> {
        if buf.elem() != Elem::Bf16
            || dims.is_empty()
            || !dims[0].is_multiple_of(64)
            || dims.contains(&0)
            || strides.len() + 1 != dims.len()
            || strides.iter().any(|s| s % 16 != 0)
            || !(1..=256).contains(&box_rows)
        {
            return Err(Error::invalid(
                "tensor map: the buffer is not a bf16 tensor of whole 64-element boxes",
            ));
        }
        let base = buf.ptr() + (offset * 2) as u64;
        let mut key: MapKey = (base, [0; 3], [0; 2], box_rows);
        if dims.len() > key.1.len() {
            return Err(Error::invalid("tensor map: more than three dimensions"));
        }
        for (k, &d) in key.1.iter_mut().zip(dims) {
            *k = d as u64;
        }
        key.2[..strides.len()].copy_from_slice(strides);
        let sizes = &key.1[..dims.len()];
        self.tensor_maps
            .get_or_make(key, || encode_tiled_bf16(base, sizes, strides, box_rows))
    }
}

/// cuTensorMapEncodeTiled of a bf16 tensor of `sizes` (one to three dimensions) at device
/// address `base` (see [`Gpu::encode_bf16`], which checked the geometry against a live buffer).
fn encode_tiled_bf16(
    base: u64,
    sizes: &[u64],
    strides: &[u64],
    box_rows: u32,
) -> Result<TensorMap> {
    use cudarc::driver::sys;
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let rank = sizes.len();
    let mut boxes = [1u32; 3];
    boxes[0] = 64;
    boxes[rank - 1] = box_rows;
    let steps = [1u32; 3];
    // SAFETY: every pointer is to a live local at least as long as the driver reads (`rank` ≤ 3,
    // or `rank` − 1 strides); the global address is inside a live device allocation from which
    // the dimensions and strides do not reach past its end (checked by the callers).
    let r = super::ledger::LEDGER.time(DriverCall::TensorMap, || unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            rank as u32,
            base as *mut std::ffi::c_void,
            sizes.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    });
    r.result()
        .map_err(CudaError::driver("cuTensorMapEncodeTiled"))?;
    Ok(TensorMap(map.opaque))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(tag: u64) -> TensorMap {
        TensorMap([tag; 16])
    }

    #[test]
    fn a_map_is_made_once_per_address_and_geometry() {
        let cache = MapCache::default();
        let key: MapKey = (1 << 20, [576, 64, 0], [1152, 0], 64);
        let made = std::cell::Cell::new(0);
        let make = |tag| {
            made.set(made.get() + 1);
            Ok(map(tag))
        };
        assert_eq!(cache.get_or_make(key, || make(1)).unwrap().0[0], 1);
        // The same inputs: the map made before, not a new one.
        assert_eq!(cache.get_or_make(key, || make(2)).unwrap().0[0], 1);
        // Another box height, stride or address is another map.
        let other_box = (key.0, key.1, key.2, 32);
        let other_stride = (key.0, key.1, [2304, 0], key.3);
        let other_base = (key.0 + 128, key.1, key.2, key.3);
        for (k, tag) in [(other_box, 3), (other_stride, 4), (other_base, 5)] {
            assert_eq!(cache.get_or_make(k, || make(tag)).unwrap().0[0], tag);
        }
        assert_eq!(made.get(), 4);
        // A failed encode is not kept.
        let bad: MapKey = (0, [64, 1, 0], [128, 0], 1);
        assert!(cache
            .get_or_make(bad, || Err(Error::invalid("no")))
            .is_err());
        assert_eq!(cache.get_or_make(bad, || make(6)).unwrap().0[0], 6);
    }

    #[test]
    fn the_cache_starts_over_when_full() {
        let cache = MapCache::default();
        for i in 0..MAPS_KEPT as u64 + 1 {
            cache
                .get_or_make((i, [64, 1, 0], [128, 0], 1), || Ok(map(i)))
                .unwrap();
        }
        let kept = cache.0.lock().unwrap().len();
        assert_eq!(kept, 1, "cleared at {MAPS_KEPT}, then the new one");
    }
}
