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


def plant_disconnect(model):
    """The seed bug, in transformers: a wrapper around the attention kernel allocates its own
    output buffer and hands that on, while the kernel's result goes to a tensor nobody reads.
    Planted around whatever attention function the model dispatches to (after the hook is
    attached, so the hook still sees the kernel inside it); returns the undo."""
    from transformers.modeling_utils import AttentionInterface

    def phantom(kernel):
        def wrapper(module, *args, **kwargs):
            out, weights = kernel(module, *args, **kwargs)
            return torch.zeros_like(out), weights

        return wrapper

    impl = model.config._attn_implementation
    mapping = AttentionInterface._global_mapping
    if impl in mapping:
        kernel = mapping[impl]
        mapping[impl] = phantom(kernel)
        return lambda: mapping.__setitem__(impl, kernel)
    undo = []
    for name in {type(m).__module__ for m in model.modules()}:
        mod = sys.modules.get(name)
        kernel = getattr(mod, "eager_attention_forward", None)
        if callable(kernel):
            setattr(mod, "eager_attention_forward", phantom(kernel))
            undo.append(lambda mod=mod, kernel=kernel: setattr(mod, "eager_attention_forward", kernel))
    return lambda: [u() for u in undo]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--address", required=True, help="HOST:PORT, unix:PATH or file:PATH")
    ap.add_argument("--tokens", default="1,2,3", help="comma-separated prompt token ids")
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--attn", default=None, help="transformers attention implementation (eager, sdpa, ...)")
    ap.add_argument("--plant-disconnect", action="store_true",
                    help="patch the attention wrapper to hand o_proj a fresh buffer instead of the one its kernel wrote")
    args = ap.parse_args()

    extra = {"attn_implementation": args.attn} if args.attn else {}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype), **extra).eval().to(args.device)
    prompt = [int(t) for t in args.tokens.split(",")]
    with mladb_hook.attach(model, args.address, engine="hf") as sender, torch.no_grad():
        if args.plant_disconnect:
            plant_disconnect(model)
        out = model(input_ids=torch.tensor([prompt], device=args.device), use_cache=True)
        for _ in range(args.decode):
            token = int(out.logits[0, -1].argmax())
            out = model(input_ids=torch.tensor([[token]], device=args.device), past_key_values=out.past_key_values, use_cache=True)
    print(f"sent; {sender.dropped} tensors dropped")


if __name__ == "__main__":
    main()
