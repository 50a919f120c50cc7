#!/usr/bin/env python3
"""Converts a tiny HF fixture (tests/fixtures/hf/NAME) to a GGUF file the way llama.cpp's
converter lays one out, with some tensors quantized, plus the oracle for mladb's end-to-end
GGUF test: the quantized tensors as gguf-py dequantizes them, under their HF names.

    python tools/hf_to_gguf.py tests/fixtures/hf/glm5-sparse tests/fixtures/gguf/glm5-sparse-q
        -> glm5-sparse-q.gguf, glm5-sparse-q.dequant.safetensors

Needs `pip install gguf numpy safetensors` (written against gguf 0.19.0). mladb must give the
same logits on the GGUF file as on the HF checkpoint with those tensors replaced
(tests/gguf_model.rs). `--split-kv-b` writes kv_b_proj as attn_k_b / attn_v_b, as newer
llama.cpp conversions do. Quantized here: gguf-py's quantizers only (Q8_0, Q4_0, Q5_0, Q5_1,
Q4_1); the K-quants are covered by the per-type parity fixture instead.
"""
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType as Q
from gguf import quants
from safetensors.numpy import load_file, save_file

# Per HF tensor kind, the type it is stored as (rows that are not whole blocks stay F32).
QUANT = {
    "kv_b_proj": Q.Q8_0,
    "q_b_proj": Q.Q5_0,
    "q_proj": Q.Q5_1,
    "o_proj": Q.Q4_1,
    "experts": Q.Q4_0,
    "shared_experts": Q.Q8_0,
    "mlp_dense": Q.Q4_0,
    "embed": Q.F16,
}


def kind_of(hf):
    if "embed_tokens" in hf or hf == "lm_head.weight":
        return "embed"
    if ".mlp.experts." in hf:
        return "experts"
    if ".shared_experts." in hf:
        return "shared_experts"
    if ".mlp." in hf and hf.endswith("_proj.weight"):
        return "mlp_dense"
    for k in ("kv_b_proj", "q_b_proj", "q_proj", "o_proj"):
        if f".{k}.weight" in hf:
            return k
    return None


def gguf_name(hf):
    """HF name -> GGUF name (experts and kv_b handled by the caller)."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    parts = hf.split(".")
    layer = parts[2]
    stem, suffix = ".".join(parts[3:-1]), parts[-1]
    table = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_a_proj": "attn_q_a",
        "self_attn.q_a_layernorm": "attn_q_a_norm",
        "self_attn.q_b_proj": "attn_q_b",
        "self_attn.q_proj": "attn_q",
        "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm": "attn_kv_a_norm",
        "self_attn.kv_b_proj": "attn_kv_b",
        "self_attn.o_proj": "attn_output",
        "self_attn.indexer.wq_b": "indexer.attn_q_b",
        "self_attn.indexer.wk": "indexer.attn_k",
        "self_attn.indexer.k_norm": "indexer.k_norm",
        "self_attn.indexer.weights_proj": "indexer.proj",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj": "ffn_up_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp",
    }
    if stem == "mlp.gate" and suffix == "weight":
        return f"blk.{layer}.ffn_gate_inp.weight"
    if stem == "mlp.gate" and suffix == "e_score_correction_bias":
        return f"blk.{layer}.exp_probs_b.bias"
    return f"blk.{layer}.{table[stem]}.{suffix}"


def store(writer, dequant, name, hf_names, array, qtype):
    """Adds a tensor, quantized when it can be; records what gguf-py decodes it back to."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype is None or array.ndim < 2:
        writer.add_tensor(name, array)
        return
    if qtype == Q.F16:
        writer.add_tensor(name, array.astype(np.float16))
        back = array.astype(np.float16).astype(np.float32)
    else:
        block = {Q.Q8_0: 32, Q.Q4_0: 32, Q.Q4_1: 32, Q.Q5_0: 32, Q.Q5_1: 32}[qtype]
        if array.shape[-1] % block != 0:
            writer.add_tensor(name, array)
            return
        data = quants.quantize(array, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        back = quants.dequantize(data, qtype).reshape(array.shape)
    for hf, part in hf_names(back):
        dequant[hf] = np.ascontiguousarray(part, dtype=np.float32)


def main():
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    split_kv_b = "--split-kv-b" in sys.argv
    cfg = json.loads((src / "config.json").read_text())
    w = load_file(str(src / "model.safetensors"))
    glm = cfg["model_type"] == "glm_moe_dsa"
    arch = "glm-dsa" if glm else "deepseek2"
    writer = GGUFWriter(str(out.with_suffix(".gguf")), arch)
    k = lambda s: s.format(arch=arch)
    L, H = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    P, R, V, C = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    writer.add_uint32(k("{arch}.vocab_size"), cfg["vocab_size"])
    writer.add_uint32(k("{arch}.context_length"), cfg["max_position_embeddings"])
    writer.add_uint32(k("{arch}.embedding_length"), cfg["hidden_size"])
    writer.add_uint32(k("{arch}.block_count"), L)
    writer.add_uint32(k("{arch}.feed_forward_length"), cfg["intermediate_size"])
    writer.add_uint32(k("{arch}.attention.head_count"), H)
    writer.add_uint32(k("{arch}.attention.head_count_kv"), 1 if split_kv_b else H)
    if split_kv_b:
        writer.add_uint32(k("{arch}.attention.key_length"), C + R)
        writer.add_uint32(k("{arch}.attention.value_length"), C)
        writer.add_uint32(k("{arch}.attention.key_length_mla"), P + R)
        writer.add_uint32(k("{arch}.attention.value_length_mla"), V)
    else:
        writer.add_uint32(k("{arch}.attention.key_length"), P + R)
        writer.add_uint32(k("{arch}.attention.value_length"), V)
    if cfg.get("q_lora_rank"):
        writer.add_uint32(k("{arch}.attention.q_lora_rank"), cfg["q_lora_rank"])
    writer.add_uint32(k("{arch}.attention.kv_lora_rank"), C)
    writer.add_float32(k("{arch}.attention.layer_norm_rms_epsilon"), cfg["rms_norm_eps"])
    writer.add_uint32(k("{arch}.rope.dimension_count"), R)
    writer.add_float32(k("{arch}.rope.freq_base"), cfg["rope_parameters"]["rope_theta"])
    writer.add_uint32(k("{arch}.expert_count"), cfg["n_routed_experts"])
    writer.add_uint32(k("{arch}.expert_used_count"), cfg["num_experts_per_tok"])
    writer.add_uint32(k("{arch}.expert_shared_count"), cfg["n_shared_experts"])
    writer.add_uint32(k("{arch}.leading_dense_block_count"), cfg["first_k_dense_replace"])
    writer.add_uint32(k("{arch}.expert_feed_forward_length"), cfg["moe_intermediate_size"])
    writer.add_uint32(k("{arch}.expert_group_count"), cfg["n_group"])
    writer.add_uint32(k("{arch}.expert_group_used_count"), cfg["topk_group"])
    writer.add_float32(k("{arch}.expert_weights_scale"), cfg["routed_scaling_factor"])
    writer.add_bool(k("{arch}.expert_weights_norm"), cfg["norm_topk_prob"])
    writer.add_uint32(k("{arch}.expert_gating_func"), 2)  # sigmoid
    if glm:
        writer.add_uint32(k("{arch}.attention.indexer.head_count"), cfg["index_n_heads"])
        writer.add_uint32(k("{arch}.attention.indexer.key_length"), cfg["index_head_dim"])
        writer.add_uint32(k("{arch}.attention.indexer.top_k"), cfg["index_topk"])
        writer.add_array("mladb.indexer_types", cfg["indexer_types"])
    # mladb's own key: llama.cpp has none for the RoPE layout of the MLA heads.
    writer.add_bool("mladb.rope_interleave", cfg.get("rope_interleave", True))

    dequant = {}
    experts = {}
    for hf in sorted(w):
        if ".mlp.experts." in hf:
            layer, e, proj = hf.split(".")[2], int(hf.split(".")[5]), hf.split(".")[6]
            experts.setdefault((layer, proj), {})[e] = hf
            continue
        if hf == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        qtype = QUANT.get(kind_of(hf))
        if split_kv_b and hf.endswith("kv_b_proj.weight"):
            layer = hf.split(".")[2]
            kv = w[hf].reshape(H, P + V, C)
            k_b = np.ascontiguousarray(kv[:, :P, :].transpose(0, 2, 1))  # [H, C, P]
            v_b = np.ascontiguousarray(kv[:, P:, :])  # [H, V, C]
            # The oracle for a split pair is the merged kv_b reassembled from both decodes.
            parts = {}
            store(writer, parts, f"blk.{layer}.attn_k_b.weight", lambda b: [("k", b)], k_b, Q.Q8_0)
            store(writer, parts, f"blk.{layer}.attn_v_b.weight", lambda b: [("v", b)], v_b, Q.Q8_0)
            kb = parts.get("k", k_b).transpose(0, 2, 1)
            vb = parts.get("v", v_b)
            dequant[hf] = np.ascontiguousarray(np.concatenate([kb, vb], axis=1).reshape(H * (P + V), C))
            continue
        store(writer, dequant, gguf_name(hf), lambda b, hf=hf: [(hf, b)], w[hf], qtype)
    for (layer, proj), by_e in sorted(experts.items()):
        names = [by_e[e] for e in sorted(by_e)]
        stacked = np.stack([w[n] for n in names])
        kind = proj.replace("_proj", "")
        store(
            writer,
            dequant,
            f"blk.{layer}.ffn_{kind}_exps.weight",
            lambda b, names=names: list(zip(names, b)),
            stacked,
            QUANT["experts"],
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(dequant, str(out.with_suffix(".dequant.safetensors")))
    print(f"wrote {out.with_suffix('.gguf')} and {len(dequant)} dequantized tensors")


if __name__ == "__main__":
    main()
