"""What each decoder layer of a model is made of: a token mixer and a feed-forward block.

A Llama-like layer is softmax attention (over the whole causal prefix, or a sliding
window) followed by a dense or mixture-of-experts MLP. Hybrid models mix in layers
whose token mixer is linear in the sequence (Gated DeltaNet, Mamba2), run attention
and Mamba2 side by side (Falcon-H1), or split the mixer and the MLP into layers of
their own (Nemotron-H). :class:`LayerShape` names one layer's two parts; the
per-layer lists of a :class:`~.model_shape.ModelSpec` say which layer is which.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"
"""Gated DeltaNet (Qwen3-Next, Qwen3.5): ``linear_*`` config fields."""
MAMBA = "mamba"
"""Mamba2's SSD mixer (Nemotron-H, Falcon-H1): ``mamba_*`` config fields."""
ATTENTION_MAMBA = "attention_mamba"
"""Attention and Mamba2 side by side on the same input, outputs summed (Falcon-H1)."""
NO_MIXER = "none"
"""A layer with a feed-forward block only (Nemotron-H's MLP and MoE layers)."""
MIXERS = (FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION, MAMBA, ATTENTION_MAMBA, NO_MIXER)
ATTENDING = (FULL_ATTENTION, SLIDING_ATTENTION, ATTENTION_MAMBA)
"""Mixers with softmax attention, whose cost grows with the context a query sees."""

DENSE = "dense"
MOE = "moe"
NO_FFN = "none"
"""A layer with a token mixer only (Nemotron-H's Mamba2 and attention layers)."""
FFNS = (DENSE, MOE, NO_FFN)


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer: its token mixer (one of ``MIXERS``) and feed-forward block
    (one of ``FFNS``)."""

    mixer: str = FULL_ATTENTION
    ffn: str = DENSE

    @property
    def sublayers(self) -> int:
        """Residual branches: a mixer, a feed-forward block, or both."""
        return (self.mixer != NO_MIXER) + (self.ffn != NO_FFN)


def check_kinds(kinds: tuple[str, ...], known: tuple[str, ...], what: str, layers: int) -> None:
    """Refuse a per-layer list of the wrong length or with kinds the predictor cannot
    price, naming them."""
    unknown = sorted({k for k in kinds if k not in known})
    if unknown:
        raise ValueError(
            f"the model has {what} kinds the predictor cannot price: "
            f"{', '.join(map(repr, unknown))} (it prices {', '.join(known)})"
        )
    if kinds and len(kinds) != layers:
        raise ValueError(f"{len(kinds)} {what} kinds given for {layers} layers")


def alternating_windows(num_layers: int, window_layers: int) -> tuple[str, ...]:
    """The mixers of a model given only how many layers use a sliding window: all or
    none of them, or alternating from the first layer on (gpt-oss's sliding, full)."""
    every = num_layers // max(window_layers, 1)
    return tuple(
        SLIDING_ATTENTION if window_layers and i % every == 0 else FULL_ATTENTION
        for i in range(num_layers)
    )


def dense_first(num_layers: int, moe: bool, first_dense: int) -> tuple[str, ...]:
    """The feed-forward blocks of a dense model, or of an MoE model whose first
    ``first_dense`` layers are dense (DeepSeek's ``first_k_dense_replace``)."""
    return tuple(MOE if moe and i >= first_dense else DENSE for i in range(num_layers))
