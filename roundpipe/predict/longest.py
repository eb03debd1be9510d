"""The longest sequence that trains at batch 1, and what bounds it.

The search asks a memory law (:func:`roundpipe.predict.models.max_seq_len` builds it:
the finest plan, every layer's input saved on the host, the tiled layers of
docs/design.md#long-context) what a length needs on the fullest GPU and on the host,
and bisects to the nearest ``GRANULARITY`` tokens. The answer says which memory ran out
first and, on the GPU, in which unit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from .breakdown import DeviceMemory, HostRam

GRANULARITY = 256
CEILING = 2**24
"""The search stops here (16M tokens): beyond it, nothing in a decoder layer's memory
would bound the length before the host's."""


@dataclass(frozen=True)
class MemoryAt:
    """What one length needs: the fullest GPU's memory (in ``unit``) and host RAM."""

    device: DeviceMemory
    unit: str
    """The unit whose stage peaks: ``"embedding"``, ``"decoder layer 3"``, ``"head"``."""
    host: HostRam


@dataclass(frozen=True)
class Longest:
    """The longest sequence that fits, and why not one ``GRANULARITY`` longer."""

    max_seq_len: int
    bound_by: str
    """``"gpu"``, ``"host_ram"``, or ``"ceiling"`` (the search's end)."""
    limit: str
    """In words: which unit's stage, or the host RAM, ran out."""
    gpu_memory: int
    """Bytes on the fullest GPU at ``max_seq_len``."""
    gpu_budget: int
    host_ram: int
    """Host RAM the run needs at ``max_seq_len``."""
    host_ram_budget: int | None
    saved_activations: int
    """Of ``host_ram``, the layers' saved inputs (they grow with the sequence)."""
    seq_chunk_tokens: int | None
    """The chunk of the tiled layers the law assumed (``None``: untiled)."""

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def text(self) -> str:
        gib = 2**30
        reason = {
            "gpu": f"{GRANULARITY} tokens more overflow the GPU in the stage of {self.limit}",
            "host_ram": f"{GRANULARITY} tokens more overflow the host RAM",
            "ceiling": f"the search stops at {CEILING} tokens",
        }[self.bound_by]
        tiled = (
            f"MLP and norms tiled in chunks of {self.seq_chunk_tokens} tokens"
            if self.seq_chunk_tokens
            else "untiled layers"
        )
        return (
            f"up to {self.max_seq_len} tokens at batch 1 ({tiled}, every layer's input "
            f"saved on the host): {reason}; GPU {self.gpu_memory / gib:.1f} of "
            f"{self.gpu_budget / gib:.1f} GiB usable, host RAM {self.host_ram / gib:.1f} GiB "
            f"({self.saved_activations / gib:.1f} GiB of saved layer inputs)"
        )


def search(measure: Callable[[int], MemoryAt], gpu_budget: int, host_budget: int | None) -> Longest:
    """The longest length, a multiple of ``GRANULARITY``, whose :class:`MemoryAt` fits
    ``gpu_budget`` and (when known) ``host_budget``."""
    measure = functools.cache(measure)  # the bisection and the answer ask again

    def failure(at: MemoryAt) -> str | None:
        if at.device.total > gpu_budget:
            return "gpu"
        if host_budget is not None and at.host.total > host_budget:
            return "host_ram"
        return None

    low, high = 0, GRANULARITY
    while failure(measure(high)) is None and high < CEILING:
        low, high = high, high * 2
    while high - low > GRANULARITY:
        middle = (low + high) // 2 // GRANULARITY * GRANULARITY
        low, high = (middle, high) if failure(measure(middle)) is None else (low, middle)
    over = measure(high)
    why = failure(over) or "ceiling"
    at = measure(max(low, GRANULARITY))
    return Longest(
        max_seq_len=low,
        bound_by=why,
        limit=over.unit if why == "gpu" else "host RAM",
        gpu_memory=at.device.total if low else 0,
        gpu_budget=gpu_budget,
        host_ram=at.host.total if low else 0,
        host_ram_budget=host_budget,
        saved_activations=at.host.saved_activations if low else 0,
        seq_chunk_tokens=None,
    )
