#!/usr/bin/env python3
"""Replays an activation dump (safetensors, keys PHASE/NAME, with mladb's dump metadata: what
tools/hf_dump.py and `mladb run --dump` write) to `mladb attach` through the hook's sender, as
the engine that made it would have sent it live: a `step` per phase with its tokens and
positions, then the phase's tensors. Standard library only (no torch, no numpy).

    mladb attach --listen 127.0.0.1:7777 --model tests/fixtures/hf/glm5-sparse &
    python3 tools/replay_dump.py tests/fixtures/hf/glm5-sparse/hf-dump.safetensors --address 127.0.0.1:7777

`--scale NAME=FACTOR` multiplies one tensor (PHASE/NAME) on the way, to plant a divergence.
"""

import argparse
import json
import os
import re
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from mladb_hook import Sender  # noqa: E402

WIRE_DTYPES = {"F32": "f32", "BF16": "bf16", "F16": "f16", "I32": "i32", "I64": "i64"}


def read_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {}) or {}
    return header, data, meta


def natural(key):
    """Sorts layer numbers as numbers: model.layers.2 before model.layers.10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def phase_order(phase):
    return (-1, 0) if phase == "prefill" else (int(phase.split(".")[1]), 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dump")
    ap.add_argument("--address", required=True, help="HOST:PORT, unix:PATH or file:PATH")
    ap.add_argument("--engine", default="hf", help="the engine named in the hello (picks mladb's name map)")
    ap.add_argument("--scale", action="append", default=[], help="PHASE/NAME=FACTOR: plant a divergence")
    args = ap.parse_args()

    header, data, meta = read_safetensors(args.dump)
    for key in ("tokens", "prefill"):
        if key not in meta:
            sys.exit(f"error: {args.dump} has no '{key}' metadata: its tokens are unknown")
    fed = json.loads(meta["tokens"]) + json.loads(meta.get("generated", "[]"))
    prefill = int(meta["prefill"])
    scales = {}
    for s in args.scale:
        name, _, factor = s.rpartition("=")
        scales[name] = float(factor)
    by_phase = {}
    for key, info in header.items():
        phase, _, name = key.partition("/")
        by_phase.setdefault(phase, []).append((name, info))
    sender = Sender(args.address, args.engine, meta.get("model", args.dump))
    for step_index, phase in enumerate(sorted(by_phase, key=phase_order)):
        if phase == "prefill":
            tokens, start = fed[:prefill], 0
        else:
            k = int(phase.split(".")[1])
            tokens, start = fed[prefill + k:prefill + k + 1], prefill + k
        sender.step("prefill" if phase == "prefill" else "decode", step_index, tokens,
                    list(range(start, start + len(tokens))))
        for name, info in sorted(by_phase[phase], key=lambda x: natural(x[0])):
            begin, end = info["data_offsets"]
            raw = data[begin:end]
            key = f"{phase}/{name}"
            if key in scales:
                if info["dtype"] != "F32":
                    sys.exit(f"error: --scale takes F32 tensors; {key} is {info['dtype']}")
                n = len(raw) // 4
                raw = struct.pack(f"<{n}f", *(x * scales[key] for x in struct.unpack(f"<{n}f", raw)))
            sender.tensor(name, WIRE_DTYPES[info["dtype"]], info["shape"], raw)
    sender.close()
    print(f"replayed {sum(len(v) for v in by_phase.values())} tensors over {len(by_phase)} steps")


if __name__ == "__main__":
    main()
