//! Fuzzes session files and their companion tensors (`replay`, `:load`): the input is split
//! into the session's text and the companion file's bytes, both written beside each other;
//! loading either must give a session or an error, and what loads must serve a replay's
//! questions (the schedule, the companion's tensors) and survive its own RON.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mladb::session::Session;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let p = common::parts(data, 2);
    let dir = common::scratch();
    let path = dir.join("fuzz.ron");
    std::fs::write(&path, p[0]).unwrap();
    std::fs::write(dir.join("fuzz.tensors.safetensors"), p[1]).unwrap();
    let Ok(session) = Session::load(&path) else {
        return;
    };
    let _ = session.schedule();
    let _ = session.load_tensors(&path);
    if let Ok(text) = session.to_ron() {
        Session::parse(&text).expect("a loaded session's RON reads back");
    }
});
