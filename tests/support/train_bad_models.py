"""Model directories ``roundpipe train`` must refuse, built in code: families it does
not train (GPT-2, BERT), a truncated weights file and a GPT-OSS checkpoint in the MXFP4
layout of the official releases (``quantization_config`` in ``config.json``, each
experts' weight stored as ``*_blocks`` and ``*_scales`` of uint8)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from support.train_fixtures import build_tokenizer

MXFP4_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


def _save(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return Path(directory)


def t5_dir(directory: Path) -> Path:
    import transformers

    config = transformers.T5Config(
        vocab_size=len(build_tokenizer()), d_model=32, num_layers=1, num_heads=2, d_kv=16,
        d_ff=64,
    )  # fmt: skip
    return _save(transformers.T5ForConditionalGeneration(config), directory)


def bert_dir(directory: Path) -> Path:
    import transformers

    config = transformers.BertConfig(
        vocab_size=len(build_tokenizer()),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    return _save(transformers.BertForMaskedLM(config), directory)


def truncated_copy(model: Path, directory: Path) -> Path:
    """``model`` with the second half of its ``model.safetensors`` cut off."""
    shutil.copytree(model, directory)
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return directory


def mxfp4_gpt_oss_dir(directory: Path) -> Path:
    """A tiny GPT-OSS saved as the official releases are: bf16 except the experts,
    ``gate_up_proj`` [E, H, 2I] stored as ``gate_up_proj_blocks`` [E, 2I, H/32, 16] and
    ``gate_up_proj_scales`` [E, 2I, H/32] (likewise ``down_proj``), and
    ``quantization_config`` in ``config.json``."""
    import transformers
    from safetensors.torch import save_file

    config = transformers.GptOssConfig(
        vocab_size=len(build_tokenizer()),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=131072,  # as released (no warning about the rope scaling)
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to(torch.bfloat16)
    _save(model, directory)
    tensors = {}
    generator = torch.Generator().manual_seed(0)
    for name, tensor in model.state_dict().items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = tensor.contiguous()
            continue
        experts, rows, columns = tensor.shape  # [E, in, out]
        blocks = (experts, columns, rows // 32, 16)
        tensors[f"{name}_blocks"] = torch.randint(0, 256, blocks, dtype=torch.uint8,
                                                  generator=generator)  # fmt: skip
        tensors[f"{name}_scales"] = torch.randint(120, 130, blocks[:3], dtype=torch.uint8,
                                                  generator=generator)  # fmt: skip
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads((directory / "config.json").read_text())
    saved["quantization_config"] = MXFP4_CONFIG
    (directory / "config.json").write_text(json.dumps(saved, indent=2))
    return Path(directory)
