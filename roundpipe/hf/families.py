"""Which path cuts a Hugging Face causal LM into RoundPipe layers.

Every decoder-only causal LM (and vision-language model, on text) takes the general
path (:mod:`.replay`): the model's own decoder layers, called with the arguments its
own decoder code gives them. The families in ``FAMILIES`` take our own adapter
(:mod:`.decoder`) instead, an override that knows their layers: attention without an
``S x S`` tensor for packed examples and sliding windows (and GPT-OSS's sinks), and
tiled token-wise modules, so long context and packing keep device memory linear in
the sequence (docs/design.md#long-context).
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


def own_adapter(model) -> Family | None:
    """The :class:`Family` whose adapter runs ``model`` (a ``*ForCausalLM``), or ``None``
    for the general path."""
    return FAMILIES.get(getattr(getattr(model, "config", None), "model_type", ""))
