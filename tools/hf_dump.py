#!/usr/bin/env python3
"""Dumps every module output of an HF transformers forward pass, for `mladb check --reference`.

Runs a GLM-5 (glm_moe_dsa) or DeepSeek-V3 checkpoint the way `mladb run` schedules it: prefill
the first K prompt tokens, feed the rest one at a time against the KV cache, then decode N greedy
tokens. A forward hook on every module records its first tensor output, batch dimension dropped,
under `PHASE/MODULE` (PHASE is `prefill` or `decode.K`), in one safetensors file. mladb maps the
module names to its op names with tools/name-maps/hf.ron. The file's metadata says which run made
it (the keys of src/debug/external.rs, `meta_key`: tokens, prefill, decode count, model, settings,
producer), so `mladb check --reference` runs the same tokens and refuses a run of other ones.

Usage (needs torch and transformers >= 5.13):
    python3 tools/hf_dump.py CHECKPOINT_DIR --tokens 3,141,59 --prefill 2 --decode 4 -o dump.safetensors
"""

import argparse
import json

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

# The version of the metadata keys below (mladb's DUMP_FORMAT).
DUMP_FORMAT = 1


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


def dump_metadata(prompt, prefill, decode, generated, model, dtype):
    """The metadata mladb reads from a dump (src/debug/external.rs, `meta_key`)."""
    tokens = lambda ids: json.dumps([int(t) for t in ids], separators=(",", ":"))
    return {
        "dump_format": str(DUMP_FORMAT),
        "tokens": tokens(prompt),
        "prefill": str(prefill),
        "decode": str(decode),
        "generated": tokens(generated),
        "model": f"checkpoint {model}",
        "flags": f"transformers eager attention, {dtype}",
        "producer": f"tools/hf_dump.py (transformers {transformers.__version__}, torch {torch.__version__})",
        # A bf16 or f16 model's outputs carry its rounding: mladb judges them by bf16's tolerances.
        "dtype": {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype],
    }


def record(model_dir, prompt, k, decode, dtype="float32"):
    """Every module output of the schedule: {PHASE/MODULE: tensor}, and the generated tokens."""
    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=getattr(torch, dtype)).eval()

    dump = {}
    phase = ["prefill"]

    def hook(name):
        def keep(module, inputs, output):
            t = first_tensor(output)
            key = name
            if t is not None and name.endswith(".indexer"):
                # The DSA indexer returns the keys it keeps (integers): recorded as the choice
                # mladb compares as a choice (and reruns with, where it flipped within noise).
                key = name + ".topk"
            elif t is None or not t.is_floating_point():
                return
            if t.dim() > 1 and t.shape[0] == 1:
                t = t[0]
            dump[f"{phase[0]}/{key}"] = t.detach().float().contiguous().clone()

        return keep

    handles = [module.register_forward_hook(hook(name)) for name, module in model.named_modules() if name]

    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt[:k]]), use_cache=True)
        cache, last = out.past_key_values, out.logits[0, -1]
        feed, step, generated = list(prompt[k:]), 0, []
        while feed or len(generated) < decode:
            if feed:
                token = feed.pop(0)
            else:
                token = int(last.argmax())
                generated.append(token)
            phase[0] = f"decode.{step}"
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache, last = out.past_key_values, out.logits[0, -1]
            step += 1
    for h in handles:
        h.remove()
    return dump, generated, step + 1


def write(model_dir, prompt, k, decode, output, dtype="float32"):
    """Records the schedule and saves it with its metadata; returns (tensors, passes)."""
    dump, generated, passes = record(model_dir, prompt, k, decode, dtype)
    save_file(dump, output, metadata=dump_metadata(prompt, k, decode, generated, model_dir, dtype))
    return len(dump), passes


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
    tensors, passes = write(args.model, prompt, k, args.decode, args.output, args.dtype)
    print(f"{tensors} tensors from {passes} forward passes -> {args.output}")


if __name__ == "__main__":
    main()
