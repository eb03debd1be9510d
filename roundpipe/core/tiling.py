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

DEFAULT_SEQ_CHUNK_TOKENS = 4096
"""The chunk ``roundpipe train`` tiles long sequences in and the predictions assume:
big enough for a GPU's matmuls to run at full speed, small beside a long sequence."""

TILED_LOSS_LOGITS = 2**26
"""With sequence tiling, the most logits one chunk of a ``from_hf`` model's loss
computes at once (about 1.3 GB in its backward: 512 tokens of a 128K vocabulary)."""

TILED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss"})
"""The ``model_type``s whose ``from_hf`` layers tile (our own adapter's families,
``roundpipe.hf.families.FAMILIES``, kept equal by a test); every other model runs its
own layers as they are, untiled (docs/design.md#the-general-decoder-path)."""

SINK_DIMS = 8
"""Extra head dimensions that carry an attention sink through SDPA
(``roundpipe.hf.attention``; a multiple of 8 keeps fused kernels)."""

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
