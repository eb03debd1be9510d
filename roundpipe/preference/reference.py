"""The reference model of a LoRA policy: the same pipe with its adapters off.

peft's ``disable_adapter()`` turns every adapter off (and freezes them for its
duration); the pipe sees its layers changed, runs the base weights it already holds
(the frozen base is uploaded as for every call, nothing is copied in host memory), and
turns them back on after. A full fine-tune has no such reference in the pipe: its
reference log-probabilities are computed once before training (``roundpipe train``) or
passed in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def is_lora_pipe(pipe) -> bool:
    """Whether ``pipe`` wraps a peft model (whose reference is its base)."""
    model = pipe.hf_model
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


@contextlib.contextmanager
def adapters_off(pipe) -> Iterator[None]:
    """Inside, ``pipe`` computes with its LoRA adapters off: the reference model."""
    if not is_lora_pipe(pipe):
        raise ValueError(
            "the pipe trains every weight, so it is not its own reference: compute the "
            "reference log-probabilities before training (pipe.sequence_logps on the "
            "untrained pipe) and pass them in"
        )
    with pipe.hf_model.disable_adapter():
        yield


def reference_logps(pipe, rows: dict) -> torch.Tensor:
    """Each row's log-probability under the reference (the pipe with adapters off)."""
    with adapters_off(pipe):
        return pipe.sequence_logps(rows)
