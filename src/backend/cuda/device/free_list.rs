//! Device memory kept for reuse: a buffer dropped goes back to its device's free list, and the
//! next allocation of the same size takes it without calling the driver. A traced decode step
//! allocates and frees some sixty small buffers of the same sizes every layer; each
//! allocation and free was a call into the stream-ordered allocator on the host's critical path.
//!
//! Reuse is safe in stream order, as the driver's own stream-ordered free is: every buffer of a
//! [`super::Gpu`] is used on its one stream, so work queued on a buffer before it was dropped
//! runs before work queued on it after it is taken again.

use cudarc::driver::CudaSlice;
use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Bytes the list keeps at most, and the largest buffer it keeps (larger ones, such as weights,
/// are freed as before).
const KEEP_BYTES: usize = 1 << 30;
const KEEP_ONE_BYTES: usize = 64 << 20;

/// One device's kept buffers, by size in bytes.
#[derive(Default)]
pub struct FreeList {
    kept: Mutex<HashMap<usize, Vec<CudaSlice<u8>>>>,
    bytes: AtomicUsize,
}

impl FreeList {
    /// A kept buffer of exactly `bytes`, if there is one.
    pub fn take(&self, bytes: usize) -> Option<CudaSlice<u8>> {
        let slice = self.lock().get_mut(&bytes)?.pop()?;
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
        Some(slice)
    }

    /// Keeps `slice` for reuse, or frees it when it is large or the list is full.
    fn keep(&self, slice: CudaSlice<u8>) {
        let n = slice.len();
        let room = n <= KEEP_ONE_BYTES && self.bytes.load(Ordering::Relaxed) + n <= KEEP_BYTES;
        if room {
            self.bytes.fetch_add(n, Ordering::Relaxed);
            self.lock().entry(n).or_default().push(slice);
        }
    }

    /// Frees every kept buffer (a full device gets their memory back).
    pub fn clear(&self) {
        let kept = std::mem::take(&mut *self.lock());
        self.bytes.store(0, Ordering::Relaxed);
        drop(kept);
    }

    /// Bytes kept now.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<usize, Vec<CudaSlice<u8>>>> {
        // A poisoned lock only means a thread panicked while holding it; the map is still whole.
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Device memory that goes back to its device's [`FreeList`] when dropped.
pub struct Block {
    slice: ManuallyDrop<CudaSlice<u8>>,
    home: Arc<FreeList>,
}

impl Block {
    pub fn new(slice: CudaSlice<u8>, home: Arc<FreeList>) -> Block {
        Block {
            slice: ManuallyDrop::new(slice),
            home,
        }
    }
}

impl Deref for Block {
    type Target = CudaSlice<u8>;
    fn deref(&self) -> &CudaSlice<u8> {
        &self.slice
    }
}

impl DerefMut for Block {
    fn deref_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.slice
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: `slice` is taken once, here, and the block is not used after.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        self.home.keep(slice);
    }
}
