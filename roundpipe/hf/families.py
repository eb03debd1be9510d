"""The Hugging Face model families RoundPipe cuts into layers, and what differs between them.

A family is the ``config.model_type`` of its ``*ForCausalLM`` models plus the few
facts the generic decoder adapter (:mod:`.decoder`) needs. Adding a family whose
model has ``model.embed_tokens``, ``model.layers``, ``model.norm``,
``model.rotary_emb`` and an output embedding is one entry in ``FAMILIES``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str
    sliding_everywhere: bool = False
    """Every layer uses the sliding-window mask when ``config.sliding_window`` is set
    (Mistral); otherwise ``config.layer_types`` says, per layer (Qwen2, Qwen3)."""

    def mask_kind(self, config, index: int) -> str:
        types = getattr(config, "layer_types", None)
        if types:
            return types[index]
        if self.sliding_everywhere and getattr(config, "sliding_window", None):
            return "sliding_attention"
        return "full_attention"


FAMILIES = {
    family.model_type: family
    for family in (
        Family("Llama", "llama"),
        Family("Mistral", "mistral", sliding_everywhere=True),
        Family("Qwen2", "qwen2"),
        Family("Qwen3", "qwen3"),
        Family("Qwen3-MoE", "qwen3_moe"),
        Family("GPT-OSS", "gpt_oss"),  # attention sinks, alternating sliding layers, biases
    )
}


def family_of(model) -> Family:
    """The family of ``model`` (a ``*ForCausalLM``), or a ValueError naming the supported ones."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None or not hasattr(model, "get_output_embeddings"):
        supported = ", ".join(f"{f.name} ({f.model_type})" for f in FAMILIES.values())
        what = f"model_type {model_type!r}" if model_type else type(model).__name__
        raise ValueError(
            f"roundpipe.from_hf supports decoder-only causal LMs of these families: "
            f"{supported}; got {what}. A family whose model has model.embed_tokens, "
            "model.layers, model.norm, model.rotary_emb and an LM head is one entry in "
            "roundpipe/hf/families.py; any other model can be wrapped as an "
            "nn.Sequential of layers and passed to RoundPipe(...)"
        )
    return family
