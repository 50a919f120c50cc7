#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz targets (fuzz/seeds/TARGET/) from the project's own
small files: HF configs of the fixtures, the built-in layouts, a short recorded session with
and without its companion tensors, one tiny checkpoint (single shard and indexed), keys files,
hook frame files (the hook's own encoder), torch.save files and SGLang dumper files.
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

    # Hook frames (the hook's own encoder): a prefill and a decode step of the fixtures'
    # glm5-sparse model (hidden 64, vocab 256) with a few module outputs, one rank and two.
    sys.path.insert(0, os.path.join(ROOT, "python"))
    from mladb_hook import wire

    def f32(n: int) -> bytes:
        return struct.pack(f"<{n}f", *[0.01 * (i % 97) for i in range(n)])

    def rank_frames(rank: int, world: int, model: str = "glm5-sparse", hidden: int = 64, vocab: int = 256) -> bytes:
        out = wire.hello("hf", model, rank, world)
        for step, (tokens, positions) in enumerate([([1, 2, 3], [0, 1, 2]), ([4], [3])]):
            n = len(tokens)
            out += wire.step("prefill" if step == 0 else "decode", step, tokens, positions)
            out += wire.tensor("model.embed_tokens", "f32", [n, hidden], f32(n * hidden))
            out += wire.tensor("model.layers.0.self_attn.o_proj", "f32", [n, hidden], f32(n * hidden), ptr=4096, kernel_out_ptr=4096)
            out += wire.tensor("model.layers.0.self_attn.kv_a_proj_with_mqa", "bf16", [n, 48], f32(n * 24))
            out += wire.tensor("lm_head", "f32", [n, vocab], f32(n * vocab))
        return out + wire.bye(0)

    put("import_frames", "one_rank.bin", parts(rank_frames(0, 1), b""))
    put("import_frames", "two_ranks.bin", parts(rank_frames(0, 2), rank_frames(1, 2)))
    # The live comparison's target runs glm5-tiny (hidden 256, vocab 2048).
    put("attach_live", "one_rank.bin", parts(rank_frames(0, 1, "glm5-tiny", 256, 2048), b""))
    put("attach_live", "two_ranks.bin", parts(rank_frames(0, 2, "glm5-tiny", 256, 2048), rank_frames(1, 2, "glm5-tiny", 256, 2048)))

    # torch.save files: the single tensors of tests/fixtures/torch and a dumper file.
    dump = os.path.join(ROOT, "tests/fixtures/sglang-dump/dump_glm5_sparse")
    for f in sorted(glob.glob(os.path.join(ROOT, "tests/fixtures/torch/*.pt"))):
        put("torch_file", os.path.basename(f), read(f))
    files = {n: glob.glob(os.path.join(dump, f"step=0___rank=0___*___name={n}___*.pt"))[0]
             for n in ["input_ids", "positions", "non_intrusive__model.layers.0.self_attn.o_proj.output",
                       "non_intrusive__lm_head.output"]}
    put("torch_file", "dumper_o_proj.pt", read(files["non_intrusive__model.layers.0.self_attn.o_proj.output"]))
    # The SGLang target: each part's first byte is its name's index in the target's NAMES (low
    # three bits), its step (two bits above), its rank (the bit above those).
    tagged = [(0, "input_ids"), (1, "positions"), (2, "non_intrusive__model.layers.0.self_attn.o_proj.output"),
              (6, "non_intrusive__lm_head.output")]
    put("import_sglang", "step0.bin", parts(*[bytes([tag]) + read(files[n]) for tag, n in tagged]))

    # The GGUF model loader: the fixtures' two model files (gguf-py's, tools/make_gguf_fixtures.py),
    # linked rather than copied, so that the repository holds them once.
    d = os.path.join(SEEDS, "gguf_model")
    os.makedirs(d, exist_ok=True)
    for name in ["deepseek-v3-plain-split.gguf", "glm5-sparse-q.gguf"]:
        link = os.path.join(d, name)
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(os.path.join("..", "..", "..", "tests", "fixtures", "gguf", name), link)

    put("keys", "rebind.ron", b'{ "step": ["s", "f10"], "next-layer": ["f11"] }')
    put("keys", "empty.ron", b"{}")
    print("seeds written under", SEEDS)


if __name__ == "__main__":
    main()
