"""Where a Hugging Face causal LM keeps what the general decoder path needs, and twins.

:func:`find_structure` finds the base model, the decoder that owns the list of decoder
layers (inside a VLM's base model, its language model) and the final norm, from
transformers' own lookups (``get_decoder``, ``base_model_pp_plan``) and the usual names;
a model without them is refused naming its ``model_type``. A *twin* is a shallow copy of
one of the model's modules with some children replaced: the model itself is never
changed (docs/design.md#the-general-decoder-path).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NORM_NAMES = (
    "norm", "norm_f", "final_layernorm", "final_norm", "ln_f", "final_layer_norm", "embedding_norm",
)  # fmt: skip
LAYER_LIST_NAMES = ("layers", "h", "blocks", "decoder_layers")
_CARRIES_STATE = re.compile(
    r"mamba|deltanet|linearattention|lightning|shortconv|rwkv|recurrent|conv1d",
    re.IGNORECASE,
)
"""Class names of token mixers that carry a state along the sequence (state-space,
linear attention, short convolutions) rather than attend under a mask."""
PACKING_REFUSED = {
    "qwen2_5_vl": "its M-RoPE positions of packed examples are not those of each example "
    "alone (transformers' own model differs from the examples run apart by 4e-3 in the "
    "loss); pass one example per row (without packing)",
}
"""Model types whose packed sequences are not their examples apart, though their layers
attend under a mask (measured: tests/hf/test_hf_architecture_features.py)."""


class UnsupportedModel(ValueError):
    """A model the general decoder path cannot run, named with what was found."""


@dataclass(frozen=True)
class Structure:
    """Where a causal LM keeps what the general path needs."""

    base_name: str
    """The causal LM's attribute holding its base model (``model``)."""
    decoder_path: tuple[str, ...]
    """Submodule names from the base model down to the decoder that owns the layers
    (empty for most text models, ``("language_model",)`` for a VLM)."""
    layers_name: str
    norm_name: str | None
    num_layers: int


def text_model(model: nn.Module) -> nn.Module:
    """The causal LM that trains on text: ``model``, or the one inside it when a
    vision-language model keeps a whole causal LM as its ``language_model`` (Llama 4),
    with the same LM head."""
    inner: PreTrainedModel | None = getattr(model, "language_model", None)
    if (
        isinstance(inner, nn.Module)
        and hasattr(inner, "get_output_embeddings")
        and hasattr(model, "get_output_embeddings")
        and inner.get_output_embeddings() is not None
        and inner.get_output_embeddings() is cast("PreTrainedModel", model).get_output_embeddings()
    ):
        return inner
    return model


def find_structure(causal_lm: nn.Module) -> Structure:
    """The :class:`Structure` of ``causal_lm`` (a :func:`text_model`), or
    :class:`UnsupportedModel` naming its ``model_type`` and what was found."""
    config = getattr(causal_lm, "config", None)
    model_type = getattr(config, "model_type", None) or type(causal_lm).__name__
    check_config(config)
    prefix = getattr(causal_lm, "base_model_prefix", "model")
    base_name = next(
        (n for n in (prefix, "model") if isinstance(getattr(causal_lm, n, None), nn.Module)),
        prefix,
    )  # Llama 4's causal LM keeps its base model under "model", not its prefix
    base: PreTrainedModel | None = getattr(causal_lm, base_name, None)
    if not isinstance(base, nn.Module) or not hasattr(causal_lm, "get_output_embeddings"):
        raise UnsupportedModel(
            f"model_type {model_type!r}: {type(causal_lm).__name__} has no base model "
            f"{base_name!r} and LM head; pass a *ForCausalLM or *ForConditionalGeneration"
        )
    lm = cast("PreTrainedModel", causal_lm)
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else base
    if decoder is causal_lm:
        decoder = base.get_decoder() if hasattr(base, "get_decoder") else base
    path = _path_to(base, decoder)
    if path is None:
        raise UnsupportedModel(
            f"model_type {model_type!r}: its decoder ({type(decoder).__name__}) is not "
            f"inside its base model {base_name!r}"
        )
    layers_name = _layers_name(decoder)
    if layers_name is None:
        children = ", ".join(decoder._modules) or "none"
        raise UnsupportedModel(
            f"model_type {model_type!r}: no list of decoder layers in "
            f"{type(decoder).__name__} (its children: {children})"
        )
    count = getattr(text_config(config), "num_hidden_layers", None) or len(
        cast(nn.ModuleList, decoder._modules[layers_name])
    )
    return Structure(base_name, path, layers_name, _norm_name(decoder, layers_name), count)


def check_config(config) -> None:
    """Refuse, by its ``model_type``, a config no decoder-only model is built from."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(
            f"model_type {config.model_type!r} is an encoder-decoder model; roundpipe "
            "trains decoder-only causal LMs (and vision-language models on text)"
        )


def _path_to(root: nn.Module, target: nn.Module) -> tuple[str, ...] | None:
    if root is target:
        return ()
    for name, module in root.named_modules():
        if module is target:
            return tuple(name.split("."))
    return None


def _layers_name(decoder: nn.Module) -> str | None:
    plan = getattr(getattr(decoder, "config", None), "base_model_pp_plan", None) or {}
    for name in (*plan, *LAYER_LIST_NAMES):
        if isinstance(decoder._modules.get(name), nn.ModuleList):
            return name
    return None


def _norm_name(decoder: nn.Module, layers_name: str) -> str | None:
    plan = list(getattr(getattr(decoder, "config", None), "base_model_pp_plan", None) or {})
    after = plan[plan.index(layers_name) + 1 :] if layers_name in plan else []
    for name in (*after, *NORM_NAMES):
        if isinstance(decoder._modules.get(name), nn.Module):
            return name
    return None


def decoder_layer_modules(causal_lm: nn.Module, structure: Structure) -> list[nn.Module]:
    decoder = decoder_of(getattr(causal_lm, structure.base_name), structure)
    layers = cast(nn.ModuleList, decoder._modules[structure.layers_name])
    return list(layers)[: structure.num_layers]


def decoder_layers_of(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of ``model`` (a causal LM or VLM, on any path)."""
    causal_lm = text_model(model)
    return decoder_layer_modules(causal_lm, find_structure(causal_lm))


def named_modules_in_decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()`` that lie inside one of its decoder layers (the modules
    4-bit bases quantize: embeddings, the final norm and the LM head are outside)."""
    inside = {id(m) for layer in decoder_layers_of(model) for m in layer.modules()}
    return [(name, module) for name, module in model.named_modules() if id(module) in inside]


def text_config(config):
    """The language model's config: a composite (vision-language) config's text config,
    else ``config`` itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def decoder_of(base: nn.Module, structure: Structure) -> nn.Module:
    module = base
    for name in structure.decoder_path:
        module = cast(nn.Module, module._modules[name])  # a name on a path to a module
    return module


def packing_refusal(causal_lm: nn.Module) -> str | None:
    """Why packed sequences (position ids restarting per example) cannot train this
    model, or ``None``: token mixers that carry a state along the sequence would carry
    it from one example into the next (transformers' own models do too)."""
    model_type = cast("PreTrainedModel", causal_lm).config.model_type
    if model_type in PACKING_REFUSED:
        reason = PACKING_REFUSED[model_type]
        return f"model_type {model_type!r} cannot train packed sequences: {reason}"
    structure = find_structure(causal_lm)
    found = sorted(
        {
            type(module).__name__
            for layer in decoder_layer_modules(causal_lm, structure)
            for module in layer.modules()
            if _CARRIES_STATE.search(type(module).__name__)
        }
    )
    if not found:
        return None
    return (
        f"model_type {model_type!r} cannot train packed sequences: its "
        f"{', '.join(found)} layers carry a state along the sequence, which would cross "
        "from one example into the next; pass one example per row (without packing)"
    )


def adapted_head_refusal(causal_lm: nn.Module) -> str | None:
    """Why ``causal_lm`` cannot train with peft on its output layer (LoRA or
    ``modules_to_save`` on ``lm_head``), or ``None``: the head's loss is computed in
    chunks from the layer's weight, so an adapter there would silently not train."""
    head = cast("PreTrainedModel", causal_lm).get_output_embeddings()
    adapters = getattr(head, "lora_A", None)
    if (adapters is not None and len(adapters) > 0) or hasattr(head, "modules_to_save"):
        kind = "modules_to_save" if hasattr(head, "modules_to_save") else "LoRA"
        return (
            f"{kind} on the output layer (lm_head) is not supported: roundpipe computes the "
            "head's loss in chunks from its weight, so the adapter would not train; leave "
            "lm_head out of the target modules"
        )
    return None


def twin(module: nn.Module, children: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of ``module`` (same class, same attributes, the same parameter and
    child objects) whose children ``children`` are replaced; ``module`` is unchanged."""
    copied = copy.copy(module)
    for attr in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
        copied.__dict__[attr] = copy.copy(module.__dict__[attr])
    copied._modules.update(children)
    return copied


def twin_along(root: nn.Module, path: tuple[str, ...], children: dict[str, nn.Module]):
    """A twin of ``root`` in which the module at ``path`` is a twin with ``children``
    replaced (every module on the way a twin too)."""
    if not path:
        return twin(root, children)
    child = cast(nn.Module, root._modules[path[0]])  # a name on a path to a module
    return twin(root, {path[0]: twin_along(child, path[1:], children)})
