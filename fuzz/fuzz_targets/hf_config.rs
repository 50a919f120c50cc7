//! Fuzzes the import of an HF `config.json` (`layout import`, `--model`): any JSON must become
//! a layout or an error; a layout that validates must serve the engine's questions and survive
//! its RON.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    if let Ok(layout) = mladb::model::hf_config::layout_from_config(&value, "fuzz") {
        common::walk(&layout);
    }
});
