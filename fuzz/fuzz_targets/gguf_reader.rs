//! Fuzzes the GGUF reader: arbitrary bytes must parse or fail cleanly; whatever parses must
//! dequantize (where supported and not huge), render its metadata, and survive a round trip
//! through the writer unchanged.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mladb::gguf::{GgufFile, GgufWriter, Value, ALIGNMENT_KEY};

/// Tensors larger than this are not dequantized whole (the reader's own cap is 64 GiB, far
/// past libFuzzer's memory limit); a row range still is.
const MAX_VALUES: u64 = 1 << 22;

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    for (k, v) in f.metadata() {
        let _ = v.display(8);
        let _ = (
            v.as_u64(),
            v.as_i64(),
            v.as_f32(),
            v.as_f64(),
            v.as_bool(),
            v.as_str(),
        );
        if let Some(a) = v.as_array() {
            for i in 0..a.len().min(16) {
                assert!(a.get(i).is_some());
            }
            assert!(a.get(a.len()).is_none());
        }
        let _ = (f.get_u64(k), f.get_str(k), f.get_arr(k), f.get_f32(k));
    }
    for t in f.tensors() {
        assert_eq!(f.tensor_bytes(&t.name).unwrap().len() as u64, t.n_bytes);
        assert_eq!(t.shape().iter().product::<u64>(), t.n_elements);
        if t.ty.can_dequantize() {
            if t.n_elements <= MAX_VALUES {
                let all = f.dequantize(&t.name).unwrap();
                assert_eq!(all.len() as u64, t.n_elements);
            }
            if t.row_len() <= MAX_VALUES {
                let row = f.dequantize_rows(&t.name, 0..1).unwrap();
                assert_eq!(row.len() as u64, t.row_len());
            }
        } else {
            assert!(f.dequantize(&t.name).is_err());
        }
    }

    // Writer round trip: the same metadata (in any order), alignment and tensor bytes.
    let mut w = GgufWriter::new();
    w.alignment(f.alignment() as u32).unwrap();
    for (k, v) in f.metadata() {
        if k != ALIGNMENT_KEY {
            w.metadata(k.clone(), v.clone()).unwrap();
        }
    }
    for t in f.tensors() {
        w.tensor(t.name.clone(), t.ty, &t.shape(), f.tensor_data(t).to_vec())
            .unwrap();
    }
    let g = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(g.alignment(), f.alignment());
    let render = |f: &GgufFile| {
        let mut m: Vec<String> = f
            .metadata()
            .iter()
            .filter(|(k, _)| k != ALIGNMENT_KEY)
            .map(|(k, v)| format!("{k}={v:?}"))
            .collect();
        m.sort();
        m
    };
    assert_eq!(render(&g), render(&f));
    assert_eq!(g.tensors().len(), f.tensors().len());
    for (a, b) in f.tensors().iter().zip(g.tensors()) {
        assert_eq!((&a.name, a.ty, &a.dims), (&b.name, b.ty, &b.dims));
        assert_eq!(f.tensor_data(a), g.tensor_data(b));
    }
    let _: Option<&Value> = f.get("general.architecture");
});
