#!/usr/bin/env python3
"""Dumps every module output of an HF transformers forward pass, for `mladb check --reference`.

Runs a GLM-5 (glm_moe_dsa) or DeepSeek-V3 checkpoint the way `mladb run` schedules it: prefill
the first K prompt tokens, feed the rest one at a time against the KV cache, then decode N greedy
tokens. A forward hook on every module records its first tensor output, batch dimension dropped,
under `PHASE/MODULE` (PHASE is `prefill` or `decode.K`), in one safetensors file. mladb maps the
module names to its op names with tools/name-maps/hf.ron.

Usage (needs torch and transformers >= 5.13):
    python3 tools/hf_dump.py CHECKPOINT_DIR --tokens 3,141,59 --prefill 2 --decode 4 -o dump.safetensors
"""

import argparse
import json

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM


def first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            t = first_tensor(item)
            if t is not None:
                return t
    if hasattr(output, "to_tuple"):
        return first_tensor(output.to_tuple())
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", required=True, help="comma-separated prompt token ids")
    ap.add_argument("--prefill", type=int, default=None, help="prompt tokens prefilled at once (default: all)")
    ap.add_argument("--decode", type=int, default=0, help="greedy tokens after the prompt")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()

    prompt = [int(t) for t in args.tokens.split(",")]
    k = len(prompt) if args.prefill is None else args.prefill
    if not 1 <= k <= len(prompt):
        raise SystemExit("--prefill must be between 1 and the prompt length")
    config = AutoConfig.from_pretrained(args.model)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_pretrained(args.model, config=config, dtype=getattr(torch, args.dtype)).eval()

    dump = {}
    phase = ["prefill"]

    def hook(name):
        def record(module, inputs, output):
            t = first_tensor(output)
            if t is None or not t.is_floating_point():
                return
            if t.dim() > 1 and t.shape[0] == 1:
                t = t[0]
            dump[f"{phase[0]}/{name}"] = t.detach().float().contiguous().clone()

        return record

    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(hook(name))

    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt[:k]]), use_cache=True)
        cache, last = out.past_key_values, out.logits[0, -1]
        feed, step, generated = list(prompt[k:]), 0, []
        while feed or len(generated) < args.decode:
            if feed:
                token = feed.pop(0)
            else:
                token = int(last.argmax())
                generated.append(token)
            phase[0] = f"decode.{step}"
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache, last = out.past_key_values, out.logits[0, -1]
            step += 1
    meta = {"prompt": json.dumps(prompt), "prefill": str(k), "generated": json.dumps(generated), "model": args.model}
    save_file(dump, args.output, metadata=meta)
    print(f"{len(dump)} tensors from {step + 1} forward passes -> {args.output}")


if __name__ == "__main__":
    main()
