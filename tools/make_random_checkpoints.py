#!/usr/bin/env python3
"""Builds random tiny GLM-5 / DeepSeek-V3 checkpoints for mladb's verdict tests.

Unlike tools/make_hf_fixtures.py (whose parity fixtures reject any routing or DSA decision near
a tie), these keep whatever a seed gives: sizes, head counts, routing groups and DSA settings are
drawn at random, some GLM-5 cases have only 2-4 indexer heads (so many keys score exactly 0 and
top-k must break exact ties) and every prompt is longer than index_topk. `mladb check` must
report no findings on any of them, in f32 and bf16, on the CPU and the GPU.

Each case is a checkpoint directory (config.json + model.safetensors, weights stored in bf16 to
keep the fixtures small) and `cases.json` lists the schedule of each (tokens, prefill, decode).
The first --dumps cases whose decisions tie exactly also get `hf-dump.safetensors`, written by
tools/hf_dump.py (transformers' f32 arithmetic on the stored bf16 weights), for
`mladb check --reference`: there torch's top-k and mladb's may break a tie differently.

Usage (needs torch and transformers >= 5.13):
    python3 tools/make_random_checkpoints.py tests/fixtures/random --count 20 --dumps 2
"""

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
import hf_dump  # noqa: E402
from make_hf_fixtures import MarginCheck, redraw_weights  # noqa: E402


def random_case(rng, index):
    """A random config (as keyword arguments) and schedule; GLM-5 for even indices."""
    glm = index % 2 == 0
    heads = rng.choice([1, 2, 4, 8])
    heads = 16 if index % 10 == 3 else heads  # now and then many heads (DeepSeek cases)
    layers = rng.choice([2, 3, 3, 4])
    n_experts = rng.choice([4, 8])
    per_tok = rng.choice([1, 2, 3])
    if glm:
        n_group, topk_group = 1, 1
    else:
        # Groups are scored by their two best experts, so each needs at least two.
        n_group = rng.choice([g for g in [1, 2, 4] if n_experts // g >= 2])
        # The kept groups must hold enough experts to choose from.
        topk_group = rng.randint(-(-per_tok * n_group // n_experts), n_group)
    qk_rope = rng.choice([4, 8])
    config = dict(
        vocab_size=rng.choice([64, 96, 128]),
        hidden_size=rng.choice([32, 48]),
        intermediate_size=rng.choice([32, 48]),
        moe_intermediate_size=rng.choice([8, 16]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=rng.choice([16, 24]) if glm else rng.choice([None, 16, 24]),
        kv_lora_rank=rng.choice([16, 24]),
        qk_nope_head_dim=rng.choice([8, 16]),
        qk_rope_head_dim=qk_rope,
        v_head_dim=rng.choice([8, 16, 24]),
        n_routed_experts=n_experts,
        n_shared_experts=rng.choice([0, 1]) if not glm else 1,
        num_experts_per_tok=per_tok,
        n_group=n_group,
        topk_group=topk_group,
        first_k_dense_replace=rng.choice([0, 1]),
        routed_scaling_factor=rng.choice([1.0, 2.5]),
        norm_topk_prob=rng.choice([True, True, False]),
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": rng.choice([500.0, 10000.0])},
    )
    if glm:
        topk = rng.choice([2, 3, 4, 5])
        config.update(
            index_topk=topk,
            index_head_dim=rng.choice([max(8, qk_rope), 16]),
            index_n_heads=rng.choice([2, 3, 4]),
            indexer_types=["full"] + [rng.choice(["full", "shared"]) for _ in range(layers - 1)],
        )
        prompt_len = rng.randint(topk + 3, 12)
    else:
        prompt_len = rng.randint(5, 12)
    schedule = dict(prompt_len=prompt_len, prefill=rng.randint(2, prompt_len), decode=3)
    return glm, config, schedule


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--dumps", type=int, default=2, help="how many exact-tie cases get an HF dump")
    a = ap.parse_args()
    out = Path(a.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    rng = random.Random(a.seed)
    cases = []
    dumps_left = a.dumps
    for i in range(a.count):
        glm, kwargs, schedule = random_case(rng, i)
        config = (GlmMoeDsaConfig if glm else DeepseekV3Config)(**kwargs)
        config._attn_implementation = "eager"
        seed = rng.randrange(1 << 30)
        torch.manual_seed(seed)
        model = (GlmMoeDsaForCausalLM if glm else DeepseekV3ForCausalLM)(config).float().eval()
        redraw_weights(model, torch.Generator().manual_seed(seed))
        # The stored weights are bf16: compute the references from exactly those values.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, config.vocab_size, (schedule["prompt_len"],), generator=gen).tolist()
        name = f"{'glm5' if glm else 'deepseek-v3'}-{i:02d}"
        target = out / name
        model.to(torch.bfloat16).save_pretrained(target, safe_serialization=True)
        (target / "generation_config.json").unlink(missing_ok=True)
        model.float()
        # The smallest margin of any decision (0 when some top-k breaks an exact tie).
        check = MarginCheck(model, config)
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt]), use_cache=False)
        check.remove()
        margin = check.worst
        case = dict(
            name=name,
            tokens=prompt,
            prefill=schedule["prefill"],
            decode=schedule["decode"],
            seed=seed,
            min_margin=None if margin == float("inf") else margin,
        )
        if dumps_left > 0 and margin == 0.0:
            hf_dump.write(str(target), prompt, schedule["prefill"], schedule["decode"], str(target / "hf-dump.safetensors"))
            case["dump"] = "hf-dump.safetensors"
            dumps_left -= 1
        cases.append(case)
        size = sum(f.stat().st_size for f in target.iterdir())
        print(f"{name}: {size / 1024:.0f} KiB, margin {margin:.2e}{', dump' if 'dump' in case else ''}")
    (out / "cases.json").write_text(json.dumps(cases, indent=1) + "\n")


if __name__ == "__main__":
    main()
