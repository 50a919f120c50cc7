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
use std::sync::{Arc, Mutex};

/// Bytes the list keeps at most, and the largest buffer it keeps (larger ones, such as weights,
/// are freed as before).
const KEEP_BYTES: usize = 1 << 30;
const KEEP_ONE_BYTES: usize = 64 << 20;

/// One device's kept buffers.
#[derive(Default)]
pub struct FreeList(Mutex<Kept>);

/// The kept buffers by size in bytes, and their bytes in all.
#[derive(Default)]
struct Kept {
    by_size: HashMap<usize, Vec<CudaSlice<u8>>>,
    bytes: usize,
}

impl FreeList {
    /// A kept buffer of exactly `bytes`, if there is one.
    pub fn take(&self, bytes: usize) -> Option<CudaSlice<u8>> {
        let mut kept = self.lock();
        let slice = kept.by_size.get_mut(&bytes)?.pop()?;
        kept.bytes -= bytes;
        Some(slice)
    }

    /// Keeps `slice` for reuse, or frees it when it is large or the list is full.
    fn keep(&self, slice: CudaSlice<u8>) {
        let n = slice.len();
        let mut kept = self.lock();
        if n <= KEEP_ONE_BYTES && kept.bytes + n <= KEEP_BYTES {
            kept.bytes += n;
            kept.by_size.entry(n).or_default().push(slice);
        }
    }

    /// Frees every kept buffer (a full device gets their memory back).
    pub fn clear(&self) {
        let kept = std::mem::take(&mut *self.lock());
        drop(kept);
    }

    /// Bytes kept now.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        // A poisoned lock only means a thread panicked while holding it; the map is still whole.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
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
