//! `mladb kernels --arch ARCH`: compiles every kernel of kernels/ through NVRTC for an
//! architecture and reports, per kernel, whether it compiled and its registers, shared memory
//! and spills. Needs no GPU, only NVRTC: this is how Blackwell (sm_100, sm_120) is checked here.
//! With `--out DIR` it also writes what it compiled, for reading the machine code
//! (`cuobjdump -sass`): ptxas' choices (a branch made into predicated instructions, registers
//! moved around an MMA) show only there.

use super::Out;
use crate::backend::cuda::compile::{
    compile, describe_version, hopper_target, kernel_source, nvrtc_present, resources,
    HOPPER_SOURCES, NVRTC_NOT_FOUND, SOURCES,
};
use crate::error::{Error, Result};
use crate::fsutil::write_atomic;
use clap::Args;
use std::path::{Path, PathBuf};

#[derive(Args, Debug, Clone)]
pub struct KernelsArgs {
    /// Architectures, comma-separated (sm_80, sm_90, sm_100, sm_120, or compute_XY for PTX only).
    #[arg(long, default_value = "sm_80,sm_90,sm_100,sm_120")]
    pub arch: String,
    /// Also write each file's compiled code under DIR: DIR/<target>/<file>.cubin (PTX as .ptx
    /// for compute_XY), Hopper files under sm_90a. Made if missing.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

/// The folder `--out` names, made if missing; refused before anything compiles when it is not a
/// folder.
fn out_dir(dir: &Path) -> Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(Error::invalid(format!(
            "--out {}: not a directory",
            dir.display()
        ))),
        Err(_) => std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e)),
    }
}

/// Writes one compiled file under `dir`: `<target>/<stem>.cubin` (or `.ptx`); returns its path.
fn write_code(dir: &Path, target: &str, file: &str, code: &[u8]) -> Result<PathBuf> {
    let sub = dir.join(target);
    std::fs::create_dir_all(&sub).map_err(|e| Error::io(&sub, e))?;
    let stem = file.strip_suffix(".cu").unwrap_or(file);
    let ext = if target.starts_with("sm_") {
        "cubin"
    } else {
        "ptx"
    };
    let path = sub.join(format!("{stem}.{ext}"));
    write_atomic(&path, code)?;
    Ok(path)
}

/// Returns whether every kernel compiled for every architecture.
pub fn run(args: &KernelsArgs) -> Result<bool> {
    let archs: Vec<&str> = args
        .arch
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .collect();
    for a in &archs {
        let ok = (a.starts_with("sm_") || a.starts_with("compute_"))
            && a[a.find('_').unwrap_or(0) + 1..]
                .chars()
                .all(|c| c.is_ascii_alphanumeric());
        if !ok {
            return Err(Error::invalid(format!(
                "--arch: '{a}' is not an architecture like sm_90 or compute_90"
            )));
        }
    }
    if let Some(dir) = &args.out {
        out_dir(dir)?;
    }
    writeln!(
        Out,
        "mladb kernels: {} for {}",
        describe_version(),
        archs.join(", ")
    )?;
    // Without NVRTC every file would fail alike: one error line instead of one per file.
    if !nvrtc_present() {
        return Err(Error::invalid(format!(
            "{NVRTC_NOT_FOUND}: CUDA kernels cannot be compiled (it comes with the CUDA toolkit, \
             or from PyPI as nvidia-cuda-nvrtc; put the folder holding libnvrtc.so on \
             LD_LIBRARY_PATH)"
        )));
    }
    let mut all_ok = true;
    for arch in &archs {
        let hopper = hopper_target(arch);
        let files = SOURCES
            .iter()
            .map(|&(file, src)| (file, src, arch.to_string()))
            .chain(
                HOPPER_SOURCES
                    .iter()
                    .filter_map(|&(file, src)| hopper.clone().map(|target| (file, src, target))),
            );
        for (file, src, target) in files {
            let arch = &target;
            match compile(file, &kernel_source(file, src), arch) {
                Ok(c) => {
                    let res = resources(&c.log);
                    writeln!(Out, "{arch:<8} {file:<16} ok ({} bytes)", c.code.len())?;
                    if let Some(dir) = &args.out {
                        let path = write_code(dir, arch, file, &c.code)?;
                        writeln!(Out, "           written to {}", path.display())?;
                    }
                    // ptxas' performance notes (for example wgmma serialised on Hopper).
                    for line in c.log.lines().filter(|l| l.contains("Performance")) {
                        writeln!(Out, "           note: {}", line.trim())?;
                    }
                    for r in res {
                        let warn = match (r.spill_stores + r.spill_loads > 0, r.stack_bytes > 0) {
                            (true, _) => "  SPILLS",
                            (false, true) => "  LOCAL MEMORY",
                            _ => "",
                        };
                        writeln!(
        Out,
                            "           {:<36} {:>3} registers {:>6} B smem  stack {:>4} B  spill st/ld {}/{}{warn}",
                            r.function, r.registers, r.shared_bytes, r.stack_bytes, r.spill_stores, r.spill_loads
                        )?;
                    }
                }
                Err(e) => {
                    all_ok = false;
                    writeln!(Out, "{arch:<8} {file:<16} FAILED")?;
                    for line in e.to_string().lines().take(20) {
                        writeln!(Out, "           {line}")?;
                    }
                }
            }
        }
    }
    if !archs.iter().any(|a| hopper_target(a).is_some()) {
        let files: Vec<&str> = HOPPER_SOURCES.iter().map(|(f, _)| *f).collect();
        writeln!(
            Out,
            "(Hopper-only files, built for sm_90a only: {})",
            files.join(", ")
        )?;
    }
    writeln!(
        Out,
        "{}",
        if all_ok {
            "all kernels compiled"
        } else {
            "some kernels did not compile"
        }
    )?;
    Ok(!all_ok)
}
