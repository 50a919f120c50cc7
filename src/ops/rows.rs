//! Cached rows as attention reads them: the trait every KV cache implements for the backends, and
//! the slot in which a backend keeps a cache's device copy, so that the copy lives exactly as long
//! as the cache (dropping an engine frees its caches' device memory).

use crate::tensor::BufferId;
use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Mirror slots alive: one per cache alive (for the tests that show caches are freed).
static LIVE_SLOTS: AtomicUsize = AtomicUsize::new(0);

/// How many caches (mirror slots) are alive in this process.
pub fn live_caches() -> usize {
    LIVE_SLOTS.load(Ordering::Relaxed)
}

/// Tokens per page (FlashMLA and vLLM's MLA backends use 64).
pub const PAGE_SIZE: usize = 64;

/// Something attention can read cached rows from.
pub trait RowSource: Sync {
    /// Number of cached tokens.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Row of token `t`.
    fn row(&self, t: usize) -> &[f32];
    /// The cache's identity (in the trace).
    fn id(&self) -> BufferId;
    /// Values per row.
    fn width(&self) -> usize;
    /// The slot of every write so far, in order: a device mirror replays the ones it has not
    /// seen yet.
    fn writes(&self) -> &[usize];
    /// For a paged cache, logical page → physical page.
    fn block_table(&self) -> Option<&[usize]> {
        None
    }
    /// Unwritten slots hold the poison pattern.
    fn poisoned(&self) -> bool {
        false
    }
    /// Where a device backend keeps its copy of these rows, freed with the cache.
    fn mirror(&self) -> &MirrorSlot;
    /// For a cache whose rows are kept as the tensors they were pushed in: the tensor holding
    /// row `t` and the row's index in it (a device backend copies such rows on the device), or
    /// none for a slot nothing wrote.
    fn pushed_rows(&self, _t: usize) -> Option<(&crate::tensor::Tensor, usize)> {
        None
    }
    /// How the cache stores its rows: for `fp8_ds_mla`, [`RowSource::row`] is a row after the
    /// format's round trip.
    fn kv_cache_dtype(&self) -> super::KvCacheDtype {
        super::KvCacheDtype::Bf16
    }
    /// For an fp8_ds_mla cache: the row last written to token `t`'s slot as it was before the
    /// round trip, and the codec faults of that write. A device backend quantizes it into its
    /// own byte cache with its write kernel, which gives the bytes the CPU codec gave.
    fn fp8_written(&self, _t: usize) -> Option<(&[f32], super::Fp8Faults)> {
        None
    }
}

/// Where a backend keeps its own copy of a cache (a device mirror). Owned by the cache: the copy
/// is dropped with it. Empty for host backends.
pub struct MirrorSlot(Mutex<Option<Box<dyn Any + Send + Sync>>>);

impl Default for MirrorSlot {
    fn default() -> MirrorSlot {
        LIVE_SLOTS.fetch_add(1, Ordering::Relaxed);
        MirrorSlot(Mutex::new(None))
    }
}

impl Drop for MirrorSlot {
    fn drop(&mut self) {
        LIVE_SLOTS.fetch_sub(1, Ordering::Relaxed);
    }
}

impl MirrorSlot {
    /// The slot's content, locked (a poisoned lock is taken over: the mirror is rebuilt by whoever
    /// finds it unusable).
    pub fn lock(&self) -> MutexGuard<'_, Option<Box<dyn Any + Send + Sync>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a backend has put a copy here.
    pub fn is_set(&self) -> bool {
        self.lock().is_some()
    }
}

impl std::fmt::Debug for MirrorSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_set() {
            "MirrorSlot(set)"
        } else {
            "MirrorSlot(empty)"
        })
    }
}
