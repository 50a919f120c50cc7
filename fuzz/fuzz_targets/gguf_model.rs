//! Fuzzes the GGUF model loader (`--model FILE.gguf`): arbitrary bytes as a GGUF file; what
//! opens must give a layout that serves the engine's questions, and every tensor of its
//! catalogue must read (whole within a small budget, or its first row) or give an error,
//! kv_b_proj's stored form included: never a panic or an unbounded allocation.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let dir = common::scratch();
    let path = dir.join("model.gguf");
    std::fs::write(&path, data).unwrap();
    let Ok(model) = mladb::model::Model::gguf(&path, 64 << 20) else {
        return;
    };
    common::walk(&model.layout);
    let _ = model.has_quantized_kv_b();
    let names: Vec<String> = model.weights.catalog().iter().map(|(n, _)| n.clone()).collect();
    for name in names.iter().take(256) {
        if model.weights.size_bytes(name).is_ok_and(|b| b <= 16 << 20) {
            let _ = model.weights.get(name);
        }
        let _ = model.weights.rows(name, 0, 1);
        let _ = model.weights.quantized(name);
    }
});
