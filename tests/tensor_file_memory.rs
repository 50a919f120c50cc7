//! Dumps are written and read a tensor at a time: writing one holds, beside the tensors' values,
//! a buffer or two, and reading one holds the values it keeps and a buffer, not the whole
//! file (nor a byte copy of every tensor) in memory. This binary counts its allocations (its own
//! global allocator), so it holds these tests alone, and they take turns.

use mladb::cli::dump::write_dump;
use mladb::debug::external::{DumpMeta, ExternalDump};
use mladb::tensor_file::F32Tensor;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

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

/// The counters are the process's: one test measures at a time.
static TURN: Mutex<()> = Mutex::new(());

const TENSORS: usize = 16;
const VALUES: usize = 1 << 20; // 4 MiB a tensor, 64 MiB in all
const TENSOR_BYTES: usize = VALUES * 4;

/// Writes a 64 MiB dump of 16 tensors to `path`.
fn big_dump(path: &std::path::Path) {
    let data: Vec<Vec<f32>> = (0..TENSORS)
        .map(|t| (0..VALUES).map(|i| (t * VALUES + i) as f32).collect())
        .collect();
    let names: Vec<String> = (0..TENSORS).map(|t| format!("prefill/op{t}")).collect();
    let shape = [VALUES];
    let tensors = names.iter().zip(&data).map(|(name, d)| F32Tensor {
        name: name.clone(),
        shape: &shape,
        data: d,
    });
    write_dump(path, &meta(), tensors).unwrap();
}

fn meta() -> DumpMeta {
    DumpMeta {
        tokens: vec![1],
        prefill: 1,
        decode: 0,
        generated: vec![],
        model: "test".into(),
        flags: "absorbed".into(),
        producer: "mladb test".into(),
        dtype: None,
    }
}

#[test]
fn writing_a_dump_holds_its_values_and_a_buffer_or_two() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let data: Vec<Vec<f32>> = (0..TENSORS)
        .map(|t| (0..VALUES).map(|i| (t * VALUES + i) as f32).collect())
        .collect();
    let names: Vec<String> = (0..TENSORS).map(|t| format!("prefill/op{t}")).collect();
    let shape = [VALUES];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.safetensors");
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let tensors = names.iter().zip(&data).map(|(name, d)| F32Tensor {
        name: name.clone(),
        shape: &shape,
        data: d,
    });
    write_dump(&path, &meta(), tensors).unwrap();
    let extra = PEAK.load(Ordering::Relaxed) - before;
    assert!(
        extra <= 4 << 20,
        "writing a {} MiB dump held {} MiB beyond its values (one tensor is {} MiB)",
        (TENSORS * TENSOR_BYTES) >> 20,
        extra >> 20,
        TENSOR_BYTES >> 20
    );
    let file = std::fs::metadata(&path).unwrap().len() as usize;
    assert!(file > TENSORS * TENSOR_BYTES, "the whole dump was written");
}

/// Reading once held the file's bytes beside the values made from them (twice the values);
/// now it holds the values and a buffer.
#[test]
fn reading_a_dump_holds_its_values_and_a_buffer() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.safetensors");
    big_dump(&path);
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let dump = ExternalDump::load(&path, None, None).unwrap();
    let extra = PEAK.load(Ordering::Relaxed) - before;
    let values = TENSORS * TENSOR_BYTES;
    assert!(
        extra <= values + (4 << 20),
        "reading a {} MiB dump held {} MiB",
        values >> 20,
        extra >> 20
    );
    assert_eq!(dump.tensors.len(), TENSORS);
    let (_, last) = &dump.tensors[&("prefill".parse().unwrap(), "op15".to_string())];
    assert_eq!(last[7], (15 * VALUES + 7) as f32);
}
