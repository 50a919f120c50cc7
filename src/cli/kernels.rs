//! `mladb kernels --arch ARCH`: compiles every kernel of kernels/ through NVRTC for an
//! architecture and reports, per kernel, whether it compiled and its registers, shared memory
//! and spills. Needs no GPU, only NVRTC: this is how Blackwell (sm_100, sm_120) is checked here.

use super::Out;
use crate::backend::cuda::compile::{
    compile, describe_version, hopper_target, kernel_source, resources, HOPPER_SOURCES, SOURCES,
};
use crate::error::{Error, Result};
use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct KernelsArgs {
    /// Architectures, comma-separated (sm_80, sm_90, sm_100, sm_120, or compute_XY for PTX only).
    #[arg(long, default_value = "sm_80,sm_90,sm_100,sm_120")]
    pub arch: String,
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
    writeln!(
        Out,
        "mladb kernels: {} for {}",
        describe_version(),
        archs.join(", ")
    )?;
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
