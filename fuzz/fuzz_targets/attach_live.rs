//! Fuzzes `mladb attach`'s live comparison, what an engine's hook reaches over a socket: the
//! input is split into two connections' byte streams, read frame by frame as the server reads
//! them, and each frame goes to the comparison, which runs mladb's reference (glm5-tiny, its
//! first two layers, on the CPU) for every step and compares every tensor. Whatever arrives
//! (steps of any length or position, tensors of any name, shape or dtype, ranks in any order)
//! must give comparisons, findings and notes, never a panic, and a prompt too long for the
//! memory limit is refused rather than run.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mladb::attach::live::{Comparator, Input};
use mladb::attach::wire::{read_frame, Limits};
use mladb::backend::cpu::CpuBackend;
use mladb::debug::flags::Flags;
use mladb::model::layout::Layout;
use mladb::model::Model;

#[path = "common.rs"]
mod common;

thread_local! {
    /// glm5-tiny's synthetic weights, made once per process.
    static MODEL: &'static Model = Box::leak(Box::new(
        Model::synthetic(Layout::resolve("glm5-tiny").expect("a built-in layout"), 0, 64 << 20)
            .expect("the synthetic model"),
    ));
}

fuzz_target!(|data: &[u8]| {
    let limits = Limits {
        max_header: 1 << 16,
        max_payload: 1 << 20,
    };
    MODEL.with(|model| {
        let flags = Flags::parse("").expect("the default flags");
        let mut comparator = Comparator::new(model, &CpuBackend, flags, 0..2, None, None);
        // A prefill of more than a few hundred tokens is refused: the fuzzer's inputs stay quick.
        comparator.max_memory_gb = Some(0.2);
        for (conn, bytes) in common::parts(data, 2).into_iter().enumerate() {
            let conn = conn as u64;
            let mut reader = bytes;
            while let Ok(Some(frame)) = read_frame(&mut reader, limits) {
                if let Some(input) = Input::of_frame(conn, &frame, None) {
                    let _ = comparator.take(input);
                }
            }
            let _ = comparator.take(Input::Closed { conn });
        }
        let _ = comparator.finish();
    });
});
