"""Child: write a Qwen3-MoE checkpoint, or load it with ``quantize="nf4"`` and report host memory.

Usage: python nf4_moe_load.py generate DIR, then python nf4_moe_load.py measure DIR.
``generate`` writes config.json and one bf16 shard per layer (about 200 MB each, one in
memory at a time) with the experts stored one tensor per expert and projection, as
transformers saves Qwen3-MoE, and prints ``{"weight_bytes": ...}``. ``measure``, in a
fresh process, prints one JSON line (bytes): ``baseline_rss`` (after the imports),
``loaded_peak_rss`` (peak RSS once loaded, from ``getrusage``), ``quantized_bytes``
(every host tensor of the loaded model), ``expert_bytes`` and ``expert_params`` (the
NF4 experts), ``load_s`` and the ``loss`` of one ``forward_backward``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from rss import current_rss, peak_rss

CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 4096,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "num_experts": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}


def generate(directory: Path) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    h, i, e = CONFIG["hidden_size"], CONFIG["moe_intermediate_size"], CONFIG["num_experts"]
    heads, kv, d = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["head_dim"]
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)

    weight_map, total = {}, 0
    shards = [
        {
            "model.embed_tokens.weight": rand(CONFIG["vocab_size"], h),
            "lm_head.weight": rand(CONFIG["vocab_size"], h),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
    ]
    for layer in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shard = {
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rand(heads * d, h),
            p + "self_attn.k_proj.weight": rand(kv * d, h),
            p + "self_attn.v_proj.weight": rand(kv * d, h),
            p + "self_attn.o_proj.weight": rand(h, heads * d),
            p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
            p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
            p + "mlp.gate.weight": rand(e, h),
        }
        for expert in range(e):
            q = f"{p}mlp.experts.{expert}."
            shard[q + "gate_proj.weight"] = rand(i, h)
            shard[q + "up_proj.weight"] = rand(i, h)
            shard[q + "down_proj.weight"] = rand(h, i)
        shards.append(shard)
    for index, shard in enumerate(shards):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / name, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(shard, name))
        shards[index] = None  # one shard in memory at a time
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_file))
    print(json.dumps({"weight_bytes": total}), flush=True)


def measure(directory: Path) -> None:
    import peft

    import roundpipe
    from roundpipe.hf.nf4_experts import nf4_expert_modules

    baseline = current_rss()
    start = time.perf_counter()
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    pipe = roundpipe.from_pretrained(
        directory, torch_dtype=torch.bfloat16, lora=lora, quantize="nf4", devices="emulated:2"
    )
    load_s = time.perf_counter() - start
    loaded = peak_rss()
    model = pipe.hf_model
    experts = nf4_expert_modules(model).values()
    ids = torch.randint(
        0, CONFIG["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(0)
    )
    loss = pipe.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
    pipe.synchronize()
    result = {
        "baseline_rss": baseline,
        "loaded_peak_rss": loaded,
        "quantized_bytes": sum(
            t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
        ),
        "expert_bytes": sum(p.numel() * p.element_size() for m in experts for p in m.parameters()),
        "expert_params": sum(
            torch.Size(shape).numel() for m in experts for shape in m._nf4_shapes.values()
        ),
        "load_s": load_s,
        "loss": float(loss),
    }
    pipe.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    {"generate": generate, "measure": measure}[sys.argv[1]](Path(sys.argv[2]))
