//! NCCL between the GPUs of one host: the communicators of a tensor-parallel run's ranks (one
//! rank per device, all driven from this thread) and the all-reduce that joins them. NCCL is
//! loaded at run time through cudarc (a machine without it gets an error, never a panic).
//!
//! NVLink multicast (NVLS) is never asked for: `mladb` sets `NCCL_NVLS_ENABLE=0` at its start
//! unless the user set it, and a library caller gets it set before the first communicator.

use super::{DevBuf, Elem, Gpu};
use crate::error::{Error, Result};
use cudarc::nccl::{result, sys};
use std::sync::Arc;

/// Whether libnccl can be loaded (cudarc panics on its first call without it).
pub fn nccl_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

/// The version of the NCCL library loaded, as `2.28.3`.
pub fn nccl_version() -> Result<String> {
    require_nccl()?;
    let mut v: std::ffi::c_int = 0;
    // SAFETY: `v` is a valid place for the version.
    unsafe { sys::ncclGetVersion(&mut v) }
        .result()
        .map_err(|e| nccl_error("version", e))?;
    let v = v.max(0) as u32;
    // NCCL 2.9 on: major * 10000 + minor * 100 + patch.
    Ok(format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100))
}

fn require_nccl() -> Result<()> {
    match nccl_present() {
        true => Ok(()),
        false => Err(Error::invalid(
            "NCCL (libnccl.so) is not on the library path: install libnccl2 and libnccl-dev, or \
             add the directory of PyTorch's libnccl.so to LD_LIBRARY_PATH",
        )),
    }
}

fn nccl_error(what: &str, e: result::NcclError) -> Error {
    // SAFETY: NCCL returns a static string for every result code.
    let text = unsafe {
        let p = sys::ncclGetErrorString(e.0);
        match p.is_null() {
            true => format!("{:?}", e.0),
            false => std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned(),
        }
    };
    Error::invalid(format!("NCCL {what}: {text}"))
}

/// One communicator per rank over distinct devices of this host, rank r on `gpus[r]`.
pub struct NcclRanks {
    gpus: Vec<Arc<Gpu>>,
    comms: Vec<sys::ncclComm_t>,
}

// SAFETY: a communicator is a handle NCCL lets any thread use, one call at a time; the backend
// keeps its NcclRanks behind a mutex, so calls never overlap.
unsafe impl Send for NcclRanks {}

impl NcclRanks {
    /// The communicators of ranks on `gpus` (each a different device). Fails cleanly when NCCL
    /// is missing or refuses.
    pub fn new(gpus: Vec<Arc<Gpu>>) -> Result<NcclRanks> {
        require_nccl()?;
        let ordinals: Vec<std::ffi::c_int> = gpus.iter().map(|g| g.ordinal() as _).collect();
        for (i, o) in ordinals.iter().enumerate() {
            if ordinals[..i].contains(o) {
                return Err(Error::invalid(format!(
                    "NCCL joins ranks on different devices; device {o} holds two ranks"
                )));
            }
        }
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            // NVLink multicast stays off (see the module's doc).
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        let mut comms = vec![std::ptr::null_mut(); gpus.len()];
        // SAFETY: `comms` has one slot per device of `ordinals`, which has `gpus.len()` entries.
        unsafe { result::comm_init_all(comms.as_mut_ptr(), gpus.len() as _, ordinals.as_ptr()) }
            .map_err(|e| nccl_error("communicator setup", e))?;
        Ok(NcclRanks { gpus, comms })
    }

    /// The sum over ranks of `sends` (rank r's buffer on `gpus[r]`, all of one storage type and
    /// length): one new buffer per rank holding the sum, complete when this returns.
    pub fn all_reduce_sum(&self, sends: &[&DevBuf]) -> Result<Vec<DevBuf>> {
        let n = self.gpus.len();
        if sends.len() != n {
            return Err(Error::invalid(format!(
                "all-reduce over {n} ranks given {} buffers",
                sends.len()
            )));
        }
        let (elem, len) = (sends[0].elem(), sends[0].len());
        for (gpu, s) in self.gpus.iter().zip(sends) {
            if s.elem() != elem || s.len() != len || s.ordinal() != gpu.ordinal() {
                return Err(Error::invalid(
                    "all-reduce of buffers that differ in type or length, or that sit on \
                     another rank's device",
                ));
            }
        }
        let outs = self
            .gpus
            .iter()
            .map(|g| g.alloc(len, elem))
            .collect::<Result<Vec<_>>>()?;
        let ty = match elem {
            Elem::F32 => sys::ncclDataType_t::ncclFloat32,
            Elem::Bf16 => sys::ncclDataType_t::ncclBfloat16,
        };
        // SAFETY: group calls nest the per-rank calls below; each send and receive buffer holds
        // `len` values of `ty` on its communicator's device, and the streams are those devices'
        // streams (the ones every buffer was made on).
        unsafe {
            result::group_start().map_err(|e| nccl_error("group start", e))?;
            let mut failed = None;
            for r in 0..n {
                let called = result::all_reduce(
                    sends[r].ptr() as *const _,
                    outs[r].ptr() as *mut _,
                    len,
                    ty,
                    sys::ncclRedOp_t::ncclSum,
                    self.comms[r],
                    self.gpus[r].stream().cu_stream() as _,
                );
                if let Err(e) = called {
                    failed = Some(e);
                    break;
                }
            }
            let ended = result::group_end();
            if let Some(e) = failed {
                return Err(nccl_error("all-reduce", e));
            }
            ended.map_err(|e| nccl_error("all-reduce", e))?;
        }
        // Complete before the host reads or times anything (every rank's next op is on the
        // same stream, so this is for the host alone).
        for g in &self.gpus {
            g.synchronize()?;
        }
        Ok(outs)
    }
}

impl Drop for NcclRanks {
    fn drop(&mut self) {
        for &c in &self.comms {
            if !c.is_null() {
                // SAFETY: each communicator was made by `comm_init_all` and is destroyed once.
                let _ = unsafe { result::comm_destroy(c) };
            }
        }
    }
}
