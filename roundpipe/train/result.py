"""The result of a run in ``--output``: the adapter (LoRA) or the model (``--full``) with
its tokenizer, so that ``--output`` loads on its own; and whether a complete one is
there (a run killed while it wrote the result is finished but for it).

A model is saved in the dtype of the base model's weights as stored, or
``--save-dtype`` (an fp32 run of a bf16 model would otherwise write twice its size);
an adapter as peft saves it, in the dtype its weights trained in
(docs/design.md#the-saved-dtype).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from ..hf.safetensors_io import checkpoint_tensors, read_header
from .quiet import quiet_transformers

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The dtype of each ``--precision`` and ``--save-dtype`` name."""


def result_name(full: bool) -> str:
    return "model" if full else "LoRA adapter"


def stored_dtype(directory: Path) -> torch.dtype:
    """The dtype of a model directory's weights as stored: that of most of the bytes of
    its floating point tensors (a few, such as norms, may be kept in fp32)."""
    sizes: Counter[torch.dtype] = Counter()
    for stored in checkpoint_tensors(Path(directory)).values():
        if stored.dtype.is_floating_point:
            sizes[stored.dtype] += stored.nbytes
    return sizes.most_common(1)[0][0] if sizes else torch.float32


def save_dtype(options, base: Path) -> torch.dtype | None:
    """The dtype a ``--full`` result is saved in (``None`` for an adapter, which peft
    saves as it is): ``--save-dtype``, else that of the base model in ``base``."""
    if not options.full:
        return None
    if options.save_dtype is not None:
        return DTYPES[options.save_dtype]
    return stored_dtype(base)


def save_result(pipe, tokenizer, output: Path, main: bool, dtype: torch.dtype | None = None):
    """Write the result of ``pipe``, an ``HFRoundPipe`` (collective under ``torchrun``:
    rank 0, ``main``, writes) or a transformers or peft model (``roundpipe export``); a
    model with its weights converted to ``dtype`` when given."""
    model = pipe.hf_model if hasattr(pipe, "hf_model") else pipe
    extra = {}
    if dtype is not None and main:
        extra["state_dict"] = converted_state(model, dtype)
    with quiet_transformers():
        pipe.save_pretrained(output, **extra)
        if dtype is not None and main:
            record_dtype(model, output, dtype)
    if main:
        tokenizer.save_pretrained(output)


def converted_state(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``model``'s state dict, its floating point tensors converted to ``dtype`` (no copy
    where they already are); tensors sharing memory (tied weights) still share it, so
    transformers saves one of them."""
    converted: dict[tuple, torch.Tensor] = {}
    state = {}
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point():
            state[name] = tensor
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if key not in converted:
            converted[key] = tensor.to(dtype)
        state[name] = converted[key]
    return state


def record_dtype(model, output: Path, dtype: torch.dtype) -> None:
    """Rewrite ``config.json``'s dtype: transformers writes that of the model's
    parameters, not of the state dict it was given (the weights' dtype, which
    ``dtype="auto"`` loads them in)."""
    model.config.dtype = str(dtype).removeprefix("torch.")
    model.config.save_pretrained(output)


def result_complete(output: Path, full: bool) -> bool:
    """Whether ``output`` holds the whole result: its config and tokenizer config parse,
    and its weight files hold every byte their headers claim."""
    try:
        if full:
            json.loads((output / "config.json").read_text())
            checkpoint_tensors(output)
        else:
            json.loads((output / "adapter_config.json").read_text())
            read_header(output / "adapter_model.safetensors")
        json.loads((output / "tokenizer_config.json").read_text())
    except (OSError, ValueError):  # a CheckpointError is a ValueError
        return False
    return True


def result_bytes(pipe, full: bool, dtype: torch.dtype | None = None) -> int:
    """About the bytes of the result's weights: the adapter's or the whole model's (in
    ``dtype`` when given)."""
    return sum(
        p.numel() * (dtype.itemsize if dtype is not None else p.element_size())
        for p in pipe.hf_model.parameters()
        if full or p.requires_grad
    )
