#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz targets (fuzz/seeds/TARGET/) from the project's own
small files: HF configs of the fixtures, the built-in layouts, a short recorded session with
and without its companion tensors, one tiny checkpoint (single shard and indexed), keys files.
Targets that take several files read one input split into parts, each but the last led by a
little-endian u16 length (fuzz/fuzz_targets/common.rs).

Usage: python3 tools/make_fuzz_seeds.py [path/to/mladb]   (default target/debug/mladb)
"""
import glob
import json
import os
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SEEDS = os.path.join(ROOT, "fuzz", "seeds")


def put(target: str, name: str, data: bytes) -> None:
    d = os.path.join(SEEDS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def parts(*ps: bytes) -> bytes:
    out = b""
    for p in ps[:-1]:
        assert len(p) < 65536, "a part longer than a u16 length"
        out += struct.pack("<H", len(p)) + p
    return out + ps[-1]


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def main() -> None:
    mladb = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "debug", "mladb")
    configs = sorted(glob.glob(os.path.join(ROOT, "tests/fixtures/hf/*/config.json")))
    configs += sorted(glob.glob(os.path.join(ROOT, "tests/fixtures/random/*/config.json")))[:4]
    for f in configs:
        put("hf_config", os.path.basename(os.path.dirname(f)) + ".json", read(f))
    for f in sorted(glob.glob(os.path.join(ROOT, "layouts/*.ron"))):
        put("layout_ron", os.path.basename(f), read(f))

    with tempfile.TemporaryDirectory() as tmp:
        run = [mladb, "run", "--layout", "glm5-tiny", "--layers", "0..1", "--tokens", "1,2", "--prefill", "2", "--decode", "0"]
        # The session target writes the companion as fuzz.tensors.safetensors beside fuzz.ron.
        plain = os.path.join(tmp, "plain", "fuzz.ron")
        full = os.path.join(tmp, "full", "fuzz.ron")
        os.makedirs(os.path.dirname(plain))
        os.makedirs(os.path.dirname(full))
        subprocess.run(run + ["--record", plain], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(run + ["--record", full, "--record-tensors"], check=True, stdout=subprocess.DEVNULL)
        put("session", "plain.bin", parts(read(plain), b""))
        put("session", "with_tensors.bin", parts(read(full), read(full.replace(".ron", ".tensors.safetensors"))))

    ckpt = os.path.join(ROOT, "tests/fixtures/random/deepseek-v3-01")
    config, shard = read(os.path.join(ckpt, "config.json")), read(os.path.join(ckpt, "model.safetensors"))
    header = json.loads(shard[8 : 8 + struct.unpack("<Q", shard[:8])[0]])
    index = {
        "metadata": {},
        "weight_map": {k: "model-00001-of-00001.safetensors" for k in header if k != "__metadata__"},
    }
    put("checkpoint", "single_shard.bin", parts(config, b"", shard))
    put("checkpoint", "indexed.bin", parts(config, json.dumps(index).encode(), shard))

    put("keys", "rebind.ron", b'{ "step": ["s", "f10"], "next-layer": ["f11"] }')
    put("keys", "empty.ron", b"{}")
    print("seeds written under", SEEDS)


if __name__ == "__main__":
    main()
