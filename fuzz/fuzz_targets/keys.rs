//! Fuzzes the TUI's keys file (`$MLADB_KEYS`): any text is a key map or an error, and a map
//! that loads can always be quit.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let dir = common::scratch();
    let path = dir.join("keys.ron");
    std::fs::write(&path, data).unwrap();
    if let Ok(map) = mladb::tui::keys::Keymap::with_overrides(&path) {
        let _ = map.help();
    }
});
