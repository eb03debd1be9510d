"""Child: write a ~1.5 GB Llama checkpoint (bf16, sharded) for the loading memory test.

Usage: python hf_load_generate.py DIR. Writes config.json, shards of about 300 MB with
``safetensors.torch.save_file`` (one shard in memory at a time) and the index, named
as ``transformers``' ``save_pretrained`` names them, and prints
``{"weight_bytes": ...}`` as JSON. It does not import
``transformers`` (slow to import): the few Llama tensor names are written out here,
and a wrong one makes the loader refuse the checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 1536,
    "intermediate_size": 4096,
    "num_hidden_layers": 26,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "max_position_embeddings": 256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
DTYPE = torch.bfloat16
SHARD_BYTES = 300 << 20


def layer_shapes(index: int) -> dict[str, tuple[int, ...]]:
    hidden, inner = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    prefix = f"model.layers.{index}"
    shapes = {f"{prefix}.self_attn.{p}_proj.weight": (hidden, hidden) for p in "qkvo"}
    shapes[f"{prefix}.mlp.gate_proj.weight"] = (inner, hidden)
    shapes[f"{prefix}.mlp.up_proj.weight"] = (inner, hidden)
    shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, inner)
    shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
    shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
    return shapes


def checkpoint_shapes() -> dict[str, tuple[int, ...]]:
    vocab, hidden = CONFIG["vocab_size"], CONFIG["hidden_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for index in range(CONFIG["num_hidden_layers"]):
        shapes.update(layer_shapes(index))
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def main() -> None:
    directory = Path(sys.argv[1])
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    shapes = checkpoint_shapes()
    shards = _shards(shapes)
    generator = torch.Generator().manual_seed(0)
    random_by_shape: dict[tuple[int, ...], torch.Tensor] = {}
    weight_map = {}
    for number, names in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _weight(shapes[name], generator, random_by_shape) for name in names}
        save_file(tensors, directory / file, metadata={"format": "pt"})
        del tensors
        weight_map.update(dict.fromkeys(names, file))
    total = sum(_nbytes(shape) for shape in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    print(json.dumps({"weight_bytes": total}), flush=True)


def _nbytes(shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * DTYPE.itemsize


def _shards(shapes: dict[str, tuple[int, ...]]) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        if size >= SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += _nbytes(shape)
    return shards


def _weight(shape: tuple[int, ...], generator: torch.Generator, random_by_shape: dict):
    """Norm weights are ones; the others small random values, drawn once per shape (the
    layers repeat them: the values do not matter here, and drawing is slow)."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=DTYPE)
    if shape not in random_by_shape:
        random = torch.empty(shape, dtype=DTYPE).uniform_(-0.03, 0.03, generator=generator)
        random_by_shape[shape] = random
    return random_by_shape[shape].clone()


if __name__ == "__main__":
    main()
