#!/usr/bin/env python3
"""Checks the hook's buffer watch on modules built the way vLLM and SGLang build their MLA
attention (needs torch; run on the GPU machine by tools/gpu_check.sh): for each engine a tiny
model whose attention wrapper hands its kernel an output buffer, run once clean and once with
the seed bug planted (the wrapper hands on a fresh tensor the kernel never wrote), its frames
written to a file by `mladb_hook.attach(..., engine=ENGINE)`, then `mladb import`ed: the
planted run must report `buffer-disconnect` at the expected modules, the clean run nothing.

The shapes follow the engines' code as read (vLLM 0.33.0 mla_attention.py, mla.py,
deepseek_v2.py, models/deepseek_v32; SGLang 0.5.23 radix_attention.py, deepseek_v2.py); the
numbers are made up (only pointers are checked).

    python3 tools/hook_engine_check.py --mladb target/release/mladb
"""

import argparse
import os
import subprocess
import sys
import tempfile

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import mladb_hook  # noqa: E402

D = 16  # hidden size = heads × v_head_dim


class MLAAttention(nn.Module):
    """vLLM's MLAAttention: allocates `output`, hands it to forward_impl, returns it."""

    def __init__(self, plant):
        super().__init__()
        self.plant = plant

    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output):
        output.copy_(q * 2.0)  # the kernel writes the buffer it was handed
        return output

    def forward(self, q, kv_c_normed, k_pe, output_shape):
        output = torch.empty(output_shape, dtype=q.dtype)
        self.forward_impl(q, kv_c_normed, k_pe, None, None, output=output)
        return torch.zeros(output_shape, dtype=q.dtype) if self.plant else output


class MultiHeadLatentAttentionWrapper(nn.Module):
    """vLLM's deepseek_v2.py path: the wrapper holds o_proj and the MLA layer."""

    def __init__(self, o_proj, plant):
        super().__init__()
        self.o_proj = o_proj
        self.mla_attn = MLAAttention(plant)

    def forward(self, x):
        return self.o_proj(self.mla_attn(x, x, x, x.shape))


class DeepseekV2MLAAttention(nn.Module):
    def __init__(self, plant):
        super().__init__()
        self.o_proj = nn.Linear(D, D, bias=False)
        self.mla_attn = MultiHeadLatentAttentionWrapper(self.o_proj, plant)

    def forward(self, x):
        return self.mla_attn(x)


class DeepseekV32Attention(MLAAttention):
    """vLLM's GLM-5 path on CUDA: the MLA layer itself, calling o_proj in its own forward."""

    def __init__(self, plant):
        super().__init__(plant)
        self.o_proj = nn.Linear(D, D, bias=False)

    def forward(self, x):
        output = torch.empty(x.shape, dtype=x.dtype)
        self.forward_impl(x, x, x, None, None, output=output)
        return self.o_proj(torch.zeros_like(output) if self.plant else output)


class RadixAttention(nn.Module):
    """SGLang's RadixAttention: returns what its attention backend wrote."""

    def __init__(self, width):
        super().__init__()
        self.width = width

    def forward(self, q, k, v, forward_batch):
        return q.repeat(1, self.width // q.shape[1]) * 2.0


class DeepseekV2AttentionMLA(nn.Module):
    """SGLang: the naive path (attn_mha, its output read by o_proj) on prefill, the absorbed
    path (attn_mqa's latent, through W_UV before o_proj) on decode."""

    def __init__(self, plant):
        super().__init__()
        self.plant = plant
        self.attn_mqa = RadixAttention(4 * D)
        self.attn_mha = RadixAttention(D)
        self.o_proj = nn.Linear(D, D, bias=False)
        self.w_vc = nn.Parameter(torch.randn(4 * D, D) / 8)

    def forward(self, x):
        if x.shape[0] > 1:
            out = self.attn_mha(x, x, x, None).reshape(x.shape[0], D)
            if self.plant:
                out = torch.zeros_like(out)
        else:
            out = self.attn_mqa(x, x, x, None) @ self.w_vc
        return self.o_proj(out)


class Layer(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.self_attn = attention

    def forward(self, x):
        return x + self.self_attn(x)


class Inner(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.embed_tokens = nn.Embedding(64, D)
        self.layers = nn.ModuleList([Layer(attention)])


class Model(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.model = Inner(attention)

    def forward(self, input_ids, positions):
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x)
        return x


CASES = {
    "vllm-deepseek-v3": ("vllm", DeepseekV2MLAAttention,
                         ["model.layers.0.self_attn.mla_attn.mla_attn", "model.layers.0.self_attn.o_proj.input"]),
    "vllm-glm5": ("vllm", DeepseekV32Attention, ["model.layers.0.self_attn.o_proj.input"]),
    "sglang": ("sglang", DeepseekV2AttentionMLA, ["model.layers.0.self_attn.o_proj.input"]),
}


def run_case(mladb, name, engine, attention, plant, expected, tmp):
    torch.manual_seed(0)
    model = Model(attention(plant))
    frames = os.path.join(tmp, f"{name}-{plant}.frames")
    with mladb_hook.attach(model, "file:" + frames, engine=engine), torch.no_grad():
        model(torch.tensor([5, 9, 3]), torch.tensor([0, 1, 2]))
        model(torch.tensor([7]), torch.tensor([3]))
    out = subprocess.run([mladb, "import", frames, "--layout", "glm5-tiny", "--name-map", engine,
                          "--out", os.path.join(tmp, f"{name}-{plant}.safetensors")],
                         capture_output=True, text=True)
    found = [line for line in out.stdout.splitlines() if line.startswith("finding: buffer-disconnect")]
    want = set(expected if plant else [])
    modules = {line.split(", ")[2].split(": ")[0] for line in found}
    ok = out.returncode == (1 if plant else 0) and modules == want
    print(f"{'ok  ' if ok else 'FAIL'} {name} {'planted' if plant else 'clean'}: import exit {out.returncode}, "
          f"{len(found)} disconnects" + "".join(f"\n       {line}" for line in found))
    if not ok:
        print(out.stdout + out.stderr)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mladb", required=True)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (engine, attention, expected) in CASES.items():
            for plant in (False, True):
                results.append(run_case(args.mladb, name, engine, attention, plant, expected, tmp))
    print(f"hook engine check: {sum(results)}/{len(results)} passed")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
