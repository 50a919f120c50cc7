//! The stream-ordered allocator's memory pool (every buffer of a [`Gpu`] comes from it): kept
//! between waits, counted, and given back when the device is full.

use super::Gpu;
use crate::error::{CudaError, Result};
use cudarc::driver::CudaContext;

/// The device's default memory pool, from which the stream-ordered allocator (every buffer of a
/// [`Gpu`]) takes memory.
fn default_pool(ctx: &CudaContext) -> Result<cudarc::driver::sys::CUmemoryPool> {
    let mut pool = std::ptr::null_mut();
    // SAFETY: writes one pool handle for a device of a live context.
    unsafe { cudarc::driver::sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .map_err(CudaError::driver("default memory pool"))?;
    Ok(pool)
}

/// Makes the default pool keep the memory of freed buffers for the next allocations instead of
/// giving it back to the driver at every wait (its default): a traced op allocates and frees its
/// outputs and scratch between waits, and mapping that memory again cost every call tens of
/// microseconds. An allocation that finds the device full gives the kept memory back first
/// ([`Gpu::alloc_bytes`]).
pub(super) fn keep_freed_memory(ctx: &CudaContext) -> Result<()> {
    use cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    let pool = default_pool(ctx)?;
    let mut keep = u64::MAX;
    // SAFETY: the release threshold is a u64, passed by pointer, on a live pool.
    unsafe {
        cudarc::driver::sys::cuMemPoolSetAttribute(
            pool,
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep as *mut u64).cast(),
        )
    }
    .result()
    .map_err(CudaError::driver("memory pool threshold"))
}

impl Gpu {
    /// Bytes of the buffers alive now (the pool's memory in use, without what it or the free
    /// list keeps).
    pub fn buffers_in_use(&self) -> Result<usize> {
        use cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT;
        let pool = default_pool(&self.ctx)?;
        let mut used = 0u64;
        // SAFETY: the attribute is a u64, written through the pointer, of a live pool.
        unsafe {
            cudarc::driver::sys::cuMemPoolGetAttribute(
                pool,
                CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                (&mut used as *mut u64).cast(),
            )
        }
        .result()
        .map_err(CudaError::driver("memory pool use"))?;
        Ok((used as usize).saturating_sub(self.free.bytes()))
    }

    /// Gives the memory the pool keeps for later allocations back to the driver (the free
    /// list's buffers go back to the pool first, by the caller).
    pub(super) fn release_kept_memory(&self) -> Result<()> {
        let pool = default_pool(&self.ctx)?;
        self.synchronize()?;
        // SAFETY: trims a live pool; memory of live buffers is never released.
        unsafe { cudarc::driver::sys::cuMemPoolTrimTo(pool, 0) }
            .result()
            .map_err(CudaError::driver("memory pool trim"))
    }
}
