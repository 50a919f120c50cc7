"""Frames for mladb: what an engine's hook sends (the format is described at the top of mladb's
src/attach/wire.rs; version WIRE_VERSION).

Each frame: b"MLAW", the header's length (u32 little-endian), the payload's length (u64
little-endian), the header as compact JSON, then the payload (a tensor's bytes, row-major,
little-endian; nothing for the other frames). Only the standard library is needed here;
`tensor_from_array` takes anything with numpy's `dtype`, `shape` and `tobytes`.
"""

import json
import struct

MAGIC = b"MLAW"
WIRE_VERSION = 1

# Element sizes of the dtypes the format carries, by their names on the wire.
DTYPE_SIZES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i64": 8}
# numpy's names for them (numpy has no bfloat16: the hook sends a bf16 tensor's bits as int16
# and says bf16).
NUMPY_DTYPES = {"float32": "f32", "float16": "f16", "int32": "i32", "int64": "i64"}


def frame(header, payload=b""):
    """One frame: `header` (a dict with `kind`; `v` is added) and its payload bytes."""
    body = json.dumps({"v": WIRE_VERSION, **header}, separators=(",", ":")).encode("utf-8")
    return MAGIC + struct.pack("<IQ", len(body), len(payload)) + body + bytes(payload)


def hello(engine, model, rank=0, world_size=1):
    return frame({"kind": "hello", "engine": engine, "model": model, "rank": rank, "world_size": world_size})


def step(phase, step_index, tokens, positions):
    return frame({"kind": "step", "phase": phase, "step": step_index, "tokens": [int(t) for t in tokens],
                  "positions": [int(p) for p in positions]})


def tensor(module, dtype, shape, data, ptr=None, kernel_out_ptr=None):
    """A tensor frame from raw little-endian bytes; refuses bytes that are not the shape's size."""
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"mladb wire: dtype {dtype!r} is not one of {sorted(DTYPE_SIZES)}")
    shape = [int(d) for d in shape]
    need = DTYPE_SIZES[dtype]
    for d in shape:
        need *= d
    if len(data) != need:
        raise ValueError(f"mladb wire: tensor {module} ({dtype} {shape}) needs {need} bytes, got {len(data)}")
    header = {"kind": "tensor", "module": module, "dtype": dtype, "shape": shape}
    if ptr is not None:
        header["ptr"] = int(ptr)
    if kernel_out_ptr is not None:
        header["kernel_out_ptr"] = int(kernel_out_ptr)
    return frame(header, data)


def tensor_from_array(module, array, dtype=None, ptr=None, kernel_out_ptr=None):
    """A tensor frame from a numpy array (C order, little-endian); `dtype` overrides the wire
    dtype (`bf16` for int16 bits)."""
    wire_dtype = dtype or NUMPY_DTYPES.get(str(array.dtype))
    if wire_dtype is None:
        raise ValueError(f"mladb wire: numpy dtype {array.dtype} has no wire dtype")
    data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes(order="C")
    return tensor(module, wire_dtype, array.shape, data, ptr=ptr, kernel_out_ptr=kernel_out_ptr)


def bye(dropped=0):
    return frame({"kind": "bye", "dropped": int(dropped)})
