//! A dump is written a tensor at a time: writing one holds, beside the tensors' values, at most
//! a tensor's bytes, not the whole file (nor a byte copy of every tensor) in memory. This binary
//! counts its allocations (its own global allocator), so it holds this one test.

use mladb::cli::dump::write_dump;
use mladb::debug::external::DumpMeta;
use mladb::tensor_file::F32Tensor;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting the bytes live now and the most live since the last reset.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed to the system allocator unchanged; the counters are only read.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

#[test]
fn writing_a_dump_holds_one_tensors_bytes_at_most() {
    const TENSORS: usize = 16;
    const VALUES: usize = 1 << 20; // 4 MiB a tensor, 64 MiB in all
    let data: Vec<Vec<f32>> = (0..TENSORS)
        .map(|t| (0..VALUES).map(|i| (t * VALUES + i) as f32).collect())
        .collect();
    let names: Vec<String> = (0..TENSORS).map(|t| format!("prefill/op{t}")).collect();
    let shape = [VALUES];
    let meta = DumpMeta {
        tokens: vec![1],
        prefill: 1,
        decode: 0,
        generated: vec![],
        model: "test".into(),
        flags: "absorbed".into(),
        producer: "mladb test".into(),
        dtype: None,
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.safetensors");
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let tensors = names.iter().zip(&data).map(|(name, d)| F32Tensor {
        name: name.clone(),
        shape: &shape,
        data: d,
    });
    write_dump(&path, &meta, tensors).unwrap();
    let extra = PEAK.load(Ordering::Relaxed) - before;
    let tensor_bytes = VALUES * 4;
    assert!(
        extra <= 2 * tensor_bytes + (2 << 20),
        "writing a {} MiB dump held {} MiB beyond its values (one tensor is {} MiB)",
        (TENSORS * tensor_bytes) >> 20,
        extra >> 20,
        tensor_bytes >> 20
    );
    let file = std::fs::metadata(&path).unwrap().len() as usize;
    assert!(file > TENSORS * tensor_bytes, "the whole dump was written");
}
