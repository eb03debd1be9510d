"""``roundpipe.from_pretrained``: a local Hugging Face model directory as an ``HFRoundPipe``.

The model is built from its ``config.json`` on the ``meta`` device (no memory), then
each tensor is read from the safetensors file(s) straight into its final host tensor,
one at a time, so loading holds one copy of the weights (plus one tensor when the
file's dtype differs). With LoRA the frozen base weights are not even copied: they
are views of copy-on-write mappings of the files (:mod:`.safetensors_io`), so a base
model larger than the free RAM can train; only the adapters and what the devices are
working on take anonymous memory.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .checkpoint_layout import LoadItem, ModelTensor, plan_loading
from .converted_loading import has_conversion, load_converted, quantize_in_place
from .nf4 import QUANTIZE_CHOICES, quantize_linears
from .nf4_experts import check_target_parameters, quantize_experts
from .pipe import HFRoundPipe, from_hf
from .safetensors_io import (
    CheckpointError,
    FileMappings,
    checkpoint_tensors,
    is_mapped,
    read_into,
)
from .structure import UnsupportedModel, check_config, find_structure, text_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_ALWAYS_IGNORED = (r"rotary_emb\.inv_freq",)
"""Checkpoint tensors transformers ignores for every model: older checkpoints saved the
rotary tables, which are recomputed."""


def from_pretrained(
    path, *, torch_dtype=torch.bfloat16, lora=None, quantize=None, **options
) -> HFRoundPipe:
    """The model in the local directory ``path`` (``config.json`` and ``model.safetensors``,
    or shards listed in ``model.safetensors.index.json``) in ``torch_dtype``, as
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads it, wrapped with
    ``roundpipe.from_hf(model, **options)``. ``torch_dtype`` is a floating point
    ``torch.dtype``, its name, or ``"auto"``: the dtype ``config.json`` names (fp32 if none).

    Host memory: one copy of the weights (fp32 masters come later, with the first call
    or ``optim_parameters()``). With ``lora`` (a ``peft.LoraConfig``) the model is
    wrapped by ``peft.get_peft_model`` and every frozen base weight stored in
    ``torch_dtype`` stays a view of a copy-on-write mapping of its file: no copy, never
    page-locked (uploads from it are staged by the GPU driver), paged in and out by the
    kernel. Base weights stored in another dtype are converted, which makes a copy; so
    are stacked MoE experts (stored one per expert) and tensors whose bytes are not
    aligned in the file. Keep the files unchanged while the model lives.

    ``quantize="nf4"`` (with ``lora`` only) keeps the frozen base's linear layers and
    stacked MoE experts inside the decoder layers in host memory as NF4 with fp32 block
    scales, 0.5625 bytes a parameter (:class:`.nf4.NF4Linear`, :mod:`.nf4_experts`,
    bitsandbytes' format, each expert's weight on its own), quantized while loading,
    one tensor (or expert) at a time; devices receive the quantized bytes and
    dequantize per layer. Embeddings, norms, routers and the LM head stay as without it
    (docs/design.md#4-bit-bases).
    """
    _check_quantize(quantize, lora)
    model, items = plan_pretrained(path, torch_dtype=torch_dtype)
    if items is None:  # a layout transformers converts: it loads the model itself
        model = load_converted(Path(path), type(model), model.dtype)
    if quantize is not None:
        from .nf4_lora import lora_config_for_nf4

        lora = lora_config_for_nf4(lora, model)  # before the linears are replaced
        if items is None:
            quantize_in_place(model)
        else:
            items = quantize_experts(model, quantize_linears(model, items))
    if items is not None:
        _fill(model, items, FileMappings() if lora is not None else None)
        _recompute_buffers(model)
    model.eval()  # as transformers' from_pretrained leaves it
    if lora is not None:
        import peft

        with _targets_kept(quantize):
            model = peft.get_peft_model(model, lora)
        _copy_trainable_views(model)
    return from_hf(model, **options)


def _targets_kept(quantize) -> contextlib.AbstractContextManager[None]:
    """Around peft wrapping a quantized model: the targets resolved on the dense one."""
    if quantize is None:
        return contextlib.nullcontext()
    from .nf4_lora import targets_as_resolved

    return targets_as_resolved()


def _check_quantize(quantize, lora) -> None:
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {QUANTIZE_CHOICES}, got {quantize!r}")
    if quantize is not None and lora is None:
        raise ValueError(
            f"quantize={quantize!r} keeps the base weights frozen in 4 bits, so only "
            "adapters can train: pass lora=peft.LoraConfig(...) as well"
        )
    if quantize is not None:
        from .nf4_lora import check_lora_for_nf4  # imports peft

        check_lora_for_nf4(lora)
        check_target_parameters(lora)


def plan_pretrained(
    path, *, torch_dtype=torch.bfloat16
) -> tuple[PreTrainedModel, list[LoadItem] | None]:
    """What :func:`from_pretrained` checks and plans before it reads a tensor: the model
    of directory ``path`` on the ``meta`` device (no memory) and the checkpoint tensors
    that fill each of its tensors (``None``: a layout transformers converts while
    loading, :mod:`.converted_loading`). Refuses a directory without ``config.json``
    (FileNotFoundError), a quantized checkpoint, a model RoundPipe does not cut into
    layers (ValueError), and safetensors files that are truncated, lack a tensor, hold
    one the model has no place for or of another shape (:class:`CheckpointError`)."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"{directory} is not a Hugging Face model directory (it has no config.json); "
            "roundpipe.from_pretrained loads local directories only"
        )
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    _refuse_quantized(directory, config)
    check_config(config)
    torch_dtype = _resolved_dtype(torch_dtype, config)
    model = _empty_model(directory, config, torch_dtype)
    find_structure(text_model(model))  # a model no path runs is refused before anything is read
    stored = checkpoint_tensors(directory)
    try:
        items = plan_loading(_model_tensors(model, torch_dtype), stored, _ignored_patterns(model))
    except CheckpointError:
        if not has_conversion(model):
            raise
        return model, None
    return model, items


def _refuse_quantized(directory: Path, config) -> None:
    """Quantized weights (the official GPT-OSS releases are MXFP4) are not trainable
    weights: transformers dequantizes them on request, once, into a new directory."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return
    if isinstance(quantization, dict):  # as config.json has it
        method = quantization.get("quant_method")
    else:
        method = getattr(quantization, "quant_method", None)
    advice = "use the model's unquantized (bf16) release"
    if method == "mxfp4":
        advice += (
            ", or write bf16 weights from these: transformers.AutoModelForCausalLM"
            ".from_pretrained(DIR, quantization_config=transformers.Mxfp4Config("
            "dequantize=True), dtype=torch.bfloat16).save_pretrained(NEW_DIR), and the "
            "tokenizer beside them"
        )
    raise CheckpointError(
        f"{directory} holds quantized weights (quant_method {str(method)!r} in the "
        "quantization_config of config.json); RoundPipe trains bf16, fp16 or fp32 "
        f"weights: {advice}"
    )


def _empty_model(directory: Path, config, torch_dtype: torch.dtype) -> PreTrainedModel:
    """The model of ``config`` with its parameters on the meta device (no memory). A
    config with a vision tower builds the vision-language class, whose names its
    checkpoint has."""
    autos = _model_classes(config)
    model = None
    with torch.device("meta"):
        for auto in autos:
            with contextlib.suppress(ValueError):  # "Unrecognized configuration class"
                model = auto.from_config(config, dtype=torch_dtype)
                break
    if model is None:
        raise UnsupportedModel(
            f"model_type {config.model_type!r} has no causal LM or image-text-to-text "
            "class in transformers (AutoModelForCausalLM, AutoModelForImageTextToText); "
            "roundpipe trains decoder-only causal LMs (and vision-language models on text)"
        )
    if (directory / "generation_config.json").is_file():
        import transformers

        model.generation_config = transformers.GenerationConfig.from_pretrained(directory)
    return model


def _model_classes(config) -> list:
    import transformers

    autos = [transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText]
    if getattr(config, "vision_config", None) is not None:
        autos.reverse()
    return autos


def _resolved_dtype(torch_dtype, config) -> torch.dtype:
    if isinstance(torch_dtype, str) and torch_dtype == "auto":
        torch_dtype = getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, torch_dtype, None) if isinstance(torch_dtype, str) else torch_dtype
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(
            f"torch_dtype must be a floating point torch.dtype (e.g. torch.bfloat16), its "
            f"name, or 'auto'; got {torch_dtype!r}"
        )
    return dtype


def _model_tensors(model: nn.Module, torch_dtype: torch.dtype) -> list[ModelTensor]:
    """Every parameter and persistent buffer, tied ones once under all their names, in
    the dtype transformers loads it in."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, tuple[torch.Tensor, bool]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        tensors[id(param)] = (param, True)
    for name, buffer in _persistent_buffers(model):
        names.setdefault(id(buffer), []).append(name)
        tensors[id(buffer)] = (buffer, False)
    keep_fp32 = _fp32_patterns(model, torch_dtype)
    return [
        ModelTensor(
            tuple(names[uid]),
            tuple(tensor.shape),
            _load_dtype(names[uid][0], tensor, keep_fp32),
            is_parameter,
        )
        for uid, (tensor, is_parameter) in tensors.items()
    ]


def _persistent_buffers(model: nn.Module):
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


def _fp32_patterns(model: nn.Module, torch_dtype: torch.dtype) -> list[str]:
    """Modules transformers keeps in fp32 for this dtype (e.g. GPT-OSS norms in fp16)."""
    patterns = []
    if torch_dtype == torch.float16:
        patterns += list(getattr(model, "_keep_in_fp32_modules", None) or ())
    if torch_dtype in (torch.float16, torch.bfloat16):
        patterns += list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return patterns


def _load_dtype(name: str, tensor: torch.Tensor, keep_fp32: list[str]) -> torch.dtype:
    if any(re.search(pattern, name) for pattern in keep_fp32):
        return torch.float32
    return tensor.dtype


def _ignored_patterns(model: nn.Module) -> list[str]:
    """Checkpoint names transformers ignores for this model, and its non-persistent
    buffers (recomputed, never loaded)."""
    own = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    recomputed = [
        "^" + re.escape(f"{module_name}.{name}" if module_name else name) + "$"
        for module_name, module in model.named_modules()
        for name in module._non_persistent_buffers_set
    ]
    return [*_ALWAYS_IGNORED, *own, *recomputed]


def _fill(model: nn.Module, items: list[LoadItem], mappings: FileMappings | None) -> None:
    """Replace the model's meta tensors by host tensors holding the checkpoint's values:
    views of the file mappings where ``mappings`` is given and possible, else copies."""
    for item in items:
        target, whole = item.target, item.whole
        tensor = None
        if mappings is not None and whole is not None and whole.dtype == target.dtype:
            tensor = mappings.view(whole)
        if tensor is None:
            tensor = torch.empty(target.shape, dtype=target.dtype)
            for piece in item.pieces:
                read_into(piece.stored, tensor[piece.index])
        if target.is_parameter:
            meta = model.get_parameter(target.names[0])
            tensor = nn.Parameter(tensor, requires_grad=meta.requires_grad)
        for name in target.names:  # tied names get the same tensor
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            registry: dict[str, Any] = (
                module._parameters if target.is_parameter else module._buffers
            )
            registry[attr] = tensor


def _recompute_buffers(model: PreTrainedModel) -> None:
    """Compute the non-persistent buffers (the rotary tables, ``inv_freq``; Gemma's
    embedding scale), which are not in the checkpoint: by building their module again
    on the host from its config, or, for modules without one, the whole model again with
    its parameters on the meta device and its buffers on the host, as accelerate's
    ``init_empty_weights(include_buffers=False)`` builds it."""
    rebuilt = None
    for module_name, module in model.named_modules():
        stale = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not stale:
            continue
        config = getattr(module, "config", None)
        if config is not None:
            with torch.device("cpu"):
                fresh = type(module)(config)
        else:
            rebuilt = rebuilt or _with_host_buffers(model)
            fresh = rebuilt.get_submodule(module_name)
        for name in stale:
            module._buffers[name] = fresh._buffers[name]
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left unloaded on the meta device: {left}")


def _with_host_buffers(model: PreTrainedModel) -> PreTrainedModel:
    from accelerate import init_empty_weights

    dtype = next(model.parameters()).dtype
    with init_empty_weights(include_buffers=False):
        return type(model)._from_config(model.config, dtype=dtype)


def _copy_trainable_views(model: nn.Module) -> None:
    """A parameter peft made trainable (e.g. a bias with ``bias="all"``) is an ordinary
    host tensor, not a view of a file: the optimizer writes it."""
    for param in model.parameters():
        if param.requires_grad and is_mapped(param):
            param.data = param.data.clone()
