#!/usr/bin/env python3
"""Writes the GGUF test fixtures under tests/fixtures/gguf/ with gguf-py, the Python package
that ships with llama.cpp. mladb's GGUF tests compare against what this script writes.

Made with gguf 0.19.0 and numpy 2.4.6 (Python 3.11):

    python3 -m venv /tmp/gguf-venv && /tmp/gguf-venv/bin/pip install gguf numpy
    /tmp/gguf-venv/bin/python tools/make_gguf_fixtures.py

Outputs (deterministic for a given gguf/numpy version, seed fixed below):

* quant_types.gguf: metadata of every value type, and one tensor per ggml type mladb
  dequantizes (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K),
  named `quant.<TYPE>`, row-major shape [4, 256], plus `shape.q8_0_3d` of shape [2, 3, 64].
  The quantized blocks are random but valid: each block is assembled field by field, with
  random bytes for the packed quants and scales, and explicitly generated finite f16 values
  for the f16 fields (super-scales and mins), so the references are finite numbers.
* quant_types.ref.safetensors: for each tensor above, gguf-py's dequantization
  (`gguf.quants.dequantize`) as F32 under the same name and shape; plus `quantize.input`
  (F32) and gguf-py's quantization of it, `quantize.Q8_0` and `quantize.Q4_0` (U8 bytes),
  which gguf-py documents as bit-exact with ggml's reference quantizers.

It also writes small seed files for the fuzz target (fuzz/seeds/gguf_reader/): a metadata-only
file with every value type, and files holding one block of each supported tensor type.

The safetensors file is written by hand (8-byte header length, JSON header, data) to avoid
another dependency.
"""

import importlib.metadata
import json
import struct
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "gguf"
SEEDS = ROOT / "fuzz" / "seeds" / "gguf_reader"
SEED = 20260406
ROWS, COLS = 4, 256

# Block layouts, field by field: (field name, bytes, kind). kind "f16" fields get a generated
# finite half; "bytes" fields get uniformly random bytes (any bit pattern is a valid code).
LAYOUTS = {
    T.Q8_0: [("d", 2, "f16"), ("qs", 32, "bytes")],
    T.Q4_0: [("d", 2, "f16"), ("qs", 16, "bytes")],
    T.Q4_1: [("d", 2, "f16"), ("m", 2, "f16"), ("qs", 16, "bytes")],
    T.Q5_0: [("d", 2, "f16"), ("qh", 4, "bytes"), ("qs", 16, "bytes")],
    T.Q5_1: [("d", 2, "f16"), ("m", 2, "f16"), ("qh", 4, "bytes"), ("qs", 16, "bytes")],
    T.Q2_K: [("scales", 16, "bytes"), ("qs", 64, "bytes"), ("d", 2, "f16"), ("dmin", 2, "f16")],
    T.Q3_K: [("hmask", 32, "bytes"), ("qs", 64, "bytes"), ("scales", 12, "bytes"), ("d", 2, "f16")],
    T.Q4_K: [("d", 2, "f16"), ("dmin", 2, "f16"), ("scales", 12, "bytes"), ("qs", 128, "bytes")],
    T.Q5_K: [("d", 2, "f16"), ("dmin", 2, "f16"), ("scales", 12, "bytes"), ("qh", 32, "bytes"),
             ("qs", 128, "bytes")],
    T.Q6_K: [("ql", 128, "bytes"), ("qh", 64, "bytes"), ("scales", 16, "bytes"), ("d", 2, "f16")],
}


def random_f16(rng, n):
    """Finite halves of both signs spread over six decades (1e-5 .. 10), some subnormal."""
    mag = 10.0 ** rng.uniform(-5.0, 1.0, n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return (sign * mag).astype(np.float16)


def random_blocks(rng, qtype, n_blocks):
    layout = LAYOUTS[qtype]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert sum(n for _, n, _ in layout) == type_size, qtype.name
    fields = []
    for _name, n, kind in layout:
        if kind == "f16":
            fields.append(random_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2))
        else:
            fields.append(rng.integers(0, 256, size=(n_blocks, n), dtype=np.uint8))
    return np.concatenate(fields, axis=1)


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        dtype = {np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}[arr.dtype]
        data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def quantize_input(rng):
    """Gaussian blocks plus the cases where rounding rules show: ties, zeros, constants,
    equal magnitudes of both signs, tiny and huge scales."""
    blocks = [rng.standard_normal(32 * 24).astype(np.float32)]
    ties = np.arange(-15.5, 16.5, 1.0, dtype=np.float32)
    ties[0] = 127.0  # Q8_0: d = 1, so every k + 0.5 is a tie
    blocks.append(ties)
    blocks.append(np.zeros(32, np.float32))
    blocks.append(np.full(32, -3.0, np.float32))
    both = rng.standard_normal(32).astype(np.float32)
    both[3], both[20] = 5.0, -5.0  # Q4_0 takes the first of equal magnitudes
    blocks.append(both)
    blocks.append((rng.standard_normal(32) * 1e-7).astype(np.float32))  # subnormal f16 d
    blocks.append((rng.standard_normal(32) * 1e3).astype(np.float32))
    blocks.append(np.linspace(-8.0, 7.0, 32, dtype=np.float32))
    return np.concatenate(blocks)


def write_seed(path, fill):
    w = gguf.GGUFWriter(str(path), arch="deepseek2")
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_fuzz_seeds(rng):
    SEEDS.mkdir(parents=True, exist_ok=True)

    def metadata(w):
        w.add_uint8("a.u8", 1)
        w.add_int8("a.i8", -1)
        w.add_uint16("a.u16", 2)
        w.add_int16("a.i16", -2)
        w.add_uint32("a.u32", 3)
        w.add_int32("a.i32", -3)
        w.add_float32("a.f32", 0.5)
        w.add_uint64("a.u64", 4)
        w.add_int64("a.i64", -4)
        w.add_float64("a.f64", 0.25)
        w.add_bool("a.bool", False)
        w.add_string("a.str", "x")
        w.add_array("a.arr_str", ["p", "q"])
        w.add_array("a.arr_nested", [[1], [2, 3]])
    write_seed(SEEDS / "metadata.gguf", metadata)

    groups = [[T.F32, T.F16, T.BF16], [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1],
              [T.Q2_K, T.Q3_K], [T.Q4_K, T.Q5_K], [T.Q6_K]]
    for i, group in enumerate(groups):
        def tensors(w, group=group):
            w.add_custom_alignment(16 if i % 2 else 32)
            for qtype in group:
                block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
                if qtype in LAYOUTS:
                    w.add_tensor(f"t.{qtype.name}", random_blocks(rng, qtype, 1), raw_dtype=qtype)
                elif qtype == T.BF16:
                    raw = rng.integers(0, 256, size=(1, 8), dtype=np.uint8)
                    w.add_tensor(f"t.{qtype.name}", raw, raw_dtype=qtype)
                else:
                    dt = np.float32 if qtype == T.F32 else np.float16
                    w.add_tensor(f"t.{qtype.name}", rng.standard_normal((2, 2)).astype(dt))
        write_seed(SEEDS / f"tensors_{i}.gguf", tensors)


def main():
    rng = np.random.default_rng(SEED)
    write_fuzz_seeds(np.random.default_rng(SEED + 1))
    OUT.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(OUT / "quant_types.gguf"), arch="glm-dsa")
    w.add_custom_alignment(64)
    w.add_name("mladb quant fixture")
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_float32("test.f32", 0.15625)
    w.add_uint64("test.u64", 2**64 - 1)
    w.add_int64("test.i64", -(2**63))
    w.add_float64("test.f64", -2.5e300)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "GLM-5 ✓")
    w.add_key_value("test.arr_u16", [1, 2, 65535], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.UINT16)
    w.add_array("test.arr_i32", [-1, 0, 7])
    w.add_array("test.arr_f32", [0.5, -0.25])
    w.add_array("test.arr_bool", [True, False, True])
    w.add_array("test.arr_nested", [[1, 2], [3]])
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(100)])

    ref = {}
    for qtype in [T.F32, T.F16, T.BF16, *LAYOUTS]:
        name = f"quant.{qtype.name}"
        if qtype == T.F32:
            vals = rng.standard_normal((ROWS, COLS)).astype(np.float32)
            w.add_tensor(name, vals)
            ref[name] = vals
            continue
        if qtype == T.F16:
            vals = rng.standard_normal((ROWS, COLS)).astype(np.float16)
            flat = vals.reshape(-1)
            flat[:6] = [np.inf, -np.inf, 0.0, -0.0, 6.0e-8, 65504.0]
            w.add_tensor(name, vals)
            ref[name] = dequantize(vals.view(np.uint8), T.F16)
            continue
        if qtype == T.BF16:
            raw = rng.integers(0, 2**16, size=(ROWS, COLS), dtype=np.uint16).view(np.uint8)
            raw = raw.reshape(ROWS, COLS * 2)
        else:
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_blocks = ROWS * COLS // block_size
            raw = random_blocks(rng, qtype, n_blocks).reshape(ROWS, -1)
        w.add_tensor(name, raw, raw_dtype=qtype)
        ref[name] = dequantize(raw, qtype)
        assert ref[name].shape == (ROWS, COLS), (name, ref[name].shape)

    raw = random_blocks(rng, T.Q8_0, 2 * 3 * 2).reshape(2, 3, 2 * 34)
    w.add_tensor("shape.q8_0_3d", raw, raw_dtype=T.Q8_0)
    ref["shape.q8_0_3d"] = dequantize(raw, T.Q8_0)
    assert ref["shape.q8_0_3d"].shape == (2, 3, 64)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    x = quantize_input(rng)
    ref["quantize.input"] = x
    for qtype in (T.Q8_0, T.Q4_0):
        with np.errstate(over="ignore"):
            ref[f"quantize.{qtype.name}"] = quantize(x.reshape(1, -1), qtype).reshape(-1)
    write_safetensors(OUT / "quant_types.ref.safetensors", ref)
    for p in sorted(OUT.glob("quant_types*")) + sorted(SEEDS.glob("*.gguf")):
        print(f"{p.relative_to(ROOT)}: {p.stat().st_size} bytes")
    print(f"gguf {importlib.metadata.version('gguf')}, numpy {np.__version__}", file=sys.stderr)


if __name__ == "__main__":
    main()
