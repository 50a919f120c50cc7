#!/usr/bin/env python3
"""Builds the HF-parity fixtures of mladb's tests with transformers as the oracle.

For each case it makes a tiny random GlmMoeDsaForCausalLM or DeepseekV3ForCausalLM in float32,
saves it as an HF checkpoint (config.json + model.safetensors) and records, in
reference.safetensors:

  prompt                      the prompt token ids (I32)
  prefill/logits              logits of a prefill of the whole prompt            [T, vocab]
  prefill/model.layers.I      output hidden state of decoder layer I              [T, hidden]
  cached.prefill/...          the same for a prefill of the first K tokens
  cached.decode.S/...         step S after that prefill: the remaining prompt tokens one by one,
                              then greedy tokens, each against the KV cache       [1, ...]

The metadata holds prefill_len (K), the generated tokens and the transformers version.

A case with `hf_dump` also gets hf-dump.safetensors: every module output of the prefill-then-
decode schedule, written by tools/hf_dump.py with the metadata `mladb check --reference` reads
(tokens, prefill, decode count, model, settings, producer). The committed dump was given that
metadata afterwards with tools/dump_metadata.py, which rewrites the header only.

Weights are re-drawn at healthy scales (projections ~ 1/sqrt(fan_in), norms near 1, a non-zero
router bias), and a case is accepted only if every routing and DSA top-k decision it makes has a
clear margin, so that float rounding in another engine cannot flip a choice.

Usage (needs torch and transformers >= 5.13):
    python3 tools/make_hf_fixtures.py tests/fixtures/hf
"""

import json
import math
import shutil
import sys
from pathlib import Path

import hf_dump
import torch
import transformers
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

# Choices closer than this (in score units) make a case unsafe to compare.
MIN_MARGIN = 2e-3

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)

CASES = {
    # GLM-5 structure; index_topk 4 < prompt length, so the indexer really selects; one layer
    # reuses the previous layer's selection.
    "glm5-sparse": dict(
        cls=(GlmMoeDsaConfig, GlmMoeDsaForCausalLM),
        config=dict(
            COMMON,
            num_hidden_layers=4,
            q_lora_rank=32,
            qk_nope_head_dim=16,
            v_head_dim=24,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            index_topk=4,
            index_head_dim=16,
            index_n_heads=4,
            indexer_types=["full", "full", "shared", "full"],
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        prompt_len=10,
        prefill_len=6,
        generate=3,
        hf_dump=True,
    ),
    # DeepSeek-V3 structure: YaRN RoPE with mscale != mscale_all_dim (so cos/sin carry an
    # attention factor and the softmax scale an mscale^2), group-limited routing, and
    # v_head_dim (12) different from qk_nope + qk_rope (24).
    "deepseek-v3-yarn": dict(
        cls=(DeepseekV3Config, DeepseekV3ForCausalLM),
        config=dict(
            COMMON,
            num_hidden_layers=3,
            q_lora_rank=32,
            qk_nope_head_dim=16,
            v_head_dim=12,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
            },
        ),
        prompt_len=9,
        prefill_len=5,
        generate=3,
    ),
    # DeepSeek-V3 variants: no q LoRA (plain q_proj), split-half RoPE, attention biases, two
    # shared experts, unnormalised routing weights, tied embeddings.
    "deepseek-v3-plain": dict(
        cls=(DeepseekV3Config, DeepseekV3ForCausalLM),
        config=dict(
            COMMON,
            num_hidden_layers=3,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            v_head_dim=24,
            n_routed_experts=8,
            n_shared_experts=2,
            num_experts_per_tok=3,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=2,
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
            rope_interleave=False,
            attention_bias=True,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            tie_word_embeddings=True,
        ),
        prompt_len=8,
        prefill_len=4,
        generate=2,
    ),
}

# DeepSeek-V3's official checkpoints store projections as FP8 E4M3 with one f32 scale per block
# (`weight_scale_inv`). This case stores the yarn model that way, with small blocks so that a
# matrix holds several; the reference outputs are transformers' on the dequantized weights.
CASES["deepseek-v3-fp8"] = dict(CASES["deepseek-v3-yarn"], fp8_block=[16, 16], prompt_len=7, prefill_len=4, generate=2)


def fp8_quantize(model, block):
    """Rounds every projection to FP8 blocks in place; returns {name: (fp8 bytes, scale_inv)}."""
    bh, bw = block
    stored = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 2 or not name.endswith("proj.weight") and "proj_with_mqa" not in name:
                continue
            rows, cols = p.shape
            sr, sc = -(-rows // bh), -(-cols // bw)
            scale = torch.empty(sr, sc)
            q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
            for i in range(sr):
                for j in range(sc):
                    blk = p[i * bh : (i + 1) * bh, j * bw : (j + 1) * bw]
                    s = blk.abs().max().clamp(min=1e-12) / 448.0
                    scale[i, j] = s
                    q[i * bh : (i + 1) * bh, j * bw : (j + 1) * bw] = (blk / s).to(torch.float8_e4m3fn)
            deq = q.to(torch.float32) * scale.repeat_interleave(bh, 0)[:rows].repeat_interleave(bw, 1)[:, :cols]
            p.copy_(deq)
            stored[name] = (q, scale)
    return stored


def redraw_weights(model, gen):
    """Healthy scales: projections ~ 1/sqrt(fan_in), norms near 1, biases small, router spread."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(2.0 * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            else:
                # Linear [out, in] and stacked experts [E, out, in]: fan_in is the last dim.
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


class MarginCheck:
    """Records the smallest margin of every routing and DSA top-k decision the model makes."""

    def __init__(self, model, config):
        self.config = config
        self.worst = math.inf
        self.where = ""
        self.keys = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            mlp = layer.mlp
            if hasattr(mlp, "gate") and hasattr(mlp.gate, "e_score_correction_bias"):
                self.handles.append(mlp.gate.register_forward_hook(self.router_hook(i)))
            indexer = getattr(layer.self_attn, "indexer", None)
            if indexer is not None:
                self.handles.append(indexer.register_forward_hook(self.indexer_hook(i), with_kwargs=True))

    def note(self, margin, where):
        if margin < self.worst:
            self.worst, self.where = margin, where

    def router_hook(self, layer):
        def hook(module, args, output):
            x = args[0].reshape(-1, module.hidden_dim).float()
            s = torch.sigmoid(x @ module.weight.float().T)
            choice = s + module.e_score_correction_bias
            e, g = module.num_experts, module.num_group
            group_scores = choice.view(-1, g, e // g).topk(2, dim=-1)[0].sum(-1)
            for t in range(x.shape[0]):
                gs = group_scores[t].sort(descending=True).values
                if module.topk_group < g:
                    self.note((gs[module.topk_group - 1] - gs[module.topk_group]).item(), f"layer {layer} groups")
                kept = group_scores[t].topk(module.topk_group).indices
                mask = torch.zeros(e, dtype=torch.bool)
                for k in kept:
                    mask[k * (e // g) : (k + 1) * (e // g)] = True
                c = choice[t].masked_fill(~mask, -math.inf).sort(descending=True).values
                if module.top_k < int(mask.sum()):
                    self.note((c[module.top_k - 1] - c[module.top_k]).item(), f"layer {layer} experts")

        return hook

    def indexer_hook(self, layer):
        def hook(module, args, kwargs, output):
            # Recompute the scores exactly as GlmMoeDsaIndexer.forward does, from its own inputs.
            names = ["hidden_states", "q_resid", "position_embeddings", "attention_mask"]
            vals = dict(zip(names, args))
            vals.update({k: v for k, v in kwargs.items() if k in names})
            hs, q_resid, (cos, sin), mask = (vals[n] for n in names)
            b, s, _ = hs.shape
            q = module.wq_b(q_resid).view(b, s, module.n_heads, module.head_dim)
            q_rot, q_pass = torch.split(q, [module.qk_rope_head_dim, module.head_dim - module.qk_rope_head_dim], -1)
            k = module.k_norm(module.wk(hs)).unsqueeze(2)
            k_rot, k_pass = torch.split(k, [module.qk_rope_head_dim, module.head_dim - module.qk_rope_head_dim], -1)
            from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

            q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
            q = torch.cat([q_rot, q_pass], -1)
            k_new = torch.cat([k_rot, k_pass], -1).squeeze(2)
            # The key cache was already extended by the forward call; rebuild the full key set.
            keys = self.keys.setdefault(layer, [])
            keys.append(k_new)
            k_all = torch.cat(keys, dim=1)
            scores = torch.relu(q.float() @ k_all.transpose(-1, -2).float().unsqueeze(1) * module.softmax_scale)
            w = module.weights_proj(hs).float() * module.n_heads**-0.5
            idx = (w.unsqueeze(-2) @ scores).squeeze(-2)[0]  # [S, T]
            t_total = idx.shape[-1]
            for i in range(s):
                pos = t_total - s + i
                causal = idx[i, : pos + 1]
                if causal.numel() > module.index_topk:
                    v = causal.sort(descending=True).values
                    scale = max(v.abs().max().item(), 1e-6)
                    self.note(((v[module.index_topk - 1] - v[module.index_topk]) / scale).item(), f"layer {layer} dsa")

        return hook

    def reset_keys(self):
        self.keys = {}

    def remove(self):
        for h in self.handles:
            h.remove()


def layer_hooks(model, store, prefix):
    handles = []
    for i, layer in enumerate(model.model.layers):
        def hook(module, args, output, i=i):
            out = output[0] if isinstance(output, tuple) else output
            store[f"{prefix}/model.layers.{i}"] = out[0].detach().clone()

        handles.append(layer.register_forward_hook(hook))
    return handles


def build(name, case, seed):
    config_cls, model_cls = case["cls"]
    config = config_cls(**case["config"])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    redraw_weights(model, gen)
    prompt = torch.randint(0, config.vocab_size, (case["prompt_len"],), generator=gen)
    fp8 = fp8_quantize(model, case["fp8_block"]) if "fp8_block" in case else None
    return config, model, prompt, fp8


@torch.no_grad()
def references(model, prompt, case, check):
    ref = {}
    # 1. One prefill of the whole prompt.
    check.reset_keys()
    handles = layer_hooks(model, ref, "prefill")
    out = model(input_ids=prompt[None], use_cache=False)
    ref["prefill/logits"] = out.logits[0].clone()
    for h in handles:
        h.remove()
    # 2. Prefill K tokens, then the rest of the prompt and greedy tokens one at a time.
    check.reset_keys()
    k = case["prefill_len"]
    handles = layer_hooks(model, ref, "cached.prefill")
    out = model(input_ids=prompt[None, :k], use_cache=True)
    for h in handles:
        h.remove()
    ref["cached.prefill/logits"] = out.logits[0].clone()
    cache = out.past_key_values
    feed = [int(t) for t in prompt[k:]]
    generated = []
    step = 0
    last = out.logits[0, -1]
    while feed or len(generated) < case["generate"]:
        if feed:
            token = feed.pop(0)
        else:
            token = int(last.argmax())
            generated.append(token)
        handles = layer_hooks(model, ref, f"cached.decode.{step}")
        out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        for h in handles:
            h.remove()
        cache = out.past_key_values
        last = out.logits[0, -1]
        ref[f"cached.decode.{step}/logits"] = out.logits[0].clone()
        step += 1
    return ref, generated


def make(name, case, out_dir):
    for seed in range(100):
        config, model, prompt, fp8 = build(name, case, seed)
        check = MarginCheck(model, config)
        ref, generated = references(model, prompt, case, check)
        check.remove()
        if check.worst >= MIN_MARGIN:
            break
        print(f"{name}: seed {seed} rejected (margin {check.worst:.2e} at {check.where})")
    else:
        raise SystemExit(f"{name}: no seed gave clear routing/DSA margins")
    target = out_dir / name
    if target.exists():
        shutil.rmtree(target)
    model.save_pretrained(target, safe_serialization=True)
    for extra in ["generation_config.json"]:
        (target / extra).unlink(missing_ok=True)
    if fp8 is not None:
        write_fp8_checkpoint(target, fp8, case["fp8_block"])
    tensors = {k: v.contiguous() for k, v in ref.items()}
    tensors["prompt"] = prompt.to(torch.int32)
    meta = {
        "prefill_len": str(case["prefill_len"]),
        "generated": json.dumps(generated),
        "decode_steps": str(sum(1 for k in ref if k.endswith("/logits") and k.startswith("cached.decode."))),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seed": str(seed),
        "min_margin": f"{check.worst:.3e}",
    }
    save_file(tensors, str(target / "reference.safetensors"), metadata=meta)
    if case.get("hf_dump"):
        ids = [int(t) for t in prompt]
        dump = str(target / "hf-dump.safetensors")
        count, _ = hf_dump.write(str(target), ids, case["prefill_len"], case["generate"], dump)
        print(f"{name}: {count} module outputs -> {dump}")
    size = sum(f.stat().st_size for f in target.iterdir())
    print(f"{name}: seed {seed}, margin {check.worst:.2e}, generated {generated}, {size / 1024:.0f} KiB")


def write_fp8_checkpoint(target, fp8, block):
    """Replaces the saved f32 projections by FP8 + weight_scale_inv, as DeepSeek ships them."""
    from safetensors.torch import load_file

    weights = load_file(str(target / "model.safetensors"))
    for name, (q, scale) in fp8.items():
        assert name in weights, name
        weights[name] = q
        weights[name + "_scale_inv"] = scale
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": block,
    }
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main():
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/hf")
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for name, case in CASES.items():
        make(name, case, out_dir)


if __name__ == "__main__":
    main()
