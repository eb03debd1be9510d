"""The master parameters a RoundPipe model's optimizer trains, and views of them."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed
from torch import nn

from .parts import PipeParts


class ParameterViews(PipeParts):
    """``optim_parameters()`` and friends of :class:`~roundpipe.RoundPipe`.

    On several nodes each node's masters are its share of the model's trainable
    parameters (whole tensors, the same names); ``clip_grad_norm_`` then clips by the
    norm over every node's gradients.
    """

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        """The master (optimizer) parameters; build your optimizer over these."""
        for _, master in self.runtime.masters():
            yield master

    def optim_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self.runtime.masters()

    @contextlib.contextmanager
    def optimizer_ctx(self) -> Iterator[None]:
        """Inside, ``parameters()`` / ``named_parameters()`` yield the master parameters."""
        self._optimizer_view += 1
        try:
            yield
        finally:
            self._optimizer_view -= 1

    OptimizerCtx = optimizer_ctx

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The wrapped model's parameters; the masters inside :meth:`optimizer_ctx` and
        inside ``step_fn``, where their gradients are the ones a step applies (so
        ``torch.nn.utils.clip_grad_norm_(pipe.parameters(), ...)`` clips those)."""
        if self._masters_meant():
            return self.optim_parameters()
        return super().parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        if self._masters_meant():
            return self.optim_named_parameters()
        return super().named_parameters(*args, **kwargs)

    def _masters_meant(self) -> bool:
        if self._optimizer_view:
            return True
        if not self.runtime.in_step_fn():
            return False
        if self.runtime.node is not None:
            raise RuntimeError(
                "inside step_fn on several nodes, pipe.parameters() would be this node's "
                "share of the master parameters, and a gradient norm over them "
                "(torch.nn.utils.clip_grad_norm_) would miss the other nodes' gradients; "
                "call pipe.clip_grad_norm_(max_norm) (over every node's gradients), or "
                "pipe.optim_parameters() for this node's share"
            )
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients the next step would apply, as ``model.zero_grad()`` in
        PyTorch: it first waits for the calls in flight (and the steps queued before
        them) to deliver theirs. Inside ``step_fn`` it clears what the step applies, at
        once. With ``set_to_none=False`` the gradients become zeros instead of ``None``
        (an Adam step then still moves the weights, as in PyTorch). On several nodes
        every rank calls it."""
        self.runtime.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Inside ``step_fn``: scale the masters' gradients so that their norm over the
        whole model (every node's share) is at most ``max_norm``; returns that norm, as
        ``torch.nn.utils.clip_grad_norm_`` does for one process. On several nodes every
        rank's ``step_fn`` must call it (a collective)."""
        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
        if norm_type not in (2, 2.0, math.inf):
            raise ValueError(f"norm_type must be 2.0 or math.inf, got {norm_type!r}")
        node = self.node
        if node is None:
            return torch.nn.utils.clip_grad_norm_(
                list(self.optim_parameters()), max_norm, norm_type
            )
        if not self.runtime.in_step_fn():
            raise RuntimeError(
                "clip_grad_norm_ across nodes is a collective of the optimizer thread: call "
                "it inside step_fn (pipe.step(lambda: (pipe.clip_grad_norm_(1.0), ...)))"
            )
        grads = [p.grad for p in self.optim_parameters() if p.grad is not None]
        if norm_type == math.inf:
            local = max((float(g.abs().max()) for g in grads), default=0.0)
            total = torch.tensor([local], dtype=torch.float64)
            node.all_reduce(total, torch.distributed.ReduceOp.MAX)
            norm = total[0]
        else:
            local = sum(float(g.double().pow(2).sum()) for g in grads)
            total = torch.tensor([local], dtype=torch.float64)
            node.all_reduce(total, torch.distributed.ReduceOp.SUM)
            norm = total[0].sqrt()
        scale = max_norm / (float(norm) + 1e-6)
        if scale < 1:
            with torch.no_grad():
                for g in grads:
                    g.mul_(scale)
        return norm.float()
