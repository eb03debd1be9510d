"""Lean optimizers for the host masters (docs/design.md#host-memory).

:func:`make_adamw` builds AdamW with the moments in fp32, bf16 or 8 bits (torchao's
block-wise format: about 2 bytes per parameter instead of 8) over fp32 or bf16 masters,
optionally rounding bf16 masters stochastically. :class:`AdamW8bit` and :class:`AdamW`
(torchao's steps, made fast and deterministic on CPU) need ``torchao``
(``roundpipe-ft[torchao]``) and are imported on first use.
"""

from __future__ import annotations

from .factory import STATES, make_adamw

__all__ = ["STATES", "AdamW", "AdamW8bit", "make_adamw"]


def __getattr__(name: str):
    if name in ("AdamW", "AdamW8bit"):
        from .factory import _lean_module

        return getattr(_lean_module(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
