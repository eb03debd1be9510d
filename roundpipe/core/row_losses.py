"""Per-row losses: whether a layer that computes a loss gives one value per row.

A run config's ``row_losses`` reaches the layers through :func:`row_losses` while they
run on a device (the runtime enters :func:`per_row_losses` around every layer, as it
enters :func:`~roundpipe.core.tiling.sequence_tiling`). The head of a ``from_hf`` model
then returns each row's summed token loss instead of the microbatch's sum, which a
sequence-level loss (DPO, KTO: :mod:`roundpipe.preference`) needs; other layers ignore it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

_ROWS: ContextVar[bool] = ContextVar("roundpipe_row_losses", default=False)


def row_losses() -> bool:
    """Whether a loss-computing layer running now should give one value per row."""
    return _ROWS.get()


@contextlib.contextmanager
def per_row_losses(on: bool) -> Iterator[None]:
    """Layers run inside see ``on`` as :func:`row_losses`."""
    token = _ROWS.set(on)
    try:
        yield
    finally:
        _ROWS.reset(token)
