//! Memory that re-runs leave behind. The debugger shares one backend across restarts and flag
//! changes, and every run makes a new engine with new KV caches: their device mirrors must go
//! with them. A hundred MLA-disable toggles through the controller keep the live caches flat on
//! the CPU, and on a GPU also the cache mirrors on the device; a hundred engines run and dropped
//! on one CUDA backend keep its device memory flat. The GPU test is ignored by default (cargo
//! counts it); `--include-ignored` runs it, and fails it without a GPU.

mod common;

use mladb::backend::cpu::CpuBackend;
use mladb::backend::cuda::{live_cache_mirrors, CudaBackend};
use mladb::backend::Backend;
use mladb::debug::controller::Controller;
use mladb::debug::Flags;
use mladb::engine::generate::{self, Schedule};
use mladb::engine::{Engine, EngineOptions, MlaPaths, NullObserver, StorageDtype};
use mladb::model::Model;
use mladb::ops::rows::live_caches;
use std::sync::{Arc, Mutex};

/// The counters are per process: the tests of this file run one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn model() -> Arc<Model> {
    Arc::new(common::synthetic("glm5-tiny", 21))
}

fn schedule(model: &Model) -> Schedule {
    Schedule {
        prompt: common::prompt(model.layout.vocab_size, 12),
        prefill_len: 6,
        decode_steps: 4,
    }
}

fn controller(backend: Arc<dyn Backend>) -> Controller {
    let model = model();
    let s = schedule(&model);
    let layers = 0..model.layout.num_layers;
    let mut c = Controller::new(model, backend, s, layers, Flags::default()).unwrap();
    // Paused near the end of the last decode step, so that the run's engine and caches are alive.
    c.continue_run();
    let total = c.current().events.len();
    c.restart();
    c.run_to(total - 8);
    assert_eq!(c.current().events.len(), total - 7);
    c
}

/// Toggles MLA disable `n` times; each change re-executes the paused run up to where it stood.
fn toggle(c: &mut Controller, n: usize) {
    let at = c.current().events.len();
    for i in 0..n {
        let value = if c.flags().mla_disable { "off" } else { "on" };
        c.set_flag("mla-disable", value)
            .unwrap_or_else(|e| panic!("toggle {i}: {e}"));
        assert!(
            c.current().error.is_none(),
            "toggle {i}: {:?}",
            c.current().error
        );
        assert_eq!(
            c.current().events.len(),
            at,
            "toggle {i} moved the position"
        );
    }
}

#[test]
fn a_hundred_flag_toggles_keep_the_caches_flat_on_the_cpu() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut c = controller(Arc::new(CpuBackend));
    toggle(&mut c, 4);
    let before = live_caches();
    toggle(&mut c, 100);
    let after = live_caches();
    eprintln!("live caches: {before} after 4 toggles, {after} after 104");
    assert!(before > 0, "the paused run holds no caches");
    assert!(
        after <= before,
        "caches grew from {before} to {after} over 100 flag toggles"
    );
    drop(c);
}

#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn a_hundred_flag_toggles_keep_device_memory_flat() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let cuda = common::cuda_backend(StorageDtype::F32);
    let cuda = Arc::new(cuda);
    let backend: Arc<dyn Backend> = cuda.clone();

    // Through the controller: the cache mirrors alive on the device stay as many.
    let mut c = controller(backend.clone());
    toggle(&mut c, 4);
    let (mirrors, bytes) = live_cache_mirrors();
    toggle(&mut c, 100);
    let (mirrors_after, bytes_after) = live_cache_mirrors();
    eprintln!(
        "cache mirrors: {mirrors} ({bytes} bytes) after 4 toggles, {mirrors_after} \
         ({bytes_after} bytes) after 104"
    );
    assert!(mirrors > 0, "the GPU runs made no cache mirrors");
    assert!(
        mirrors_after <= mirrors && bytes_after <= bytes,
        "cache mirrors grew over 100 toggles"
    );
    drop(c);

    // Engines made and dropped on one backend, as restarts do: device memory stays flat.
    let model = model();
    let s = schedule(&model);
    let run = || {
        let options = EngineOptions::all_layers(&model, MlaPaths::production());
        let mut engine = Engine::new(&model, &*backend, options).unwrap();
        generate::run(&mut engine, &s, &mut NullObserver).unwrap();
    };
    for _ in 0..4 {
        run();
    }
    let used = used_memory(&cuda);
    for _ in 0..100 {
        run();
    }
    let used_after = used_memory(&cuda);
    let (mirrors_left, _) = live_cache_mirrors();
    eprintln!(
        "device memory in use: {} MiB after 4 engines, {} MiB after 104; {mirrors_left} cache \
         mirrors alive",
        used >> 20,
        used_after >> 20
    );
    assert_eq!(mirrors_left, 0, "dropped engines left cache mirrors");
    // Buffers alive (the pool keeps freed memory, which is no leak); a leak of every run's
    // caches grows by more than the slack.
    assert!(
        used_after <= used + (8 << 20),
        "device memory grew from {used} to {used_after} bytes over 100 runs"
    );
}

fn used_memory(cuda: &CudaBackend) -> usize {
    cuda.gpu().synchronize().unwrap();
    cuda.gpu().buffers_in_use().unwrap()
}

/// A device buffer dropped is kept for the next allocation of its size, which takes it without
/// calling the driver (a decode step allocates the same sizes every layer); kept buffers are not
/// counted as in use, and another size still goes to the driver.
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn a_dropped_device_buffer_is_taken_again_without_the_driver() {
    use mladb::backend::cuda::device::Elem;
    use mladb::backend::DriverCall;
    use mladb::tensor::DeviceBuffer;
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let cuda = common::cuda_backend(StorageDtype::Bf16);
    let gpu = cuda.gpu();
    let allocations = || gpu.driver_calls().calls[DriverCall::Alloc as usize];
    let first = gpu.alloc(12_345, Elem::Bf16).unwrap();
    let address = first.address();
    let in_use = used_memory(&cuda);
    drop(first);
    assert!(
        used_memory(&cuda) < in_use,
        "a kept buffer still counts as in use"
    );
    let before = allocations();
    let again = gpu.alloc(12_345, Elem::Bf16).unwrap();
    assert_eq!(again.address(), address, "the kept buffer was not taken");
    assert_eq!(allocations(), before, "the driver was called");
    let other = gpu.alloc(12_346, Elem::Bf16).unwrap();
    assert_eq!(
        allocations(),
        before + 1,
        "another size did not go to the driver"
    );
    assert_ne!(other.address(), address);
}

/// Counts the downloads made for each decode op (between its event and the previous one).
struct Downloads<'b> {
    backend: &'b dyn Backend,
    last: u64,
    per_op: Vec<(String, u64)>,
}

impl Downloads<'_> {
    fn now(&self) -> u64 {
        let calls = self
            .backend
            .driver_calls()
            .expect("a device backend counts");
        calls.calls[mladb::backend::DriverCall::Download as usize]
    }
}

impl mladb::engine::trace::Observer for Downloads<'_> {
    fn on_op(
        &mut self,
        event: &mladb::engine::trace::OpEvent,
        _: &mladb::tensor::Tensor,
    ) -> mladb::error::Result<()> {
        let now = self.now();
        if matches!(event.phase, mladb::engine::trace::Phase::Decode(_)) {
            self.per_op.push((event.name.clone(), now - self.last));
        }
        self.last = now;
        Ok(())
    }

    fn wants_stats(&self) -> bool {
        false
    }
}

/// A decode step's new latent row goes from the op that made it into the cache's device mirror
/// by a device copy: nothing comes to the host for it (it used to be read back, a wait in the
/// middle of every layer, and uploaded again).
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn a_decode_step_keeps_its_latent_rows_on_the_device() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    for (name, backend, _) in common::gpu_backends() {
        let model = model();
        let s = schedule(&model);
        let options = EngineOptions::all_layers(&model, MlaPaths::production());
        let mut engine = Engine::new(&model, &*backend, options).unwrap();
        let mut seen = Downloads {
            backend: &*backend,
            last: 0,
            per_op: Vec::new(),
        };
        seen.last = seen.now();
        generate::run(&mut engine, &s, &mut seen).unwrap();
        let writes: Vec<&(String, u64)> = seen
            .per_op
            .iter()
            .filter(|(op, _)| op.ends_with("self_attn.latent_cache"))
            .collect();
        eprintln!("{name}: downloads of the decode ops' cache writes: {writes:?}");
        assert!(
            writes.len() >= s.decode_steps * model.layout.num_layers,
            "{name}: the decode steps wrote no latent rows"
        );
        assert!(
            writes.iter().all(|(_, n)| *n == 0),
            "{name}: a latent cache write read its rows back"
        );
    }
}

/// The small arrays a step repeats in every layer (its positions, the RoPE frequencies) go to
/// the device once: a second call with the same ones uploads nothing, and the result is the
/// same; other positions go up.
#[test]
#[ignore = "needs a GPU: tools/gpu_check.sh runs it with --include-ignored"]
fn repeated_positions_and_frequencies_go_up_once() {
    use mladb::backend::DriverCall;
    use mladb::ops::RopeTable;
    use mladb::tensor::Tensor;
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let cuda = common::cuda_backend(StorageDtype::F32);
    let uploads = || cuda.gpu().driver_calls().calls[DriverCall::Upload as usize];
    let table = RopeTable {
        inv_freq: vec![1.0, 0.25, 0.0625, 0.015625],
        attention_factor: 1.0,
    };
    let x = Tensor::from_vec(&[2, 3 * 8], (0..48).map(|i| i as f32 * 0.1).collect());
    let first = cuda.rope(&x, 3, &table, &[5, 6], true).unwrap();
    let before = uploads();
    let again = cuda.rope(&x, 3, &table, &[5, 6], true).unwrap();
    assert_eq!(
        uploads(),
        before,
        "the same positions and frequencies went up again"
    );
    assert_eq!(first.data(), again.data());
    let other = cuda.rope(&x, 3, &table, &[7, 8], true).unwrap();
    assert_eq!(uploads(), before + 1, "new positions did not go up");
    assert_ne!(first.data(), other.data());
}
