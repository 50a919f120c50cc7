#!/usr/bin/env python3
"""Runs an HF transformers checkpoint (GLM-5 `glm_moe_dsa` or DeepSeek-V3) with mladb's hook
attached, so that `mladb attach` receives every module's output: the prompt prefilled, then
greedy decode steps. This is how the hook is used in a transformers process, and how it was
tested on the GPU machine.

    mladb attach --listen 127.0.0.1:7777 &
    python3 tools/hook_demo.py tests/fixtures/hf/glm5-sparse --address 127.0.0.1:7777 --tokens 1,2,3 --decode 2

Needs torch and transformers; the hook itself needs only torch (python/ on PYTHONPATH).
"""

import argparse
import os
import sys

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import mladb_hook  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--address", required=True, help="HOST:PORT, unix:PATH or file:PATH")
    ap.add_argument("--tokens", default="1,2,3", help="comma-separated prompt token ids")
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    args = ap.parse_args()

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval().to(args.device)
    prompt = [int(t) for t in args.tokens.split(",")]
    with mladb_hook.attach(model, args.address, engine="hf") as sender, torch.no_grad():
        out = model(input_ids=torch.tensor([prompt], device=args.device), use_cache=True)
        for _ in range(args.decode):
            token = int(out.logits[0, -1].argmax())
            out = model(input_ids=torch.tensor([[token]], device=args.device), past_key_values=out.past_key_values, use_cache=True)
    print(f"sent; {sender.dropped} tensors dropped")


if __name__ == "__main__":
    main()
