#!/usr/bin/env python3
"""Writes tests/fixtures/gguf/regress/: small GGUF files built to break a reader (counts,
lengths, shapes and offsets that lie; nesting; bad alignment; unknown types), each a kind of
input a fuzzer or a hostile file produces. tests/gguf_hostile.rs replays every file in the
folder on each `cargo test`: it must parse or fail with an error, never panic or allocate
what the file claims. Inputs the GGUF fuzzer (fuzz/) crashes on are added to the same folder.

Usage: python3 tools/make_gguf_regress.py [OUT_DIR]
"""
import os
import struct
import sys

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)


def s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def kv_u32(key: bytes, v: int) -> bytes:
    return s(key) + struct.pack("<II", U32, v)


def tensor(name: bytes, dims, ty: int, offset: int) -> bytes:
    out = s(name) + struct.pack("<I", len(dims))
    for d in dims:
        out += struct.pack("<Q", d)
    return out + struct.pack("<IQ", ty, offset)


def pad(b: bytes, a: int = 32, data: int = 64) -> bytes:
    return b + b"\0" * ((-len(b)) % a) + b"\x11" * data


CASES = {
    "truncated_header.gguf": b"GGUF" + struct.pack("<I", 3) + b"\x01\x00",
    "huge_tensor_count.gguf": header(2**64 - 1, 0),
    "huge_kv_count.gguf": header(0, 2**63),
    "string_length_past_end.gguf": header(0, 1) + struct.pack("<Q", 2**40) + b"key" + b"\0" * 32,
    "array_length_huge.gguf": header(0, 1) + s(b"a") + struct.pack("<IIQ", ARRAY, U64, 2**61),
    "nested_arrays.gguf": header(0, 1)
    + s(b"a")
    + struct.pack("<I", ARRAY)
    + b"".join(struct.pack("<IQ", ARRAY, 1) for _ in range(4096))
    + struct.pack("<IQ", U8, 1)
    + b"\0",
    "unknown_value_type.gguf": header(0, 1) + s(b"k") + struct.pack("<II", 99, 0),
    "dims_product_overflow.gguf": pad(header(1, 0) + tensor(b"t", [2**32, 2**32, 16], 0, 0)),
    "zero_dim.gguf": pad(header(1, 0) + tensor(b"t", [0, 4], 0, 0)),
    "too_many_dims.gguf": pad(header(1, 0) + s(b"t") + struct.pack("<I", 2**31)),
    "offset_past_end.gguf": pad(header(1, 0) + tensor(b"t", [4, 4], 0, 2**50)),
    "misaligned_offset.gguf": pad(header(1, 0) + tensor(b"t", [4], 0, 3)),
    "overlapping_tensors.gguf": pad(
        header(2, 0) + tensor(b"a", [16], 0, 0) + tensor(b"b", [16], 0, 32), data=128
    ),
    "unknown_ggml_type.gguf": pad(header(1, 0) + tensor(b"t", [32], 1000, 0)),
    "q4_k_row_not_a_block.gguf": pad(header(1, 0) + tensor(b"t", [100, 2], 12, 0), data=512),
    "alignment_zero.gguf": pad(header(1, 1) + kv_u32(b"general.alignment", 0) + tensor(b"t", [4], 0, 0)),
    "alignment_not_power_of_two.gguf": pad(
        header(1, 1) + kv_u32(b"general.alignment", 24) + tensor(b"t", [4], 0, 0)
    ),
    "duplicate_tensor_names.gguf": pad(header(2, 0) + tensor(b"t", [4], 0, 0) + tensor(b"t", [4], 0, 32)),
    "duplicate_keys.gguf": header(0, 2) + kv_u32(b"k", 1) + kv_u32(b"k", 2),
    "invalid_utf8_key.gguf": header(0, 1) + s(b"\xff\xfe") + struct.pack("<II", U32, 1),
    "version_1.gguf": header(0, 0, version=1),
    "version_huge.gguf": header(0, 0, version=2**32 - 1),
}


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "tests", "fixtures", "gguf", "regress")
    os.makedirs(out, exist_ok=True)
    for name, data in CASES.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print(f"{len(CASES)} files in {out}")


if __name__ == "__main__":
    main()
