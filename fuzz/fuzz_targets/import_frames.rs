//! Fuzzes `mladb import` of hook frame files (`mladb_hook.attach(model, "file:...")`, `attach
//! --save`), the same frames `mladb attach` reads from a socket: the input is split into two
//! ranks' files; each is read frame by frame into the importer (the fixtures' glm5-sparse
//! model), which must give a dump or an error, never a panic or an unbounded allocation.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mladb::attach::import::Importer;
use mladb::attach::record::import_frames;
use mladb::attach::wire::Limits;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let p = common::parts(data, 2);
    let dir = common::scratch();
    // Small limits, so that a frame's lengths are checked against them rather than memory.
    let limits = Limits {
        max_header: 1 << 16,
        max_payload: 1 << 20,
    };
    let mut importer = Importer::new(common::fixture_layout(), None);
    for (rank, bytes) in p.iter().enumerate() {
        if bytes.is_empty() && rank > 0 {
            continue;
        }
        let file = dir.join(format!("rank{rank}.frames"));
        std::fs::write(&file, bytes).unwrap();
        if import_frames(&mut importer, &file, limits).is_err() {
            return;
        }
    }
    common::finish_import(importer);
});
