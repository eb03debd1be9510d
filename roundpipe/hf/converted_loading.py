"""Checkpoints whose tensors transformers converts while it loads them.

transformers 5 stores several families' weights on disk in another layout than its
modules hold them (Mixtral's and MiniMax's experts one per expert under
``block_sparse_moe``, Gemma 3's and Mistral 3's vision towers under older names, ...)
and converts them while loading (``transformers.conversion_mapping``). Where our own
loader (:mod:`.checkpoint_layout`) does not know a layout and transformers has a
conversion for the model, transformers loads the model itself: one dense copy in host
memory (no file-mapped views for a LoRA base), every tensor accounted for (a tensor
missing from the checkpoint or left over is refused, never initialized at random).
With ``quantize="nf4"`` the decoder layers' linear layers and stacked experts are then
quantized in place (docs/design.md#4-bit-bases).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from .nf4 import NF4Linear
from .nf4_experts import SUPPORTED, quantize_experts_module
from .safetensors_io import CheckpointError
from .structure import named_modules_in_decoder_layers

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def has_conversion(model: PreTrainedModel) -> bool:
    """Whether transformers converts this model's checkpoint tensors while loading."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers 4: no conversions
        return False
    return bool(get_model_conversion_mapping(model, add_legacy=False))


def load_converted(
    directory: Path, model_class: type[PreTrainedModel], torch_dtype: torch.dtype
) -> PreTrainedModel:
    """The model of ``directory`` loaded by transformers (``model_class.from_pretrained``),
    refused if a tensor the model needs is missing or one is left over."""
    loaded = model_class.from_pretrained(directory, dtype=torch_dtype, output_loading_info=True)
    # with output_loading_info, transformers returns the model and the loading info
    model, info = cast("tuple[PreTrainedModel, dict]", loaded)
    missing, unexpected = info.get("missing_keys") or [], info.get("unexpected_keys") or []
    mismatched = info.get("mismatched_keys") or []
    if missing or unexpected or mismatched:
        raise CheckpointError(
            f"{directory}: transformers' own conversion of the checkpoint leaves tensors "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]} or of "
            f"another shape {sorted(mismatched)[:5]} (does config.json belong to these "
            "weights?)"
        )
    return model


def quantize_in_place(model: nn.Module) -> None:
    """Every ``nn.Linear`` and supported stacked experts module inside a decoder layer of
    ``model`` (dense host weights) replaced by its NF4 form, one at a time."""
    for parent_name, parent in named_modules_in_decoder_layers(model):
        for name, child in list(parent.named_children()):
            try:
                if type(child) is nn.Linear:
                    parent._modules[name] = NF4Linear.from_linear(child)
                elif type(child).__name__ in SUPPORTED:
                    quantize_experts_module(child)
            except ValueError as error:  # a weight NF4 cannot quantize (NaN, inf)
                where = ".".join(filter(None, (parent_name, name)))
                raise CheckpointError(f"{where}: {error}; the checkpoint is damaged") from error
