"""Sequence tiling: how many tokens a layer may process at a time.

A run config's ``seq_chunk_tokens`` reaches the layers through :func:`seq_chunk_tokens`
while they run on a device (the runtime enters :func:`sequence_tiling` around every
layer). Layers that can work over sequence chunks read it (the MLPs of
``roundpipe.from_hf`` models: docs/design.md#long-context); others ignore it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

_CHUNK: ContextVar[int | None] = ContextVar("roundpipe_seq_chunk_tokens", default=None)


def seq_chunk_tokens() -> int | None:
    """The most tokens of a sequence a layer running now should process at once
    (``None``: the whole sequence)."""
    return _CHUNK.get()


@contextlib.contextmanager
def sequence_tiling(tokens: int | None) -> Iterator[None]:
    """Layers run inside see ``tokens`` as :func:`seq_chunk_tokens`."""
    token = _CHUNK.set(tokens)
    try:
        yield
    finally:
        _CHUNK.reset(token)
