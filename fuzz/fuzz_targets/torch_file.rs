//! Fuzzes the reader of `torch.save` files (SGLang's dumper leaves one per tensor; `mladb
//! import DIR`): arbitrary bytes as a file, and as a bare pickle. Whatever opens has every
//! value of its object offered to the tensor rebuild, which must give a tensor whose shape is
//! its values, or an error; nothing may panic or allocate without bound.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mladb::attach::pickle::{self, Value};
use mladb::attach::torch_file::TorchFile;

#[path = "common.rs"]
mod common;

/// The values of `v` and everything it holds, depth first, at most `budget` of them.
fn values<'a>(v: &'a Value, out: &mut Vec<&'a Value>, budget: usize) {
    if out.len() >= budget {
        return;
    }
    out.push(v);
    match v {
        Value::Dict(pairs) => pairs.iter().for_each(|(k, x)| {
            values(k, out, budget);
            values(x, out, budget);
        }),
        Value::List(items) | Value::Tuple(items) => {
            items.iter().for_each(|x| values(x, out, budget))
        }
        Value::Call { func, args, state } => {
            values(func, out, budget);
            values(args, out, budget);
            if let Some(s) = state {
                values(s, out, budget);
            }
        }
        Value::Persistent(x) => values(x, out, budget),
        _ => {}
    }
}

fuzz_target!(|data: &[u8]| {
    let _ = pickle::read(data);
    let dir = common::scratch();
    let path = dir.join("fuzz.pt");
    std::fs::write(&path, data).unwrap();
    let Ok(mut file) = TorchFile::open(&path) else {
        return;
    };
    let root = file.root.clone();
    let mut all = Vec::new();
    values(&root, &mut all, 256);
    for v in all {
        if let Ok(t) = file.tensor(v) {
            assert_eq!(
                t.shape.iter().product::<usize>(),
                t.data.len(),
                "a tensor's shape is its values"
            );
        }
    }
});
