//! The kernels of `kernels/`, embedded in the binary and compiled at run time by NVRTC: to PTX
//! for the device at hand (the driver JIT-compiles it), or to a cubin for a named architecture
//! to report registers, shared memory and spills (`mladb kernels --arch sm_120`).

use super::variants::SOURCE as VARIANTS;
use crate::error::{CudaError, Error, Result};
use cudarc::nvrtc::{result as nvrtc, sys};
use std::ffi::CString;

const COMMON: &str = include_str!("../../../../kernels/common.cuh");
const MMA: &str = include_str!("../../../../kernels/mma.cuh");
const WGMMA: &str = include_str!("../../../../kernels/wgmma.cuh");
const TMA: &str = include_str!("../../../../kernels/tma.cuh");
const KV_FP8: &str = include_str!("../../../../kernels/kv_fp8.cuh");
const SPARSE: &str = include_str!("../../../../kernels/sparse.cuh");
const PAIR_MERGE: &str = include_str!("../../../../kernels/pair_merge_sm90.cuh");

/// (file name, source) of every kernel file.
pub const SOURCES: &[(&str, &str)] = &[
    (
        "elementwise.cu",
        include_str!("../../../../kernels/elementwise.cu"),
    ),
    ("norm.cu", include_str!("../../../../kernels/norm.cu")),
    ("rope.cu", include_str!("../../../../kernels/rope.cu")),
    ("stats.cu", include_str!("../../../../kernels/stats.cu")),
    ("router.cu", include_str!("../../../../kernels/router.cu")),
    ("mla.cu", include_str!("../../../../kernels/mla.cu")),
    ("indexer.cu", include_str!("../../../../kernels/indexer.cu")),
    ("dequant.cu", include_str!("../../../../kernels/dequant.cu")),
    (
        "attention.cu",
        include_str!("../../../../kernels/attention.cu"),
    ),
    (
        "mla_decode.cu",
        include_str!("../../../../kernels/mla_decode.cu"),
    ),
    (
        "mla_decode_splitk.cu",
        include_str!("../../../../kernels/mla_decode_splitk.cu"),
    ),
    (
        "flash_prefill.cu",
        include_str!("../../../../kernels/flash_prefill.cu"),
    ),
    ("kv_fp8.cu", include_str!("../../../../kernels/kv_fp8.cu")),
    (
        "mla_decode_fp8.cu",
        include_str!("../../../../kernels/mla_decode_fp8.cu"),
    ),
    (
        "mla_decode_fp8_h8.cu",
        include_str!("../../../../kernels/mla_decode_fp8_h8.cu"),
    ),
    (
        "mla_sparse_h8.cu",
        include_str!("../../../../kernels/mla_sparse_h8.cu"),
    ),
    (
        "cache_write.cu",
        include_str!("../../../../kernels/cache_write.cu"),
    ),
    ("experts.cu", include_str!("../../../../kernels/experts.cu")),
    ("gemv.cu", include_str!("../../../../kernels/gemv.cu")),
];

/// Kernel files for Hopper alone (compute capability 9.0, compiled for `sm_90a`: wgmma has no
/// portable form), loaded beside the portable kernels, never instead of them.
pub const HOPPER_SOURCES: &[(&str, &str)] = &[
    (
        "mla_decode_sm90.cu",
        include_str!("../../../../kernels/mla_decode_sm90.cu"),
    ),
    (
        "flash_prefill_sm90.cu",
        include_str!("../../../../kernels/flash_prefill_sm90.cu"),
    ),
];

/// The architecture-specific target a Hopper-only file is compiled for, given the target
/// (`sm_90`, `compute_90`) of the portable files; `None` where the file does not apply.
pub fn hopper_target(arch: &str) -> Option<String> {
    matches!(arch, "sm_90" | "compute_90" | "sm_90a" | "compute_90a")
        .then(|| format!("{}a", arch.trim_end_matches('a')))
}

/// The source with `common.cuh`, `mma.cuh`, `wgmma.cuh`, `tma.cuh`, `kv_fp8.cuh`, `sparse.cuh`,
/// `pair_merge_sm90.cuh` and `variants.cuh` inlined (NVRTC is given no include files), each
/// header as [`kernel_source`] gives it.
pub fn full_source(src: &str) -> String {
    [
        ("common.cuh", COMMON),
        ("mma.cuh", MMA),
        ("wgmma.cuh", WGMMA),
        ("tma.cuh", TMA),
        ("kv_fp8.cuh", KV_FP8),
        ("sparse.cuh", SPARSE),
        ("pair_merge_sm90.cuh", PAIR_MERGE),
        ("variants.cuh", VARIANTS),
    ]
    .iter()
    .fold(src.to_string(), |text, &(file, embedded)| {
        let include = format!("#include \"{file}\"");
        if text.contains(&include) {
            text.replace(&include, &kernel_source(file, embedded))
        } else {
            text
        }
    })
}

/// A folder whose kernel files replace the embedded ones of the same name, so that a kernel
/// author can try a change on a GPU machine without rebuilding mladb. The launchers, their
/// signatures and the shared-memory sizes of `variants.cuh` stay the binary's own.
pub const KERNEL_SRC_ENV: &str = "MLADB_KERNEL_SRC";

/// The source of kernel file `file`: the one in [`KERNEL_SRC_ENV`]'s folder when it is set and
/// holds that file, else the embedded one. Callers take a `.cu` file's source from here once,
/// before they compile or key it; headers are taken by [`full_source`].
pub fn kernel_source<'a>(file: &str, embedded: &'a str) -> std::borrow::Cow<'a, str> {
    std::env::var_os(KERNEL_SRC_ENV)
        .filter(|d| !d.is_empty())
        .and_then(|dir| source_in(std::path::Path::new(&dir), file))
        .map_or(
            std::borrow::Cow::Borrowed(embedded),
            std::borrow::Cow::Owned,
        )
}

/// `dir/file`'s text if it is a file (one that cannot be read, or is over 4 MiB, is reported on
/// stderr and the embedded one is used); each use is reported, so no run mistakes a tried
/// change for the shipped kernels.
fn source_in(dir: &std::path::Path, file: &str) -> Option<String> {
    let path = dir.join(file);
    if !path.is_file() {
        return None;
    }
    match crate::input::read_text_capped(&path, 4 << 20) {
        Ok(text) => {
            // Once per file and process: it is read for every file that includes it.
            static TOLD: std::sync::Mutex<Vec<std::path::PathBuf>> =
                std::sync::Mutex::new(Vec::new());
            let mut told = TOLD.lock().unwrap_or_else(|e| e.into_inner());
            if !told.contains(&path) {
                eprintln!("note: kernel source {file} taken from {}", path.display());
                told.push(path);
            }
            Some(text)
        }
        Err(e) => {
            eprintln!(
                "warning: {}: {e}; the built-in {file} is used",
                path.display()
            );
            None
        }
    }
}

/// What every refusal says where NVRTC cannot be loaded.
pub const NVRTC_NOT_FOUND: &str = "NVRTC (libnvrtc.so) is not on the library path";

/// Whether NVRTC can be loaded (probe before the first NVRTC call: cudarc panics otherwise).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library.
    unsafe { sys::is_culib_present() }
}

/// What compiling one file produced.
pub struct Compiled {
    /// PTX text, or the cubin bytes.
    pub code: Vec<u8>,
    /// NVRTC's log (warnings, and ptxas' resource report for cubins).
    pub log: String,
}

/// NVRTC's flags beside the target (the kernel cache's key holds them).
pub const NVRTC_FLAGS: &[&str] = &["--std=c++17", "--fmad=true", "-default-device"];

/// Compiles `name` for `arch`: `compute_XY` gives PTX, `sm_XY` a cubin (with ptxas' report).
pub fn compile(name: &str, src: &str, arch: &str) -> Result<Compiled> {
    if !nvrtc_present() {
        return Err(Error::invalid(format!(
            "{NVRTC_NOT_FOUND}: CUDA kernels cannot be compiled"
        )));
    }
    let cubin = arch.starts_with("sm_");
    let source = CString::new(full_source(src))
        .map_err(|_| Error::invalid(format!("{name}: NUL in source")))?;
    let cname = CString::new(name).expect("file names have no NUL");
    let mut options = vec![format!("--gpu-architecture={arch}")];
    options.extend(NVRTC_FLAGS.iter().map(|f| f.to_string()));
    if cubin {
        options.push("--ptxas-options=-v".to_string());
    }
    let fail = || CudaError::nvrtc(format!("on {name} for {arch}"));
    let prog = nvrtc::create_program(&source, Some(&cname)).map_err(fail())?;
    // SAFETY: `prog` is a live program until destroy_program below; options are valid C strings.
    let compiled = unsafe { nvrtc::compile_program(prog, &options) };
    // SAFETY: `prog` is live (destroyed only below).
    let log = unsafe { nvrtc::get_program_log(prog) }
        .map(|l| c_chars_to_string(&l))
        .unwrap_or_default();
    if compiled.is_err() {
        // SAFETY: `prog` is live and not used after this.
        unsafe {
            let _ = nvrtc::destroy_program(prog);
        }
        return Err(Error::invalid(format!(
            "{name} does not compile for {arch}:\n{log}"
        )));
    }
    let code = if cubin {
        // SAFETY: `prog` compiled (checked above) for a real architecture when `cubin`.
        unsafe { get_cubin(prog) }
    } else {
        // SAFETY: `prog` compiled (checked above).
        unsafe { nvrtc::get_ptx(prog) }
            .map(|p| c_chars_to_string(&p).into_bytes())
            .map_err(fail())
    };
    // SAFETY: `prog` is live and not used after this.
    unsafe {
        let _ = nvrtc::destroy_program(prog);
    }
    Ok(Compiled { code: code?, log })
}

fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// # Safety
/// `prog` must be a successfully compiled NVRTC program (for a real architecture).
unsafe fn get_cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>> {
    let mut size = 0usize;
    // SAFETY: the caller hands a compiled program; `size` is a valid place to write.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .map_err(CudaError::nvrtc("nvrtcGetCUBINSize"))?;
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` holds the `size` bytes NVRTC just said the CUBIN takes.
    unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char) }
        .result()
        .map_err(CudaError::nvrtc("nvrtcGetCUBIN"))?;
    Ok(buf)
}

/// What ptxas reports of one kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resources {
    pub function: String,
    pub registers: u32,
    pub shared_bytes: u32,
    /// Per-thread local memory: spills, and arrays the compiler could not keep in registers
    /// (indexed by a value it cannot resolve at compile time).
    pub stack_bytes: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// ptxas' resource report, one entry per kernel.
pub fn resources(log: &str) -> Vec<Resources> {
    let mut out = Vec::new();
    let mut current: Option<String> = None;
    let mut frame = (0, 0, 0);
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            current = rest.split('\'').next().map(str::to_string);
            frame = (0, 0, 0);
        } else if line.contains("bytes spill stores") {
            let nums: Vec<u32> = numbers(line);
            if nums.len() >= 3 {
                frame = (nums[0], nums[1], nums[2]);
            }
        } else if let (Some(f), true) = (
            &current,
            line.contains("Used") && line.contains("registers"),
        ) {
            out.push(Resources {
                function: f.clone(),
                registers: number_before(line, "registers").unwrap_or(0),
                shared_bytes: number_before(line, "bytes smem").unwrap_or(0),
                stack_bytes: frame.0,
                spill_stores: frame.1,
                spill_loads: frame.2,
            });
            current = None;
        }
    }
    out
}

fn numbers(line: &str) -> Vec<u32> {
    line.split(|c: char| !c.is_ascii_digit())
        .filter_map(|t| t.parse().ok())
        .collect()
}

fn number_before(line: &str, marker: &str) -> Option<u32> {
    let head = &line[..line.find(marker)?];
    head.split(|c: char| !c.is_ascii_digit())
        .rfind(|t| !t.is_empty())?
        .parse()
        .ok()
}

/// The compiled form a log and its cubin describe, for the CLI.
pub fn describe_version() -> String {
    if !nvrtc_present() {
        return "NVRTC not found".to_string();
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    unsafe {
        sys::nvrtcVersion(&mut major, &mut minor);
    }
    format!("NVRTC {major}.{minor}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn resources_reads_ptxas_reports() {
        let log = "ptxas info    : Compiling entry function 'mla_decode_t32' for 'sm_90'\n\
                   ptxas info    : Function properties for mla_decode_t32\n\
                   \x20   24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
                   ptxas info    : Used 236 registers, used 1 barriers, 400 bytes smem, 448 bytes cmem[0]\n\
                   ptxas info    : Compiling entry function 'fill_u32' for 'sm_90'\n\
                   ptxas info    : Used 10 registers, 372 bytes cmem[0]\n";
        let r = super::resources(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            (r[0].function.as_str(), r[0].registers, r[0].shared_bytes),
            ("mla_decode_t32", 236, 400)
        );
        assert_eq!(
            (r[0].stack_bytes, r[0].spill_stores, r[0].spill_loads),
            (24, 8, 12)
        );
        assert_eq!(
            (r[1].function.as_str(), r[1].registers, r[1].stack_bytes),
            ("fill_u32", 10, 0)
        );
    }

    #[test]
    fn a_kernel_folder_replaces_only_the_files_it_holds() {
        let dir = std::env::temp_dir().join(format!("mladb-kernel-src-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("norm.cu"), "// tried\n").unwrap();
        std::fs::write(dir.join("huge.cu"), vec![b'/'; (4 << 20) + 1]).unwrap();
        assert_eq!(
            super::source_in(&dir, "norm.cu").as_deref(),
            Some("// tried\n")
        );
        assert_eq!(
            super::source_in(&dir, "rope.cu"),
            None,
            "absent: the embedded one"
        );
        assert_eq!(
            super::source_in(&dir, "huge.cu"),
            None,
            "over the cap: the embedded one"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
