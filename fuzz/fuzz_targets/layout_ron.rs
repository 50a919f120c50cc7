//! Fuzzes RON layouts (`--layout FILE`): any text is a layout or an error naming the line.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(layout) = mladb::model::layout::Layout::from_ron_str(text, std::path::Path::new("fuzz.ron")) {
        common::walk(&layout);
    }
});
