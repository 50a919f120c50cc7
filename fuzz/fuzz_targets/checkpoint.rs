//! Fuzzes the checkpoint loader (`--model DIR`): the input is split into config.json, a shard
//! index and one safetensors shard (header, dtypes, offsets); a folder of them must load or
//! give an error, and every tensor of what loads must read (within a small weight budget).

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let p = common::parts(data, 3);
    let dir = common::scratch();
    std::fs::write(dir.join("config.json"), p[0]).unwrap();
    if p[1].is_empty() {
        std::fs::write(dir.join("model.safetensors"), p[2]).unwrap();
    } else {
        std::fs::write(dir.join("model.safetensors.index.json"), p[1]).unwrap();
        std::fs::write(dir.join("model-00001-of-00001.safetensors"), p[2]).unwrap();
    }
    let Ok(model) = mladb::model::Model::hf_checkpoint(&dir, 64 << 20) else {
        return;
    };
    let names: Vec<String> = model.weights.catalog().iter().map(|(n, _)| n.clone()).collect();
    for name in names.iter().take(256) {
        if model.weights.size_bytes(name).is_ok_and(|b| b <= 16 << 20) {
            let _ = model.weights.get(name);
        }
        let _ = model.weights.rows(name, 0, 1);
    }
});
