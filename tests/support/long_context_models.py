"""The two-layer decoders of the long-context tests (hidden 128, a 64-token
vocabulary, positions up to 65536) and their long batches, packed or not."""

from __future__ import annotations

import torch
import transformers

VOCAB = 64

FAMILIES = {  # beside Llama's: Qwen3 norms every query and key head; Mistral attends
    # within a window (one of 512 tokens here); GPT-OSS has sinks, experts, and
    # alternates windowed (128) and full layers
    "llama": (transformers.LlamaConfig, {}),
    "qwen3": (transformers.Qwen3Config, {}),
    "mistral": (transformers.MistralConfig, {"sliding_window": 512}),
    "gpt_oss": (
        transformers.GptOssConfig,
        {
            "attn_implementation": "eager",
            "head_dim": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}


def llama(intermediate: int = 344, dtype=torch.bfloat16, family: str = "llama"):
    """A two-layer Llama-shaped model, or one of the other :data:`FAMILIES`."""
    torch.manual_seed(0)
    kind, extra = FAMILIES[family]
    config = kind(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1 << 16,
        **{"attn_implementation": "sdpa", **extra},
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype)


def long_batch(tokens: int, packed: bool, example: int = 1000) -> dict:
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if packed:  # examples of ``example`` tokens, positions restarting at each
        batch["position_ids"] = (torch.arange(tokens) % example).unsqueeze(0)
    return batch
