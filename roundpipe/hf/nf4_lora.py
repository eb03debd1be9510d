"""peft's LoRA over :class:`.nf4.NF4Linear` (imports peft: load it only for a quantized base).

peft wraps a module type it does not know through a LoRA layer registered on the
config (``LoraConfig._register_custom_module``, peft's documented way for custom
layers). The layer is peft's own dense ``lora.Linear``: it calls the base layer and
adds ``lora_B(lora_A(dropout(x))) * scaling``, so the adapters, their names and their
saved keys are those of the unquantized model (docs/design.md#4-bit-bases).
"""

from __future__ import annotations

import copy
import warnings
from typing import cast

import peft
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

from .nf4 import NF4Linear

_NEEDS_DENSE_BASE = ("pissa", "corda", "olora", "loftq", "orthogonal", "lora_ga", "mica")
"""``init_lora_weights`` values that read the base weight (not kept on an NF4 base)."""


class NF4LoraLinear(LoraLinear):
    """peft's LoRA layer over an :class:`NF4Linear` base. Merging is refused: the
    merged weight would have to be quantized again (load the adapter onto the
    unquantized base with peft to merge it)."""

    def __init__(self, base_layer, adapter_name: str, config, **kwargs) -> None:
        _check_supported(config)
        with warnings.catch_warnings():
            # peft warns of every custom layer type it reads in_features from
            warnings.filterwarnings("ignore", "Unsupported layer type .*NF4Linear")
            super().__init__(base_layer, adapter_name, config=config, **kwargs)

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise NotImplementedError(
            "a LoRA adapter over an NF4 base cannot be merged into it: save the adapter "
            "(save_pretrained), load it onto the unquantized base with "
            "peft.PeftModel.from_pretrained and merge there (merge_and_unload)"
        )


def check_lora_for_nf4(lora) -> None:
    """Refuse, before anything is read, a config that is not plain LoRA."""
    if not isinstance(lora, peft.LoraConfig):
        raise TypeError(
            "quantize='nf4' trains LoRA adapters: lora must be a peft.LoraConfig, got "
            f"{type(lora).__name__}"
        )
    _check_supported(lora)


def lora_config_for_nf4(lora: peft.LoraConfig, model) -> peft.LoraConfig:
    """A copy of ``lora`` that wraps :class:`NF4Linear` layers; ``target_modules=
    "all-linear"`` is resolved on ``model`` before its linears are quantized, to the
    names peft picks on the unquantized model."""
    config = copy.copy(lora)
    config = cast(peft.LoraConfig, _maybe_include_all_linear_layers(config, model))  # the same
    config._custom_modules = dict(lora._custom_modules or {})
    config._register_custom_module({NF4Linear: NF4LoraLinear})
    return config


def _check_supported(config) -> None:
    init = config.init_lora_weights
    if config.use_dora or (isinstance(init, str) and init.lower().startswith(_NEEDS_DENSE_BASE)):
        what = "use_dora=True" if config.use_dora else f"init_lora_weights={init!r}"
        raise ValueError(
            f"{what} needs the dense base weights, which quantize='nf4' does not keep: use "
            "plain LoRA (init_lora_weights True or 'gaussian'), or quantize=None"
        )
