"""peft's LoRA over :class:`.nf4.NF4Linear` (imports peft: load it only for a quantized base).

peft wraps a module type it does not know through a LoRA layer registered on the
config (``LoraConfig._register_custom_module``, peft's documented way for custom
layers). The layer is peft's own dense ``lora.Linear``: it calls the base layer and
adds ``lora_B(lora_A(dropout(x))) * scaling``, so the adapters, their names and their
saved keys are those of the unquantized model (docs/design.md#4-bit-bases).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings
from collections.abc import Iterator
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
    """A copy of ``lora`` that wraps :class:`NF4Linear` layers, its targets resolved on
    ``model`` before its linears are quantized, to what peft picks on the unquantized
    model: ``target_modules="all-linear"``, and peft's conversion of a mixture of
    experts' targets to transformers v5 (which tells a dense linear from the stacked
    experts by ``isinstance(module, nn.Linear)``, which an NF4Linear is not; wrap the
    quantized model under :func:`targets_as_resolved`)."""
    config = copy.deepcopy(lora)
    config = cast(peft.LoraConfig, _maybe_include_all_linear_layers(config, model))  # the same
    conversion = _transformers_conversion()
    if conversion is not None:
        conversion.convert_peft_config_for_transformers(
            config, model=model, conversions=conversion.get_model_conversion_mapping(model)
        )
    config._custom_modules = dict(lora._custom_modules or {})
    config._register_custom_module({NF4Linear: NF4LoraLinear})
    return config


@contextlib.contextmanager
def targets_as_resolved() -> Iterator[None]:
    """While peft wraps a quantized model: its targets stay as :func:`lora_config_for_nf4`
    resolved them on the dense model (peft would convert them again, and drop the dense
    linears of a mixture of experts, now NF4Linear, as if they were stacked experts)."""
    conversion = _transformers_conversion()
    if conversion is None:
        yield
        return
    with _CONVERSION_LOCK:
        convert = conversion.convert_peft_config_for_transformers
        conversion.convert_peft_config_for_transformers = _converted_already
        try:
            yield
        finally:
            conversion.convert_peft_config_for_transformers = convert


_CONVERSION_LOCK = threading.Lock()


def _converted_already(peft_config, model, conversions) -> None:
    """peft's conversion, for a config :func:`lora_config_for_nf4` converted already."""


def _transformers_conversion():
    """peft's module converting configs to transformers v5's models (None: a peft
    without it)."""
    try:
        from peft.utils import transformers_weight_conversion
    except ImportError:
        return None
    if not hasattr(transformers_weight_conversion, "convert_peft_config_for_transformers"):
        return None
    return transformers_weight_conversion


def _check_supported(config) -> None:
    init = config.init_lora_weights
    if config.use_dora or (isinstance(init, str) and init.lower().startswith(_NEEDS_DENSE_BASE)):
        what = "use_dora=True" if config.use_dora else f"init_lora_weights={init!r}"
        raise ValueError(
            f"{what} needs the dense base weights, which quantize='nf4' does not keep: use "
            "plain LoRA (init_lora_weights True or 'gaussian'), or quantize=None"
        )
