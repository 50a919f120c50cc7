#!/usr/bin/env python3
"""Writes the fixtures of `mladb import`'s SGLang path (needs torch and safetensors; run on the
GPU machine, where both are):

1. `tests/fixtures/sglang-dump/`: an activation dump (safetensors, keys PHASE/NAME, with mladb's
   dump metadata, e.g. transformers' via tools/hf_dump.py) rewritten as SGLang's dumper writes a
   run to disk with `DUMPER_ENABLE=1 DUMPER_NON_INTRUSIVE_MODE=all` (SGLang 0.5.23,
   sglang/srt/debug_utils/dumper.py): one `torch.save` file per tensor, named
   `step=S___rank=R___dump_index=I___name=NAME___recompute_status=disabled.pt` inside an
   experiment directory, each holding `{"value": tensor, "meta": {...}}`; each step begins with
   the forward batch's `input_ids` and `positions` (int64), then every module's output as
   `non_intrusive__MODULE.output`, in the module order of a forward pass.
2. `tests/fixtures/torch/`: a few single tensors saved by torch.save, the awkward cases of the
   format (a bf16 transposed view, an int64 vector, a parameter, an f16 tensor at a storage
   offset), with their values in `expected.json`.

    python3 tools/make_sglang_dump.py tests/fixtures/hf/glm5-sparse/hf-dump.safetensors \
        --phases prefill,decode.0,decode.1 --out tests/fixtures/sglang-dump --torch-out tests/fixtures/torch
"""

import argparse
import json
import os
import re
import shutil

import torch
from safetensors import safe_open


def natural(key):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def sglang_dump(src, phases, out):
    with safe_open(src, "pt") as f:
        meta = f.metadata()
        keys = list(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys}
    fed = json.loads(meta["tokens"]) + json.loads(meta.get("generated", "[]"))
    prefill = int(meta["prefill"])
    exp = os.path.join(out, "dump_glm5_sparse")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(exp)
    index = 0
    for step, phase in enumerate(phases):
        if phase == "prefill":
            tokens, start = fed[:prefill], 0
        else:
            k = int(phase.split(".")[1])
            tokens, start = fed[prefill + k:prefill + k + 1], prefill + k
        items = [("input_ids", torch.tensor(tokens, dtype=torch.int64)),
                 ("positions", torch.arange(start, start + len(tokens), dtype=torch.int64))]
        names = sorted((k.split("/", 1)[1] for k in keys if k.startswith(phase + "/")), key=natural)
        items += [(f"non_intrusive__{n}.output", tensors[f"{phase}/{n}"]) for n in names]
        for name, value in items:
            index += 1
            tags = {"step": step, "rank": 0, "dump_index": index, "name": name,
                    "recompute_status": "disabled"}
            file = "___".join(f"{k}={v}" for k, v in tags.items()) + ".pt"
            torch.save({"value": value.clone(),
                        "meta": dict(**tags, world_rank=0, world_size=1)},
                       os.path.join(exp, file))
    print(f"wrote {index} files for {len(phases)} steps under {exp}")


def torch_cases(out):
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    g = torch.Generator().manual_seed(7)
    base = torch.randn(3, 5, generator=g)
    cases = {
        # A transposed view: strides (1, 5) over a 15-element storage.
        "bf16_transposed": base.to(torch.bfloat16).t(),
        "int64": torch.tensor([3, -1, 154879, 0], dtype=torch.int64),
        "parameter": torch.nn.Parameter(torch.randn(2, 3, generator=g)),
        # Elements 4.. of a 12-element storage, saved as the view they are.
        "f16_offset": torch.randn(12, generator=g).to(torch.float16)[4:10].view(2, 3),
    }
    expected = {}
    for name, t in cases.items():
        torch.save({"value": t, "meta": {"name": name}}, os.path.join(out, f"{name}.pt"))
        expected[name] = {"shape": list(t.shape),
                          "values": [float(v) for v in t.detach().float().flatten()]}
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    print(f"wrote {len(cases)} torch files under {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dump")
    ap.add_argument("--phases", default="prefill,decode.0,decode.1")
    ap.add_argument("--out", required=True)
    ap.add_argument("--torch-out", required=True)
    args = ap.parse_args()
    print(f"torch {torch.__version__}")
    sglang_dump(args.dump, args.phases.split(","), args.out)
    torch_cases(args.torch_out)


if __name__ == "__main__":
    main()
