"""A Hugging Face decoder-only causal LM cut into RoundPipe layers.

``model_layers`` chooses the path: this adapter for the families it knows
(:mod:`.families`), the general path (:mod:`.replay`) for every other model. The
adapter: an embedding layer, one layer per
decoder layer and a head (final norm, LM head, chunked loss), holding the model's own
modules. Between stages travels ``(hidden, attention_mask, position_ids, labels,
router_sums)``; each decoder layer rebuilds its positions, rotary tables and mask on
its device (docs/design.md#hugging-face-models).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.nn import functional as F

from .attention import segmented_attention, segments_of
from .families import Family, own_adapter
from .long_context import IGNORE_INDEX, chunked_loss, tile, tile_tokenwise
from .replay import padding_only_trails, replayed_layers
from .router import (
    RouterLoss,
    add_router_sums,
    aux_loss,
    capture,
    hook_routers,
    router_class,
    router_loss_of,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

LOSS_CHUNK_TOKENS = 4096


@functools.cache
def _mask_kwargs() -> str:
    """The name transformers' mask builders give the KV-cache argument."""
    from transformers.masking_utils import create_causal_mask

    return (
        "cache"
        if "cache" in inspect.signature(create_causal_mask).parameters
        else "past_key_values"
    )


class EmbedLayer(nn.Module):
    modifies_inputs = False  # RoundPipe need not copy a stage input for it

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None):
        return self.embed_tokens(input_ids), attention_mask, position_ids, labels, None


class DecoderLayer(nn.Module):
    """One decoder layer of the model, with its own copy of the rotary embedding (its
    tables are derived constants, not weights)."""

    modifies_inputs = False

    def __init__(
        self,
        layer: nn.Module,
        rotary: nn.Module,
        config,
        mask_kind: str,
        router_loss: RouterLoss | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = copy.deepcopy(rotary)
        self.config = config
        self.mask_kind = mask_kind
        self.router_loss = router_loss
        self._cache_kwarg = _mask_kwargs()
        if router_loss is None:  # the router loss reads one set of router logits per layer
            tile_tokenwise(layer)

    def forward(self, state):
        hidden, attention_mask, position_ids, labels, router_sums = state
        positions = position_ids
        if positions is None:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        padding = None if self._padding_only_trails(attention_mask, labels) else attention_mask
        segments = self._segments(padding, position_ids, hidden)
        attention: contextlib.AbstractContextManager[None]
        if segments is None:
            mask = self._mask(hidden, padding, positions)
            attention = contextlib.nullcontext()
        else:
            mask, attention = segments, segmented_attention(self.config)
        cos_sin = self.rotary(hidden, positions)
        with attention, capture() as router_logits:
            out = self.layer(
                hidden, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin
            )
        hidden = out[0] if isinstance(out, tuple) else out
        if self.router_loss is not None and labels is not None:
            router_sums = add_router_sums(
                router_sums, router_logits, attention_mask, self.router_loss
            )
        return hidden, attention_mask, position_ids, labels, router_sums

    def _padding_only_trails(self, attention_mask, labels) -> bool:
        """In training (labels given), a right-padded batch needs no padding mask under
        causal attention: no real token attends to a later pad, so every real token's
        output is the same, and the pads' own outputs carry no label. (Logits of pads,
        returned without labels, keep transformers' mask.)"""
        return self._attention_kind() is not None and padding_only_trails(attention_mask, labels)

    def _attention_kind(self) -> str | None:
        """``"sdpa"``, ``"sinks"`` (GPT-OSS's eager attention, which ``roundpipe.hf.
        attention`` runs through SDPA), or ``None`` (transformers' masks as they are)."""
        implementation = self.config._attn_implementation
        if implementation == "sdpa":
            return "sdpa"
        sinks = hasattr(getattr(self.layer, "self_attn", None), "sinks")
        return "sinks" if implementation == "eager" and sinks else None

    def _segments(self, attention_mask, position_ids, hidden):
        """The :class:`~.attention.Segments` to pass as the mask when attention can run
        without an ``S x S`` one (docs/design.md#long-context), else ``None``."""
        kind = self._attention_kind()
        dropout: float = self.training and getattr(self.config, "attention_dropout", 0.0)
        if kind is None or attention_mask is not None or dropout:
            return None  # transformers' own masks (the pieces draw no dropout)
        window = None
        if self.mask_kind == "sliding_attention":
            window = getattr(self.config, "sliding_window", None)
        segments = segments_of(position_ids, hidden.shape[1], window)
        plain_causal = segments is not None and len(segments.bounds) == 1 and window is None
        if plain_causal and kind == "sdpa":
            return None  # transformers' SDPA runs it causal, without a mask
        return segments

    def _mask(self, hidden, attention_mask, positions):
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        build = (
            create_sliding_window_causal_mask
            if self.mask_kind == "sliding_attention"
            else create_causal_mask
        )
        return build(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            position_ids=positions,
            **{self._cache_kwarg: None},
        )


class HeadLayer(nn.Module):
    """Final norm and LM head; with labels, the summed loss of the shifted labels and
    the count of them the logits predict (:func:`.long_context.chunked_loss`)."""

    modifies_inputs = False

    def __init__(
        self,
        norm: nn.Module,
        lm_head: nn.Linear,
        chunk_tokens: int,
        router_loss: RouterLoss | None = None,
    ) -> None:
        super().__init__()
        self.norm = norm
        tile(norm)
        self.lm_head = lm_head
        self.chunk_tokens = chunk_tokens
        self.router_loss = router_loss

    def forward(self, state):
        hidden, _, _, labels, router_sums = state
        hidden = self.norm(hidden)
        if labels is None:
            return self.lm_head(hidden)
        weight, bias = self.lm_head.weight, self.lm_head.bias
        total, correct = chunked_loss(
            hidden, labels, self.chunk_tokens, weight.shape[0], F.linear, weight, bias
        )
        if router_sums is not None:  # weighted by this microbatch's label tokens
            assert self.router_loss is not None
            if total.dim():  # row_losses: sequence-level losses
                raise NotImplementedError(
                    "per-row losses (preference tuning) of a model trained with its router "
                    "loss (output_router_logits=True) are not supported yet: set "
                    "output_router_logits=False in its config"
                )
            count = (labels[:, 1:] != IGNORE_INDEX).sum()
            total = total + self.router_loss.coef * aux_loss(router_sums, self.router_loss) * count
        return total, correct


def decoder_layers(
    model: PreTrainedModel, family: Family, chunk_tokens: int = LOSS_CHUNK_TOKENS
) -> nn.Sequential:
    """``model`` (a supported ``*ForCausalLM``) as a sequence of RoundPipe layers."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    config = model.config
    router_loss = router_loss_of(model)
    routers = router_class(inner) if router_loss is not None else None
    if router_loss is not None and routers is None:
        raise NotImplementedError(
            f"{type(model).__name__} asks for the router loss (output_router_logits=True) "
            "but transformers records no router_logits for it"
        )
    layers: list[nn.Module] = [EmbedLayer(inner.embed_tokens)]
    for index, layer in enumerate(inner.layers[: config.num_hidden_layers]):
        routed = routers is not None and hook_routers(layer, *routers)
        kind = family.mask_kind(config, index)
        layers.append(
            DecoderLayer(layer, inner.rotary_emb, config, kind, router_loss if routed else None)
        )
    head = model.get_output_embeddings()
    layers.append(HeadLayer(inner.norm, head, chunk_tokens, router_loss))
    return nn.Sequential(*layers)


def model_layers(model: nn.Module, chunk_tokens: int = LOSS_CHUNK_TOKENS) -> nn.Sequential:
    """``model`` (a decoder-only ``*ForCausalLM`` or a VLM's ``*ForConditionalGeneration``)
    as RoundPipe layers: our own adapter for its family, else the general path; a model
    neither can run raises :class:`~.replay.UnsupportedModel` (a ValueError) before
    anything is allocated."""
    family = own_adapter(model)
    if family is None:
        return replayed_layers(model, chunk_tokens)
    # a family's own class (``own_adapter``): a transformers model
    return decoder_layers(cast("PreTrainedModel", model), family, chunk_tokens)
