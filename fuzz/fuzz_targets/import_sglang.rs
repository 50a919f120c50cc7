//! Fuzzes `mladb import` of an SGLang dumper directory: the input is split into up to four
//! dump files; each part's first byte picks the file's tags (step, rank, and which of the names
//! the dumper writes: the batch's input_ids and positions, module outputs, another tensor), the
//! rest is the file (`torch.save` bytes). The directory is read into the importer (the
//! fixtures' glm5-sparse model, HF's module names, as the fixture's dump holds), which must
//! give a dump or an error, never a panic.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mladb::attach::import::Importer;
use mladb::attach::sglang_dump;

#[path = "common.rs"]
mod common;

/// The names a part's tag byte picks from (its low three bits).
const NAMES: [&str; 8] = [
    "input_ids",
    "positions",
    "non_intrusive__model.layers.0.self_attn.o_proj.output",
    "non_intrusive__model.layers.0.self_attn.kv_a_proj_with_mqa.output",
    "non_intrusive__model.embed_tokens.output",
    "non_intrusive__model.layers.0.mlp.output.0",
    "non_intrusive__lm_head.output",
    "hidden_states",
];

fuzz_target!(|data: &[u8]| {
    let dir = common::scratch();
    for (i, part) in common::parts(data, 4).into_iter().enumerate() {
        let Some((&tag, file)) = part.split_first() else {
            continue;
        };
        let (name, step, rank) = (NAMES[(tag & 7) as usize], (tag >> 3) & 3, (tag >> 5) & 1);
        let path = dir.join(format!(
            "step={step}___rank={rank}___dump_index={i}___name={name}.pt"
        ));
        std::fs::write(path, file).unwrap();
    }
    let Ok(files) = sglang_dump::dumper_files(&dir) else {
        return;
    };
    let Ok((ranks, _skipped)) = sglang_dump::records(&dir, files) else {
        return;
    };
    let map = mladb::debug::name_map::NameMap::resolve("hf").expect("a built-in map");
    let mut importer = Importer::new(common::fixture_layout(), Some(map));
    for (rank, records) in ranks {
        let mut cursor = None;
        for r in records {
            if importer
                .take(&mut cursor, r, &format!("rank {rank}"))
                .is_err()
            {
                return;
            }
        }
    }
    common::finish_import(importer);
});
