"""What the prediction tests share: a tiny Llama config and the JSON rows of a run."""

from __future__ import annotations

import json

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
}
"""A config.json small enough to build with transformers in a test."""


def json_rows(capsys) -> list[dict]:
    """The lines ``roundpipe simulate --json`` printed, parsed."""
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]
