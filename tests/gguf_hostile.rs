//! Hostile GGUF files: each malformed field gives an error naming the problem, never a panic
//! or an allocation sized by the file's claims.

use mladb::gguf::{GgmlType, GgufFile, GgufWriter, Value};
use std::path::PathBuf;

/// A GGUF byte builder for files no honest writer would produce.
#[derive(Clone, Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    /// A metadata entry holding a u32.
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key).u32(4).u32(v)
    }
    /// A tensor-table entry.
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Zero bytes up to the next multiple of `a`, then `n` data bytes.
    fn pad_and_data(&mut self, a: usize, n: usize) -> &mut Self {
        let len = self.0.len().next_multiple_of(a) + n;
        self.0.resize(len, 0x11);
        self
    }
    fn parse(&self) -> Result<GgufFile, String> {
        GgufFile::from_bytes(self.0.clone()).map_err(|e| e.to_string())
    }
}

#[track_caller]
fn assert_err(r: &Raw, needles: &[&str]) {
    let e = match r.parse() {
        Ok(_) => panic!("parsed, expected an error containing {needles:?}"),
        Err(e) => e,
    };
    assert!(e.starts_with("<memory>: "), "errors name the file: {e}");
    for n in needles {
        assert!(e.contains(n), "expected '{n}' in: {e}");
    }
}

fn small_valid_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String("deepseek2".into()))
        .unwrap()
        .metadata("deepseek2.block_count", Value::U32(2))
        .unwrap()
        .metadata(
            "tokenizer.ggml.scores",
            Value::Array(mladb::gguf::Array::F32(vec![0.5; 7])),
        )
        .unwrap();
    w.tensor_f32("a", &[2, 4], &[1.0; 8]).unwrap();
    w.tensor("b", GgmlType::Q4_0, &[32], vec![0x33; 18])
        .unwrap();
    w.to_bytes().unwrap()
}

/// Prefixes shorter than the end of the last tensor's data are errors (of the truncation
/// kind); longer ones only lack trailing padding and still parse. `step` thins the prefixes.
fn check_truncations(bytes: &[u8], step: usize) {
    let full = GgufFile::from_bytes(bytes.to_vec()).unwrap();
    let end_of_data = full
        .tensors()
        .iter()
        .map(|t| full.data_start() + t.offset + t.n_bytes)
        .max()
        .unwrap() as usize;
    assert!(end_of_data <= bytes.len());
    for n in (0..bytes.len())
        .step_by(step)
        .chain([end_of_data - 1, end_of_data])
    {
        let r = GgufFile::from_bytes(bytes[..n].to_vec());
        if n < end_of_data {
            let e = r
                .expect_err(&format!("prefix of {n} bytes parsed"))
                .to_string();
            assert!(
                [
                    "truncated",
                    "past the end",
                    "hold at most",
                    "needs at least"
                ]
                .iter()
                .any(|k| e.contains(k)),
                "prefix {n}: {e}"
            );
        } else {
            assert!(r.is_ok(), "prefix {n} of {}: {:?}", bytes.len(), r.err());
        }
    }
}

#[test]
fn every_truncation_of_a_valid_file_is_an_error() {
    check_truncations(&small_valid_file(), 1);
}

#[test]
fn truncations_of_the_fixture_are_errors() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/quant_types.gguf");
    check_truncations(&std::fs::read(path).unwrap(), 3);
}

#[test]
fn bad_magic_and_versions() {
    let mut r = Raw::header(3, 0, 0);
    r.0[0] = b'g';
    assert_err(&r, &["not a GGUF file"]);
    assert_err(&Raw::header(1, 0, 0), &["version 1", "not supported"]);
    assert_err(&Raw::header(4, 0, 0), &["unsupported GGUF version 4"]);
    assert_err(&Raw::header(0, 0, 0), &["unsupported GGUF version 0"]);
    assert_err(&Raw::header(3u32.swap_bytes(), 0, 0), &["big-endian"]);
    assert!(Raw::header(2, 0, 0).parse().is_ok());
    assert!(Raw::header(3, 0, 0).parse().is_ok());
}

#[test]
fn huge_counts_are_refused_before_allocating() {
    assert_err(
        &Raw::header(3, 1 << 62, 0),
        &["claims 4611686018427387904 tensors"],
    );
    assert_err(&Raw::header(3, u64::MAX, 0), &["tensors", "hold at most 0"]);
    assert_err(
        &Raw::header(3, 0, u64::MAX),
        &["18446744073709551615 metadata entries"],
    );
    let mut r = Raw::header(3, 0, 1 << 40);
    r.kv_u32("a", 1);
    assert_err(&r, &["metadata entries", "hold at most 1"]);
}

#[test]
fn strings_past_the_end_of_the_file() {
    let mut r = Raw::header(3, 0, 1);
    r.u64(1 << 50).0.extend_from_slice(b"key and more bytes");
    assert_err(
        &r,
        &[
            "key of metadata entry #0",
            "length of 1125899906842624",
            "past the end",
        ],
    );
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(8).u64(u64::MAX);
    assert_err(&r, &["value of metadata 'k'", "past the end"]);
    let mut r = Raw::header(3, 1, 0);
    r.u64(100).u64(0).u64(0).u64(0).u64(0);
    assert_err(&r, &["name of tensor #0", "past the end"]);
}

#[test]
fn huge_and_malformed_arrays() {
    for elem in [0u32, 8, 9, 12] {
        let mut r = Raw::header(3, 0, 1);
        r.str("arr").u32(9).u32(elem).u64(1 << 60);
        assert_err(
            &r,
            &["'arr'", "array of 1152921504606846976", "needs at least"],
        );
    }
    let mut r = Raw::header(3, 0, 1);
    r.str("arr").u32(9).u32(13).u64(1).u8(0);
    assert_err(&r, &["'arr'", "unknown array element type 13"]);
    let mut r = Raw::header(3, 0, 1);
    r.str("arr").u32(9).u32(u32::MAX).u64(0);
    assert_err(&r, &["unknown array element type 4294967295"]);
    // arrays of arrays nested five deep
    let mut r = Raw::header(3, 0, 1);
    r.str("deep").u32(9);
    for _ in 0..5 {
        r.u32(9).u64(1);
    }
    r.u32(0).u64(0);
    assert_err(&r, &["'deep'", "nested deeper than 4"]);
    // a string element whose length runs past the end
    let mut r = Raw::header(3, 0, 1);
    r.str("toks").u32(9).u32(8).u64(2).str("ok").u64(1 << 40);
    assert_err(&r, &["element 1 of array 'toks'", "past the end"]);
}

#[test]
fn bad_metadata_values() {
    let mut r = Raw::header(3, 0, 1);
    r.str("k").u32(13).u32(0);
    assert_err(&r, &["metadata 'k' has unknown value type 13"]);
    let mut r = Raw::header(3, 0, 1);
    r.str("flag").u32(7).u8(2);
    assert_err(&r, &["'flag'", "byte 2", "not a bool"]);
    let mut r = Raw::header(3, 0, 1);
    r.u64(2).0.extend_from_slice(&[0xC3, 0x28]);
    r.u32(4).u32(0);
    assert_err(&r, &["not valid UTF-8"]);
    let mut r = Raw::header(3, 0, 2);
    r.kv_u32("twice", 1).kv_u32("twice", 2);
    assert_err(&r, &["'twice' appears twice"]);
    // an invalid UTF-8 string value is kept, with replacement characters
    let mut r = Raw::header(3, 0, 1);
    r.str("s").u32(8).u64(2).0.extend_from_slice(&[0xFF, b'a']);
    let f = r.parse().unwrap();
    assert_eq!(f.get_str("s").unwrap(), "\u{FFFD}a");
}

#[test]
fn bad_alignments() {
    for (a, needle) in [
        (0u32, "is 0"),
        (3, "is 3"),
        (48, "is 48"),
        (1 << 30, "is 1073741824"),
    ] {
        let mut r = Raw::header(3, 0, 1);
        r.kv_u32("general.alignment", a);
        assert_err(&r, &["general.alignment", needle, "power of two"]);
    }
    let mut r = Raw::header(3, 0, 1);
    r.str("general.alignment").u32(10).u64(32);
    assert_err(&r, &["general.alignment must be a u32", "u64 32"]);
    // a valid non-default alignment is honoured for the data start
    let mut r = Raw::header(3, 1, 1);
    r.kv_u32("general.alignment", 256)
        .tensor("t", &[4], 0, 0)
        .pad_and_data(256, 16);
    let f = r.parse().unwrap();
    assert_eq!((f.alignment(), f.data_start()), (256, 256));
}

#[test]
fn bad_tensor_shapes_and_types() {
    let with = |dims: &[u64], ty: u32| {
        let mut r = Raw::header(3, 1, 0);
        r.tensor("w", dims, ty, 0).pad_and_data(32, 64);
        r
    };
    assert_err(
        &with(&[1 << 32, 1 << 32, 2], 0),
        &["'w'", "overflows 64 bits"],
    );
    assert_err(&with(&[u64::MAX, 2], 0), &["'w'", "overflows 64 bits"]);
    assert_err(&with(&[1 << 62], 0), &["'w'", "byte size", "overflows"]);
    assert_err(&with(&[4, 0], 0), &["'w'", "dimension 1 is 0"]);
    assert_err(
        &with(&[2, 2, 2, 2, 2], 0),
        &["'w' has 5 dimensions", "at most 4"],
    );
    let mut r = Raw::header(3, 1, 0);
    r.str("w").u32(u32::MAX).u64(0).u64(0);
    assert_err(&r, &["'w' has 4294967295 dimensions"]);
    assert_err(&with(&[16], 77), &["'w' has unknown ggml type id 77"]);
    assert_err(&with(&[16], 4), &["unknown ggml type id 4"]);
    assert_err(&with(&[48], 8), &["'w'", "48 values", "Q8_0 blocks"]);
    assert_err(
        &with(&[1 << 40, 1 << 20], 0),
        &["'w'", "extends past the end"],
    );
    // zero dimensions: a scalar
    let f = with(&[], 0).parse().unwrap();
    assert_eq!(
        (f.tensors()[0].n_elements, f.tensors()[0].shape()),
        (1, vec![])
    );
    let mut r = Raw::header(3, 2, 0);
    r.tensor("w", &[4], 0, 0)
        .tensor("w", &[4], 0, 32)
        .pad_and_data(32, 64);
    assert_err(&r, &["tensor 'w' appears twice"]);
}

#[test]
fn bad_tensor_offsets() {
    let one = |offset: u64, data: usize| {
        let mut r = Raw::header(3, 1, 0);
        r.tensor("t", &[8], 0, offset).pad_and_data(32, data);
        r
    };
    assert!(one(0, 32).parse().is_ok());
    assert_err(
        &one(1, 64),
        &["'t'", "offset 1 is not a multiple of the alignment 32"],
    );
    assert_err(
        &one(32, 32),
        &["'t'", "32 bytes at data offset 32", "past the end"],
    );
    assert_err(&one(0, 31), &["'t'", "past the end"]);
    assert_err(&one(u64::MAX - 31, 32), &["'t'", "past the end"]);
    // the tensor table ends where the data should start, with no data at all
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[8], 0, 0);
    assert_err(
        &r,
        &["data section would start at offset 64", "past the end"],
    );
    // overlapping tensors
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[16], 0, 0)
        .tensor("b", &[8], 0, 32)
        .pad_and_data(32, 64);
    assert_err(&r, &["'a' (bytes 0..64) and 'b' (from 32) overlap"]);
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[8], 0, 0)
        .tensor("b", &[8], 0, 0)
        .pad_and_data(32, 64);
    assert_err(&r, &["overlap"]);
}

#[test]
fn unsupported_types_are_readable_but_do_not_dequantize() {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("iq", &[256], GgmlType::IQ2_XXS.id(), 0)
        .pad_and_data(32, GgmlType::IQ2_XXS.type_size());
    let f = r.parse().unwrap();
    assert_eq!(f.tensors()[0].ty, GgmlType::IQ2_XXS);
    assert_eq!(f.tensor_bytes("iq").unwrap().len(), 66);
    let e = f.dequantize("iq").unwrap_err().to_string();
    assert!(
        e.contains("'iq'") && e.contains("IQ2_XXS is not supported"),
        "{e}"
    );
    let e = f.dequantize("nope").unwrap_err().to_string();
    assert!(e.contains("'nope' is missing"), "{e}");
}

/// Every byte of the fixture's header region set to a few hostile values: errors or valid
/// files, never a panic; whatever parses also dequantizes without panicking.
#[test]
fn byte_mutations_of_the_header_never_panic() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/quant_types.gguf");
    let bytes = std::fs::read(path).unwrap();
    let header_end = GgufFile::from_bytes(bytes.clone()).unwrap().data_start() as usize;
    let mut parsed = 0;
    for i in 0..header_end {
        for v in [0x00u8, 0xFF, bytes[i] ^ 0x80, bytes[i].wrapping_add(1)] {
            let mut m = bytes.clone();
            m[i] = v;
            if let Ok(f) = GgufFile::from_bytes(m) {
                parsed += 1;
                for t in f.tensors() {
                    let _ = f.dequantize(&t.name);
                }
                for (_, v) in f.metadata() {
                    let _ = v.display(3);
                }
            }
        }
    }
    assert!(parsed > 0, "some mutations (in string bytes) still parse");
}

/// Hostile inputs (`tools/make_gguf_regress.py`) and those the fuzzer once crashed on
/// (fuzz/README.md), replayed: each parses and is walked (metadata rendered, tensors
/// dequantized), or fails with an error; never a panic. The folder must exist and hold them.
#[test]
fn fuzzer_regressions_stay_fixed() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/regress");
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (tools/make_gguf_regress.py writes it)",
            dir.display()
        )
    });
    let mut files = 0;
    let mut refused = Vec::new();
    for e in entries {
        let path = e.unwrap().path();
        files += 1;
        let bytes = std::fs::read(&path).unwrap();
        match GgufFile::from_bytes(bytes) {
            Ok(f) => {
                for (_, v) in f.metadata() {
                    let _ = v.display(8);
                }
                for t in f.tensors() {
                    if t.n_elements <= 1 << 22 {
                        let _ = f.dequantize(&t.name);
                    }
                    let _ = f.dequantize_rows(&t.name, 0..1);
                }
            }
            Err(e) => refused.push(format!(
                "{}: {e}",
                path.file_name().unwrap().to_string_lossy()
            )),
        }
    }
    assert!(files >= 20, "{} holds {files} inputs", dir.display());
    eprintln!(
        "{} of {files} refused:\n{}",
        refused.len(),
        refused.join("\n")
    );
}
