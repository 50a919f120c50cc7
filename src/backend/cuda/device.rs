//! The GPU: context, stream, cuBLAS handle, the loaded kernels, device buffers with a registry,
//! copies between host and device, and kernel launches. Every `unsafe` of the CUDA backend is in
//! this file, with the invariant it relies on beside it.

use super::compile::{compile, hopper_target, HOPPER_SOURCES, SOURCES};
use crate::error::{Error, Result};
use crate::tensor::{DeviceBuffer, POISON_BITS};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// How values are stored on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    F32,
    Bf16,
}

impl Elem {
    pub fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::Bf16 => 2,
        }
    }

    /// The kernel-name suffix of this storage type.
    pub fn suffix(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::Bf16 => "bf16",
        }
    }
}

/// bf16 bits of the poison pattern (its high half), and the f32 pattern it stands for on the host.
const POISON_BF16: u16 = (POISON_BITS >> 16) as u16;

fn to_bf16(v: f32) -> u16 {
    if v.to_bits() == POISON_BITS {
        return POISON_BF16;
    }
    half::bf16::from_f32(v).to_bits()
}

fn from_bf16(b: u16) -> f32 {
    if b == POISON_BF16 {
        return f32::from_bits(POISON_BITS);
    }
    half::bf16::from_bits(b).to_f32()
}

/// One device allocation. The registry numbers every allocation and keeps its label.
pub struct DevBuf {
    slice: CudaSlice<u8>,
    pub ptr: u64,
    pub elem: Elem,
    /// Elements (of `elem`), not bytes.
    pub len: usize,
    pub serial: u64,
}

impl DeviceBuffer for DevBuf {
    fn address(&self) -> u64 {
        self.ptr
    }
    fn bytes(&self) -> usize {
        self.len * self.elem.size()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A kernel argument: device pointers and sizes are u64, scalars f32 or i32, as in kernels/.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    U64(u64),
    F32(f32),
    I32(i32),
    /// A TMA tensor map, passed by value (a `__grid_constant__` parameter).
    TensorMap(TensorMap),
}

/// A Hopper TMA descriptor (CUtensorMap: 128 opaque bytes, 64-byte aligned), made on the host
/// by the driver and passed to a kernel by value.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub struct TensorMap(pub [u64; 16]);

// SAFETY: plain bytes with the size and alignment of CUtensorMap, copied into the kernel's
// parameter space as they are.
unsafe impl cudarc::driver::DeviceRepr for TensorMap {}

impl Gpu {
    /// A tensor map over a dense row-major bf16 tensor at `buf` with dimensions `dims`
    /// (innermost first; 2 or 3 of them), read in boxes of 64 elements (128 bytes) of the
    /// innermost dimension × 1 × … × `box_rows` of the outermost, with the 128-byte swizzle
    /// that warpgroup MMAs read: for TMA copies (`cp.async.bulk.tensor`) on Hopper. Boxes past
    /// the end of a dimension are filled with zeros.
    pub fn tensor_map_bf16(
        &self,
        buf: &DevBuf,
        dims: &[usize],
        box_rows: u32,
    ) -> Result<TensorMap> {
        use cudarc::driver::sys;
        let count: usize = dims.iter().product();
        if buf.elem != Elem::Bf16
            || !(2..=3).contains(&dims.len())
            || buf.len < count
            || !dims[0].is_multiple_of(64)
        {
            return Err(Error::invalid(
                "tensor map: the buffer is not a bf16 tensor of whole 64-element boxes",
            ));
        }
        let mut map = sys::CUtensorMap { opaque: [0; 16] };
        let rank = dims.len();
        let sizes: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        // Bytes between consecutive indices of each dimension but the innermost.
        let strides: Vec<u64> = (1..rank)
            .map(|i| (dims[..i].iter().product::<usize>() * 2) as u64)
            .collect();
        let mut boxes = vec![1u32; rank];
        boxes[0] = 64;
        boxes[rank - 1] = box_rows;
        let steps = vec![1u32; rank];
        // SAFETY: every pointer is to a live local of the length the driver reads (`rank`, or
        // `rank` − 1 strides); the global address is a live device allocation of the tensor.
        let r = unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                rank as u32,
                buf.ptr as *mut std::ffi::c_void,
                sizes.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                steps.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(Error::invalid(format!("cuTensorMapEncodeTiled: {r:?}")));
        }
        Ok(TensorMap(map.opaque))
    }
}

impl From<u64> for Arg {
    fn from(v: u64) -> Arg {
        Arg::U64(v)
    }
}
impl From<usize> for Arg {
    fn from(v: usize) -> Arg {
        Arg::U64(v as u64)
    }
}
impl From<f32> for Arg {
    fn from(v: f32) -> Arg {
        Arg::F32(v)
    }
}
impl From<i32> for Arg {
    fn from(v: i32) -> Arg {
        Arg::I32(v)
    }
}
impl From<&DevBuf> for Arg {
    fn from(b: &DevBuf) -> Arg {
        Arg::U64(b.ptr)
    }
}

/// A record of the device buffer registry.
#[derive(Debug, Clone)]
pub struct Allocation {
    pub serial: u64,
    pub ptr: u64,
    pub bytes: usize,
}

/// A loaded kernel, and the dynamic shared memory it has been allowed so far (past 48 KB a
/// function must be granted more, once; launches then only compare).
struct Kernel {
    function: CudaFunction,
    shared_allowed: AtomicU32,
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    functions: HashMap<String, Kernel>,
    pub name: String,
    /// compute capability, e.g. "90".
    pub arch: String,
    next_serial: AtomicU64,
    /// The most recent allocations (a bounded log), for the buffers view and tests.
    pub registry: Mutex<Vec<Allocation>>,
    /// Optional (Hopper-only) kernel files that did not build or load here, with the reason:
    /// their work falls to the portable kernels.
    pub unavailable: Vec<String>,
}

fn driver_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::invalid(format!("CUDA {what}: {e:?}"))
}

impl Gpu {
    /// Opens device `ordinal` and compiles every kernel for it. Fails cleanly (never panics)
    /// when the driver, NVRTC or a device is missing.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        // SAFETY: only tries to open libcuda; cudarc would panic on the first call without it.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::invalid(
                "no CUDA driver (libcuda.so) on this machine",
            ));
        }
        if !super::compile::nvrtc_present() {
            return Err(Error::invalid(
                "NVRTC (libnvrtc.so) is not on the library path",
            ));
        }
        let count = CudaContext::device_count().map_err(driver_err("device count"))?;
        if count <= ordinal as i32 {
            return Err(Error::invalid(format!(
                "no CUDA device {ordinal} ({count} present)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err("context"))?;
        let stream = ctx.default_stream();
        let blas =
            CudaBlas::new(stream.clone()).map_err(|e| Error::invalid(format!("cuBLAS: {e:?}")))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver_err("compute capability"))?;
        let arch = format!("{major}{minor}");
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let mut functions = HashMap::new();
        let portable = format!("compute_{arch}");
        let hopper = hopper_target(&portable);
        let files = SOURCES
            .iter()
            .map(|&(file, src)| (file, src, portable.clone(), true))
            .chain(HOPPER_SOURCES.iter().filter_map(|&(file, src)| {
                hopper.clone().map(|target| (file, src, target, false))
            }));
        let mut unavailable = Vec::new();
        for (file, src, target, required) in files {
            let loaded = (|| -> Result<Vec<(String, Kernel)>> {
                let compiled = compile(file, src, &target)?;
                let ptx = Ptx::from_src(String::from_utf8_lossy(&compiled.code).into_owned());
                let module = ctx.load_module(ptx).map_err(driver_err("module load"))?;
                kernel_names(src)
                    .into_iter()
                    .map(|name| {
                        let function = module
                            .load_function(&name)
                            .map_err(driver_err("kernel lookup"))?;
                        let shared_allowed = AtomicU32::new(48 * 1024);
                        Ok((
                            name,
                            Kernel {
                                function,
                                shared_allowed,
                            },
                        ))
                    })
                    .collect()
            })();
            match loaded {
                Ok(kernels) => functions.extend(kernels),
                Err(e) if required => return Err(e),
                // A Hopper-only file that this toolkit or driver cannot build: the portable
                // kernels do the work instead, and `unavailable` says why.
                Err(e) => unavailable.push(format!("{file} ({target}): {e}")),
            }
        }
        Ok(Gpu {
            ctx,
            stream,
            blas,
            functions,
            name,
            arch,
            next_serial: AtomicU64::new(1),
            registry: Mutex::new(Vec::new()),
            unavailable,
        })
    }

    /// Allocates `len` elements (contents undefined until written).
    pub fn alloc(&self, len: usize, elem: Elem) -> Result<DevBuf> {
        let bytes = (len * elem.size()).max(4);
        // SAFETY: the memory is uninitialised; every caller fills it (a fill kernel, an upload
        // or a kernel that writes all of it) before it is read.
        let slice = unsafe { self.stream.alloc::<u8>(bytes) }.map_err(driver_err("alloc"))?;
        let ptr = {
            let (p, _sync) = slice.device_ptr(&self.stream);
            p
        };
        let serial = self.next_serial.fetch_add(1, Ordering::Relaxed);
        let mut reg = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        reg.push(Allocation { serial, ptr, bytes });
        if reg.len() > 4096 {
            reg.drain(..1024);
        }
        Ok(DevBuf {
            slice,
            ptr,
            elem,
            len,
            serial,
        })
    }

    /// Fills a buffer with the poison pattern (or zeros).
    pub fn fill(&self, buf: &DevBuf, poison: bool) -> Result<()> {
        let n = buf.len as u64;
        match buf.elem {
            Elem::F32 => self.launch(
                "fill_u32",
                grid(n),
                256,
                0,
                &[
                    buf.into(),
                    Arg::I32(if poison { POISON_BITS as i32 } else { 0 }),
                    n.into(),
                ],
            ),
            Elem::Bf16 => self.launch(
                "fill_u16",
                grid(n),
                256,
                0,
                &[
                    buf.into(),
                    Arg::I32(if poison { POISON_BF16 as i32 } else { 0 }),
                    n.into(),
                ],
            ),
        }
    }

    /// A buffer holding `data` in `elem`.
    pub fn upload(&self, data: &[f32], elem: Elem) -> Result<DevBuf> {
        let mut buf = self.alloc(data.len(), elem)?;
        self.write(&mut buf, 0, data)?;
        Ok(buf)
    }

    /// Writes `data` at element offset `at` of `buf`.
    pub fn write(&self, buf: &mut DevBuf, at: usize, data: &[f32]) -> Result<()> {
        if at + data.len() > buf.len {
            return Err(Error::invalid("device write past the end of a buffer"));
        }
        let bytes: Vec<u8> = match buf.elem {
            Elem::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Elem::Bf16 => data
                .iter()
                .flat_map(|v| to_bf16(*v).to_le_bytes())
                .collect(),
        };
        let offset = at * buf.elem.size();
        let mut view = buf.slice.slice_mut(offset..offset + bytes.len());
        self.stream
            .memcpy_htod(&bytes, &mut view)
            .map_err(driver_err("upload"))?;
        Ok(())
    }

    /// A buffer of i32 values (positions, indices).
    pub fn upload_i32(&self, data: &[i32]) -> Result<DevBuf> {
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut buf = self.alloc(data.len(), Elem::F32)?;
        let mut view = buf.slice.slice_mut(0..bytes.len().max(1).min(buf.len * 4));
        if !bytes.is_empty() {
            self.stream
                .memcpy_htod(&bytes, &mut view)
                .map_err(driver_err("upload"))?;
        }
        Ok(buf)
    }

    /// A buffer of bytes (masks).
    pub fn upload_bytes(&self, data: &[u8]) -> Result<DevBuf> {
        let mut buf = self.alloc(data.len().div_ceil(4), Elem::F32)?;
        if !data.is_empty() {
            let mut view = buf.slice.slice_mut(0..data.len());
            self.stream
                .memcpy_htod(data, &mut view)
                .map_err(driver_err("upload"))?;
        }
        Ok(buf)
    }

    /// Copies a buffer back as f32 (waits for the stream, so kernel errors surface here).
    pub fn download(&self, buf: &DevBuf) -> Result<Vec<f32>> {
        self.download_range(buf, 0, buf.len)
    }

    /// Raw bytes of a buffer (i32 or f64 results of kernels).
    pub fn download_bytes(&self, buf: &DevBuf, bytes: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; bytes];
        if bytes > 0 {
            let view = buf.slice.slice(0..bytes);
            self.stream
                .memcpy_dtoh(&view, &mut out)
                .map_err(driver_err("download"))?;
        }
        self.stream.synchronize().map_err(driver_err("kernel"))?;
        Ok(out)
    }

    /// Copies `len` elements from `src` at `from` to `dst` at `to` (same storage type).
    pub fn copy(
        &self,
        src: &DevBuf,
        from: usize,
        dst: &mut DevBuf,
        to: usize,
        len: usize,
    ) -> Result<()> {
        let s = src.elem.size();
        let view = src.slice.slice(from * s..(from + len) * s);
        let mut out = dst.slice.slice_mut(to * s..(to + len) * s);
        self.stream
            .memcpy_dtod(&view, &mut out)
            .map_err(driver_err("copy"))
    }

    /// Whether this device has kernel `name` (the Hopper-only kernels exist on Hopper alone).
    pub fn has_kernel(&self, name: &str) -> bool {
        self.functions.contains_key(name)
    }

    /// Launches kernel `name` on a grid of `grid` blocks of `block` threads.
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &[Arg],
    ) -> Result<()> {
        let kernel = self
            .functions
            .get(name)
            .ok_or_else(|| Error::invalid(format!("no CUDA kernel named {name}")))?;
        if shared > kernel.shared_allowed.load(Ordering::Relaxed) {
            kernel
                .function
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared as i32,
                )
                .map_err(driver_err("shared memory attribute"))?;
            kernel.shared_allowed.fetch_max(shared, Ordering::Relaxed);
        }
        let mut b = self.stream.launch_builder(&kernel.function);
        for a in args {
            match a {
                Arg::U64(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::TensorMap(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: shared,
        };
        // SAFETY: each call site passes the argument list its kernel's extern "C" signature
        // declares (pointers and sizes as u64, scalars as f32/i32), in order; pointers come from
        // live DevBufs large enough for every index the kernel touches given those sizes. `args`
        // outlives the launch.
        unsafe { b.launch(cfg) }.map_err(driver_err(name))?;
        Ok(())
    }

    /// y [n, out] = x [n, k] · wᵀ (w [out, k]), all row-major in `elem`, f32 accumulation.
    ///
    /// # Safety
    /// The three addresses must be live device buffers of at least n·k, out·k and n·out
    /// elements of type `elem`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_xwt(
        &self,
        x: u64,
        w: u64,
        y: u64,
        n: usize,
        k: usize,
        out: usize,
        elem: Elem,
    ) -> Result<()> {
        use cudarc::cublas::sys::{
            cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
        };
        let ty = match elem {
            Elem::F32 => cudaDataType_t::CUDA_R_32F,
            Elem::Bf16 => cudaDataType_t::CUDA_R_16BF,
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Row-major y [n, out] is, column-major, y' (out × n) = w' (read transposed, lda = k)
        // times x' (ldb = k); alpha and beta are host f32 as CUBLAS_COMPUTE_32F expects.
        cudarc::cublas::result::gemm_ex(
            *self.blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            out as i32,
            n as i32,
            k as i32,
            (&alpha) as *const f32 as *const _,
            w as *const _,
            ty,
            k as i32,
            x as *const _,
            ty,
            k as i32,
            (&beta) as *const f32 as *const _,
            y as *mut _,
            ty,
            out as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(|e| Error::invalid(format!("cuBLAS GEMM: {e:?}")))
    }

    /// Copies `len` elements from element `from` of a buffer back as f32.
    pub fn download_range(&self, buf: &DevBuf, from: usize, len: usize) -> Result<Vec<f32>> {
        if from + len > buf.len {
            return Err(Error::invalid("device read past the end of a buffer"));
        }
        let s = buf.elem.size();
        let mut bytes = vec![0u8; len * s];
        if !bytes.is_empty() {
            let view = buf.slice.slice(from * s..(from + len) * s);
            self.stream
                .memcpy_dtoh(&view, &mut bytes)
                .map_err(driver_err("download"))?;
        }
        self.stream.synchronize().map_err(driver_err("kernel"))?;
        Ok(match buf.elem {
            Elem::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Elem::Bf16 => bytes
                .chunks_exact(2)
                .map(|b| from_bf16(u16::from_le_bytes([b[0], b[1]])))
                .collect(),
        })
    }

    /// Times `work` with device events: `reps` samples, each of `inner` back-to-back calls,
    /// after `warmup` untimed calls; returns milliseconds per call, one value per sample.
    pub fn time_ms(
        &self,
        warmup: usize,
        reps: usize,
        inner: usize,
        mut work: impl FnMut() -> Result<()>,
    ) -> Result<Vec<f64>> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        for _ in 0..warmup {
            work()?;
        }
        self.stream.synchronize().map_err(driver_err("kernel"))?;
        let mut out = Vec::with_capacity(reps);
        for _ in 0..reps {
            let start = self
                .stream
                .record_event(Some(CU_EVENT_DEFAULT))
                .map_err(driver_err("event"))?;
            for _ in 0..inner.max(1) {
                work()?;
            }
            let end = self
                .stream
                .record_event(Some(CU_EVENT_DEFAULT))
                .map_err(driver_err("event"))?;
            let ms = start.elapsed_ms(&end).map_err(driver_err("event timing"))?;
            out.push(ms as f64 / inner.max(1) as f64);
        }
        Ok(out)
    }

    /// The most shared memory one block may ask for (the opt-in limit).
    pub fn max_shared_per_block(&self) -> usize {
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN as OPTIN;
        self.ctx.attribute(OPTIN).map_or(48 * 1024, |v| v as usize)
    }

    /// Shared memory of one multiprocessor (what its resident blocks share).
    pub fn max_shared_per_multiprocessor(&self) -> usize {
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR as PER_SM;
        self.ctx.attribute(PER_SM).map_or(48 * 1024, |v| v as usize)
    }

    /// Streaming multiprocessors of the device.
    pub fn multiprocessors(&self) -> usize {
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT as SMS;
        self.ctx.attribute(SMS).map_or(1, |v| v.max(1) as usize)
    }

    /// Fills a buffer with uniform random values in [-amp, amp) (bench inputs).
    pub fn fill_random(&self, buf: &DevBuf, seed: u64, amp: f32) -> Result<()> {
        let n = buf.len as u64;
        let name = match buf.elem {
            Elem::F32 => "fill_random_f32",
            Elem::Bf16 => "fill_random_bf16",
        };
        self.launch(
            name,
            grid(n),
            256,
            0,
            &[buf.into(), seed.into(), amp.into(), n.into()],
        )
    }

    /// Memory in use and in all, in bytes.
    pub fn memory(&self) -> (usize, usize) {
        self.ctx
            .mem_get_info()
            .map(|(free, total)| (total - free, total))
            .unwrap_or((0, 0))
    }
}

/// A 1-D grid covering `n` elements with 256-thread blocks (grid-stride loops do the rest).
pub fn grid(n: u64) -> (u32, u32, u32) {
    (n.div_ceil(256).clamp(1, 65_535) as u32, 1, 1)
}

/// The extern "C" kernel names defined in a source file: declared directly, or through a macro
/// whose body declares them (`FLASH_PREFILL(name, ...)`, or names pasted together from its
/// parameters: `dequant_##name##_f32`), expanded for each use of the macro.
pub fn kernel_names(src: &str) -> Vec<String> {
    /// A macro that declares kernels: its parameters and the name patterns it declares.
    struct Macro {
        name: String,
        params: Vec<String>,
        patterns: Vec<String>,
    }
    fn declared(line: &str) -> Option<String> {
        let rest = line.split_once("extern \"C\" __global__ void ")?.1;
        // `__launch_bounds__(...)` may stand between `void` and the name.
        let rest = match rest.trim_start().strip_prefix("__launch_bounds__") {
            Some(b) => b.split_once(')').map_or("", |(_, name)| name),
            None => rest,
        };
        rest.split('(').next().map(|n| n.trim().to_string())
    }
    let mut names = Vec::new();
    let mut macros: Vec<Macro> = Vec::new();
    let mut open: Option<Macro> = None;
    for line in src.lines() {
        let t = line.trim_start();
        let continued = line.trim_end().ends_with('\\');
        if let Some(m) = open.as_mut() {
            m.patterns.extend(declared(line));
            if !continued {
                macros.push(open.take().expect("open macro"));
            }
            continue;
        }
        if let Some(rest) = t.strip_prefix("#define ") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let params = rest[name.len()..]
                .strip_prefix('(')
                .and_then(|p| p.split_once(')'))
                .map(|(p, _)| p.split(',').map(|s| s.trim().to_string()).collect())
                .unwrap_or_default();
            let m = Macro {
                name,
                params,
                patterns: declared(line).into_iter().collect(),
            };
            if continued {
                open = Some(m);
            } else {
                macros.push(m);
            }
            continue;
        }
        if let Some(name) = declared(t).filter(|_| t.starts_with("extern")) {
            names.push(name);
            continue;
        }
        if let Some((mac, args)) = t.split_once('(') {
            let Some(m) = macros
                .iter()
                .find(|m| m.name == mac && !m.patterns.is_empty())
            else {
                continue;
            };
            let args: Vec<&str> = args
                .rsplit_once(')')
                .map_or(args, |(a, _)| a)
                .split(',')
                .map(str::trim)
                .collect();
            for pattern in &m.patterns {
                let expanded: String = pattern
                    .split("##")
                    .map(|piece| {
                        let piece = piece.trim();
                        m.params
                            .iter()
                            .position(|p| p == piece)
                            .and_then(|i| args.get(i).copied())
                            .unwrap_or(piece)
                    })
                    .collect();
                names.push(expanded);
            }
        }
    }
    names
}

#[cfg(test)]
mod tests {
    #[test]
    fn kernel_names_cover_plain_bounded_and_macro_declarations() {
        let src = "extern \"C\" __global__ void plain(int a) {}\n\
                   extern \"C\" __global__ void __launch_bounds__(256, 1) bounded(int a) {}\n\
                   #define MAKE(NAME, X) \\\n    extern \"C\" __global__ void NAME(int a) { body<X>(a); }\n\
                   #define OTHER(A) (A + 1)\n\
                   MAKE(made_a, 1)\nMAKE(made_b, 2)\nint y = OTHER(3);\n\
                   #define PASTE(t, B) \\\n    extern \"C\" __global__ void dq_##t##_f32(int a) {} \\\n    extern \"C\" __global__ void mm_##t(int a) {}\n\
                   PASTE(q4_k, 256)\n";
        assert_eq!(
            super::kernel_names(src),
            [
                "plain",
                "bounded",
                "made_a",
                "made_b",
                "dq_q4_k_f32",
                "mm_q4_k"
            ]
        );
    }
}
#[cfg(test)]
mod source_names {
    /// Every kernel name found in the real sources is a plain identifier (a macro left
    /// unexpanded would fail the lookup at run time only, on a GPU).
    #[test]
    fn every_kernel_name_is_an_identifier() {
        let mut total = 0;
        let compile = &crate::backend::cuda::compile::SOURCES;
        let hopper = &crate::backend::cuda::compile::HOPPER_SOURCES;
        for (file, src) in compile.iter().chain(hopper.iter()) {
            for name in super::kernel_names(src) {
                assert!(
                    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                    "{file}: kernel name {name:?}"
                );
                total += 1;
            }
        }
        assert!(total > 100, "{total} kernels");
    }
}
