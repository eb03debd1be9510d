"""What the parts of :class:`~roundpipe.RoundPipe` (its mixins) share, declared once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..devices.base import DevicePool
from ..runtime.calls import Runtime

if TYPE_CHECKING:
    from ..cluster import NodeSync


class PipeParts(nn.Module):
    """The attributes and methods :class:`~roundpipe.RoundPipe` gives every mixin."""

    runtime: Runtime
    """The call owner."""
    model: nn.Module
    """The wrapped ``nn.Sequential``."""
    pool: DevicePool
    _optimizer_view: int
    """How deeply the caller is inside ``optimizer_ctx()``."""

    @property
    def node(self) -> NodeSync | None:
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError
