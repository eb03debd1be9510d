"""The result of a run in ``--output``: the adapter (LoRA) or the model (``--full``) with
its tokenizer, so that ``--output`` loads on its own; and whether a complete one is
there (a run killed while it wrote the result is finished but for it)."""

from __future__ import annotations

import json
from pathlib import Path

from ..hf.safetensors_io import checkpoint_tensors, read_header
from .quiet import quiet_transformers


def result_name(full: bool) -> str:
    return "model" if full else "LoRA adapter"


def save_result(pipe, tokenizer, output: Path, main: bool) -> None:
    """Write the result (collective under ``torchrun``: rank 0, ``main``, writes)."""
    with quiet_transformers():
        pipe.save_pretrained(output)
    if main:
        tokenizer.save_pretrained(output)


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


def result_bytes(pipe, full: bool) -> int:
    """About the bytes of the result's weights: the adapter's or the whole model's."""
    return sum(p.nbytes for p in pipe.hf_model.parameters() if full or p.requires_grad)
