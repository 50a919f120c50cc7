//! The GPU: context, stream, cuBLAS handle, the loaded kernels, typed device buffers, copies,
//! and kernel launches.
//!
//! Every `unsafe` of the CUDA backend is in this module and its files (the rest of `cuda` is
//! compiled with `deny(unsafe_code)`), each with the invariant it relies on beside it. The raw
//! launch is `unsafe` and private to this module; what the backend calls are the typed launchers
//! of [`kernels`], [`mla_kernels`], [`model_kernels`], [`fast_kernels`] and [`fp8_kernels`], one per kernel, which take typed buffers, check every
//! buffer against the sizes the kernel will index with, and pass exactly the parameters of the
//! kernel's `extern "C"` signature (declared in [`signature`] and compared with `kernels/*.cu` by
//! a test). A safe caller cannot make a kernel read or write out of bounds.

pub mod blas;
pub mod buffer;
pub mod compile;
pub mod expert_kernels;
pub mod fast_kernels;
pub mod fp8_kernels;
mod free_list;
mod kernel_cache;
pub mod kernels;
mod launch_attrs;
mod ledger;
pub mod merge_kernels;
pub mod mla_kernels;
pub mod model_kernels;
pub mod nccl;
mod pool;
pub mod prefill_kernels;
pub mod signature;
mod timing;
pub mod variants;

pub use blas::TensorMap;
pub use buffer::{DevBuf, DevBytes, DevF64, DevI32, DevVec, Elem};

use crate::backend::{DriverCall, DriverCalls};
use crate::error::{CudaError, Error, Result};
use compile::{hopper_target, HOPPER_SOURCES, SOURCES};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use signature::{Param, Sig};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A kernel argument as the raw launch passes it. Pointers carry the C type of the parameter they
/// are for, so that the launch can compare the list with the kernel's declared signature.
// The argument list lives on the stack for one launch: the size of its largest kind costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy)]
enum Arg {
    /// A device pointer (0 for a null one) for a parameter of this pointer type.
    Ptr(Param, u64),
    U64(u64),
    U32(u32),
    I32(i32),
    F32(f32),
    /// A TMA tensor map, passed by value (a `__grid_constant__` parameter).
    Map(TensorMap),
    /// The statistics pass's tensors, passed by value.
    StatsJobs(StatsJobs),
}

/// stats.cu's `StatsJobs`, field for field: tensor j (of `count`) is `n[j]` values at `ptr[j]`,
/// bf16 where bit j of `bf16_mask` is set, and owns blocks `first_block[j]..first_block[j + 1]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct StatsJobs {
    ptr: [u64; kernels::STATS_JOBS],
    n: [u64; kernels::STATS_JOBS],
    first_block: [u32; kernels::STATS_JOBS + 1],
    bf16_mask: u32,
    count: u32,
}

// SAFETY: plain integers laid out as the C struct (no padding before the end), copied into the
// kernel's parameter space as they are.
unsafe impl cudarc::driver::DeviceRepr for StatsJobs {}

impl Arg {
    /// The parameter type this argument fills.
    fn param(&self) -> Param {
        match self {
            Arg::Ptr(p, _) => *p,
            Arg::U64(_) => Param::U64,
            Arg::U32(_) => Param::U32,
            Arg::I32(_) => Param::Int,
            Arg::F32(_) => Param::Float,
            Arg::Map(_) => Param::Map,
            Arg::StatsJobs(_) => Param::Jobs,
        }
    }
}

/// Grid, block and dynamic shared memory of one launch.
#[derive(Debug, Clone, Copy)]
struct Launch {
    grid: (u32, u32, u32),
    block: u32,
    shared: u32,
}

impl Launch {
    /// This launch of `kernel`, as the trace records it.
    fn launched(self, kernel: &str) -> Launched {
        Launched {
            kernel: kernel.to_string(),
            grid: self.grid,
            block: self.block,
            shared: self.shared,
            cluster: 1,
        }
    }
}

/// A launch as it went to the driver, for the trace: the kernel, grid, threads per block,
/// dynamic shared memory and clusters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launched {
    pub kernel: String,
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub shared: u32,
    /// Blocks a cluster along x (1: launched without clusters).
    pub cluster: u32,
}

/// How a kernel is launched: plainly, as a programmatic dependent of the kernel before it, or
/// with its blocks in clusters of a size along x (as a dependent too, or not): the launch
/// attributes of `launch_attrs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LaunchMode {
    Plain,
    Dependent,
    /// Blocks in clusters of this size along x, and whether also as a dependent.
    Cluster(u32, bool),
}

/// A 1-D launch covering `n` elements with 256-thread blocks (grid-stride loops do the rest).
fn grid_1d(n: usize) -> Launch {
    Launch {
        grid: ((n as u64).div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
        block: 256,
        shared: 0,
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
    /// Resident blocks per multiprocessor by (threads, shared bytes), asked of the driver once.
    resident: Mutex<HashMap<(u32, u32), Option<usize>>>,
}

impl Kernel {
    /// Grants the function `shared` bytes of dynamic shared memory where it has less.
    fn allow_shared(&self, shared: u32) -> Result<()> {
        if shared > self.shared_allowed.load(Ordering::Relaxed) {
            self.function
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared as i32,
                )
                .map_err(CudaError::driver("shared memory attribute"))?;
            self.shared_allowed.fetch_max(shared, Ordering::Relaxed);
        }
        Ok(())
    }
}

pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    functions: HashMap<String, Kernel>,
    pub name: String,
    /// compute capability, e.g. "90".
    pub arch: String,
    /// Whether the device takes programmatic dependent launches (sm_90 and later).
    dependent_launches: bool,
    next_serial: AtomicU64,
    /// The most recent allocations (a bounded log), for the buffers view and tests.
    pub registry: Mutex<Vec<Allocation>>,
    /// Optional (Hopper-only) kernel files that did not build or load here, with the reason:
    /// their work falls to the portable kernels.
    pub unavailable: Vec<String>,
    /// Buffers dropped, kept for the next allocations of their sizes.
    free: Arc<free_list::FreeList>,
    limits: Limits,
    /// Tensor maps made so far (see [`blas::MapCache`]).
    tensor_maps: blas::MapCache,
}

/// Whether the CUDA driver library can be loaded (cudarc panics on its first call without it).
pub fn driver_present() -> bool {
    // SAFETY: only tries to open libcuda.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The context of device `ordinal` and the one stream of every [`Gpu`] opened on it in this
/// process, made at the first open. Every buffer, copy and kernel of a device is on that
/// stream, whose order is all the synchronisation they need, even between two `Gpu`s of one
/// device (the debugger makes a new backend when the device or storage type changes, and the
/// new one may read the old one's buffers). It is a stream of its own, not the legacy default
/// stream, so that work on it can be captured into a CUDA graph (the benches replay decode
/// steps as CUDA-graph serving does).
fn device_stream(ordinal: usize) -> Result<DeviceStream> {
    static MADE: Mutex<Vec<(usize, DeviceStream)>> = Mutex::new(Vec::new());
    let mut made = MADE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, made)) = made.iter().find(|(o, _)| *o == ordinal) {
        return Ok(made.clone());
    }
    let ctx = CudaContext::new(ordinal).map_err(CudaError::driver("context"))?;
    // cudarc's per-buffer events (two made and destroyed with every allocation, recorded at
    // every use) only order work across streams, and cost a traced op tens of microseconds.
    // SAFETY: no other stream is ever made on this context (`stream` below is the only one),
    // so no buffer is used on a stream other than the one that made it.
    unsafe { ctx.disable_event_tracking() };
    pool::keep_freed_memory(&ctx)?;
    let stream = ctx.new_stream().map_err(CudaError::driver("stream"))?;
    made.push((ordinal, (ctx.clone(), stream.clone())));
    Ok((ctx, stream))
}

/// A device's context and its one stream.
type DeviceStream = (Arc<CudaContext>, Arc<CudaStream>);

impl Gpu {
    /// Opens device `ordinal` and compiles every kernel for it. Fails cleanly (never panics)
    /// when the driver, NVRTC or a device is missing.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        if !driver_present() {
            return Err(Error::invalid(
                "no CUDA driver (libcuda.so) on this machine",
            ));
        }
        if !compile::nvrtc_present() {
            return Err(Error::invalid(compile::NVRTC_NOT_FOUND));
        }
        let count = CudaContext::device_count().map_err(CudaError::driver("device count"))?;
        if count <= ordinal as i32 {
            return Err(Error::invalid(format!(
                "no CUDA device {ordinal} ({count} present)"
            )));
        }
        let (ctx, stream) = device_stream(ordinal)?;
        let blas = CudaBlas::new(stream.clone()).map_err(CudaError::blas("handle"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(CudaError::driver("compute capability"))?;
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
        for (file, embedded, target, required) in files {
            let source = compile::kernel_source(file, embedded);
            let src = &*source;
            let loaded = (|| -> Result<Vec<(String, Kernel)>> {
                let code = kernel_cache::compile_cached(file, src, &target)?;
                let ptx = Ptx::from_src(String::from_utf8_lossy(&code).into_owned());
                let module = ctx
                    .load_module(ptx)
                    .map_err(CudaError::driver(format!("module load of {file}")))?;
                signature::kernel_names(src)
                    .into_iter()
                    .map(|name| {
                        let function = module
                            .load_function(&name)
                            .map_err(CudaError::driver(format!("kernel lookup of {name}")))?;
                        let shared_allowed = AtomicU32::new(48 * 1024);
                        Ok((
                            name,
                            Kernel {
                                function,
                                shared_allowed,
                                resident: Mutex::default(),
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
        let limits = Limits::of(&ctx);
        Ok(Gpu {
            ctx,
            stream,
            blas,
            functions,
            name,
            arch,
            dependent_launches: major >= 9,
            next_serial: AtomicU64::new(1),
            registry: Mutex::new(Vec::new()),
            unavailable,
            free: Arc::default(),
            limits,
            tensor_maps: Default::default(),
        })
    }

    /// The stream every buffer, copy and kernel of this device is on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's CUDA ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Whether this device has kernel `name` (the Hopper-only kernels exist on Hopper alone).
    pub fn has_kernel(&self, name: &str) -> bool {
        self.functions.contains_key(name)
    }

    /// [`Gpu::launch`], returning what was launched.
    ///
    /// # Safety
    /// As [`Gpu::launch`].
    unsafe fn launch_traced(
        &self,
        sig: &Sig,
        name: &str,
        cfg: Launch,
        args: &[Arg],
    ) -> Result<Launched> {
        // SAFETY: the caller upholds `launch`'s contract.
        unsafe { self.launch(sig, name, cfg, args) }?;
        Ok(cfg.launched(name))
    }

    /// Launches kernel `name`, declared by `sig`, with `args`.
    ///
    /// # Safety
    /// Every pointer in `args` must be a live device allocation (or null where the kernel accepts
    /// null) large enough for every index the kernel computes from the other arguments and the
    /// launch shape, and any index the kernel reads from device memory must be in bounds too.
    /// The argument kinds are checked here against `sig`, and `sig` against the `.cu` source by
    /// a test, so a mismatch in count or type is an error, not a launch.
    unsafe fn launch(&self, sig: &Sig, name: &str, cfg: Launch, args: &[Arg]) -> Result<()> {
        // SAFETY: the caller upholds this function's contract.
        unsafe { self.launch_with(sig, name, cfg, args, LaunchMode::Plain) }
    }

    /// [`Gpu::launch`] of a kernel that waits (`griddepcontrol.wait`) for the kernel before it
    /// on the stream before reading what that kernel wrote: on sm_90 and later it is launched
    /// as a programmatic dependent, so its blocks are placed and started while the kernel
    /// before it finishes (that kernel lets them, `griddepcontrol.launch_dependents`), instead
    /// of after. Elsewhere a plain launch (the wait is compiled out).
    ///
    /// # Safety
    /// As [`Gpu::launch`]; and the kernel must not read memory the previous kernel writes
    /// before its wait.
    unsafe fn launch_dependent(
        &self,
        sig: &Sig,
        name: &str,
        cfg: Launch,
        args: &[Arg],
    ) -> Result<Launched> {
        // SAFETY: the caller upholds this function's contract.
        let mode = match self.dependent_launches {
            true => LaunchMode::Dependent,
            false => LaunchMode::Plain,
        };
        // SAFETY: the caller upholds this function's contract.
        unsafe { self.launch_with(sig, name, cfg, args, mode) }?;
        Ok(cfg.launched(name))
    }

    /// [`Gpu::launch`] with the grid's blocks in clusters of `size` along x (sm_90 and later:
    /// the blocks of a cluster run at once and reach each other's shared memory); with
    /// `dependent`, also as a programmatic dependent of the kernel before
    /// ([`Gpu::launch_dependent`]).
    ///
    /// # Safety
    /// As [`Gpu::launch`]; the grid's x extent is a multiple of `size`; with `dependent`, the
    /// kernel must not read memory the previous kernel writes before its wait.
    unsafe fn launch_cluster(
        &self,
        sig: &Sig,
        name: &str,
        cfg: Launch,
        args: &[Arg],
        size: u32,
        dependent: bool,
    ) -> Result<Launched> {
        if size == 0 || !cfg.grid.0.is_multiple_of(size) || !self.dependent_launches {
            return Err(Error::invalid(format!(
                "kernel {name}: clusters of {size} over a grid of {} blocks (or a device before sm_90)",
                cfg.grid.0
            )));
        }
        // SAFETY: the caller upholds this function's contract.
        unsafe { self.launch_with(sig, name, cfg, args, LaunchMode::Cluster(size, dependent)) }?;
        Ok(Launched {
            cluster: size,
            ..cfg.launched(name)
        })
    }

    unsafe fn launch_with(
        &self,
        sig: &Sig,
        name: &str,
        cfg: Launch,
        args: &[Arg],
        mode: LaunchMode,
    ) -> Result<()> {
        if !sig.matches(name) {
            return Err(Error::invalid(format!(
                "kernel {name} is not one of {}",
                sig.pattern
            )));
        }
        let elem = Elem::of_kernel(name);
        let kinds: Vec<Param> = args.iter().map(Arg::param).collect();
        let want: Vec<Param> = sig.params.iter().map(|p| p.resolve(elem)).collect();
        if kinds != want {
            return Err(Error::invalid(format!(
                "kernel {name}: arguments {kinds:?} for parameters {want:?}"
            )));
        }
        let kernel = self
            .functions
            .get(name)
            .ok_or_else(|| Error::invalid(format!("no CUDA kernel named {name}")))?;
        kernel.allow_shared(cfg.shared)?;
        if mode != LaunchMode::Plain {
            // SAFETY: as below; the values behind the parameter pointers live until the call
            // returns, and the driver copies them.
            return ledger::LEDGER
                .time(DriverCall::Launch, || unsafe {
                    self.launch_ex(&kernel.function, cfg, args, mode)
                })
                .map_err(|e| CudaError::driver(format!("launch of {name}"))(e));
        }
        let mut b = self.stream.launch_builder(&kernel.function);
        for a in args {
            match a {
                Arg::Ptr(_, v) | Arg::U64(v) => b.arg(v),
                Arg::U32(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::Map(v) => b.arg(v),
                Arg::StatsJobs(v) => b.arg(v),
            };
        }
        let config = LaunchConfig {
            grid_dim: cfg.grid,
            block_dim: (cfg.block, 1, 1),
            shared_mem_bytes: cfg.shared,
        };
        ledger::LEDGER
            .time(DriverCall::Launch, || {
                // SAFETY: the argument list matches the kernel's parameters in count and type
                // (checked above); the caller vouches for the pointers. `args` outlives the
                // launch call, which copies the values.
                unsafe { b.launch(config) }
            })
            .map_err(|e| CudaError::driver(format!("launch of {name}"))(e))?;
        Ok(())
    }

    /// cuLaunchKernelEx with programmatic stream serialization allowed, or with clusters.
    ///
    /// # Safety
    /// `args` match the kernel's parameters in count and type.
    unsafe fn launch_ex(
        &self,
        function: &cudarc::driver::CudaFunction,
        cfg: Launch,
        args: &[Arg],
        mode: LaunchMode,
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        use cudarc::driver::sys;
        use std::ffi::c_void;
        let mut params: Vec<*mut c_void> = args
            .iter()
            .map(|a| match a {
                Arg::Ptr(_, v) | Arg::U64(v) => v as *const u64 as *mut c_void,
                Arg::U32(v) => v as *const u32 as *mut c_void,
                Arg::F32(v) => v as *const f32 as *mut c_void,
                Arg::I32(v) => v as *const i32 as *mut c_void,
                Arg::Map(v) => v as *const _ as *mut c_void,
                Arg::StatsJobs(v) => v as *const _ as *mut c_void,
            })
            .collect();
        let (mut attrs, n) = launch_attrs::of(mode);
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid.0,
            gridDimY: cfg.grid.1,
            gridDimZ: cfg.grid.2,
            blockDimX: cfg.block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: cfg.shared,
            hStream: self.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: n,
        };
        self.ctx.bind_to_thread()?;
        // SAFETY: the function belongs to this context, the stream too; `params` holds one
        // pointer per kernel parameter, each to a value of the parameter's type.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                function.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
        }
    }

    /// The device's free and total memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(CudaError::driver("memory query"))
    }

    /// Waits for the stream (kernel errors surface here).
    pub fn synchronize(&self) -> Result<()> {
        ledger::LEDGER
            .time(DriverCall::Wait, || self.stream.synchronize())
            .map_err(CudaError::driver("kernel"))
    }

    /// The driver and cuBLAS calls made so far (by every device of the process), and their
    /// host time.
    pub fn driver_calls(&self) -> DriverCalls {
        ledger::LEDGER.totals()
    }

    /// The most shared memory one block may ask for (the opt-in limit).
    pub fn max_shared_per_block(&self) -> usize {
        self.limits.shared_per_block
    }

    /// Shared memory of one multiprocessor (what its resident blocks share).
    pub fn max_shared_per_multiprocessor(&self) -> usize {
        self.limits.shared_per_multiprocessor
    }

    /// How many blocks of kernel `name` (`threads` threads and `shared` bytes of dynamic shared
    /// memory each) one multiprocessor holds at once, as the driver reckons it from the
    /// kernel's registers and shared memory; `None` when it cannot say.
    pub fn resident_blocks(&self, name: &str, threads: u32, shared: u32) -> Option<usize> {
        let kernel = self.functions.get(name)?;
        let mut known = kernel.resident.lock().unwrap_or_else(|p| p.into_inner());
        *known.entry((threads, shared)).or_insert_with(|| {
            let blocks = kernel
                .function
                .occupancy_max_active_blocks_per_multiprocessor(threads, shared as usize, None)
                .ok()?;
            (blocks > 0).then_some(blocks as usize)
        })
    }

    /// Streaming multiprocessors of the device.
    pub fn multiprocessors(&self) -> usize {
        self.limits.multiprocessors
    }
}

/// What the launchers ask of the device on every call (variants, split counts, the GEMV's
/// grid), read from the driver once when it is opened.
struct Limits {
    shared_per_block: usize,
    shared_per_multiprocessor: usize,
    multiprocessors: usize,
}

impl Limits {
    fn of(ctx: &CudaContext) -> Limits {
        use cudarc::driver::sys::CUdevice_attribute::{
            CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN as OPTIN,
            CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR as PER_SM,
            CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT as SMS,
        };
        Limits {
            shared_per_block: ctx.attribute(OPTIN).map_or(48 * 1024, |v| v as usize),
            shared_per_multiprocessor: ctx.attribute(PER_SM).map_or(48 * 1024, |v| v as usize),
            multiprocessors: ctx.attribute(SMS).map_or(1, |v| v.max(1) as usize),
        }
    }
}
