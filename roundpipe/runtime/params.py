"""Host-memory home of the training state (DESIGN.md §2, §5).

For every unique parameter of the wrapped model: the user's parameter (model dtype,
what devices upload), and for a trainable one an fp32 (``optim_dtype``) *master*
copy that the user's optimizer updates, with the master's accumulated gradient.
Which weights a call uploads is decided by :mod:`.versions`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch
from torch import nn

from .layers import LayerBinding

_HALF_TYPES = (torch.float16, torch.bfloat16)


class ParamEntry:
    """One unique parameter of the wrapped model (tied parameters share an entry)."""

    def __init__(self, name: str, param: nn.Parameter, optim_dtype: torch.dtype | None) -> None:
        self.name = name
        self.param = param
        self.trainable = param.requires_grad
        self.optim_dtype = optim_dtype or (
            torch.float32 if param.dtype in _HALF_TYPES else param.dtype
        )
        self.master: nn.Parameter | None = None
        self.seen = (param.data_ptr(), param._version)

    def externally_modified(self) -> bool:
        """Whether the user wrote into (or replaced) the parameter since we last looked."""
        return (self.param.data_ptr(), self.param._version) != self.seen

    def mark_seen(self) -> None:
        self.seen = (self.param.data_ptr(), self.param._version)

    def show_grad(self) -> None:
        """Show the master's accumulated gradient on the user's parameter."""
        grad = None if self.master is None else self.master.grad
        self.param.grad = None if grad is None else grad.to(self.param.dtype, copy=True)


class ParameterStore:
    """Master copies, gradients and upload buffers for all layers' parameters."""

    def __init__(
        self,
        layers: list[LayerBinding],
        named_params: dict[int, str],
        optim_dtype: torch.dtype | None,
        pin,
    ) -> None:
        self.entries: dict[int, ParamEntry] = {}
        for layer in layers:
            for tensor in layer.module.parameters():
                if id(tensor) not in self.entries:
                    name = named_params.get(id(tensor), f"{layer.name}.?")
                    self.entries[id(tensor)] = ParamEntry(name, tensor, optim_dtype)
        for entry in self.entries.values():
            pinned = pin(entry.param.data)
            if pinned is not entry.param.data:
                entry.param.data = pinned
            entry.mark_seen()
        self.user_param_ids = frozenset(id(entry.param) for entry in self.entries.values())
        self._grad_lock = threading.Lock()

    # -- master copies -------------------------------------------------------------

    def ensure_masters(self) -> None:
        for entry in self.entries.values():
            if entry.trainable and entry.master is None:
                master = entry.param.detach().to(entry.optim_dtype, copy=True)
                entry.master = nn.Parameter(master, requires_grad=True)

    def masters(self) -> Iterator[tuple[str, nn.Parameter]]:
        self.ensure_masters()
        for entry in self.entries.values():
            if entry.master is not None:
                yield entry.name, entry.master

    def check_trainable(self) -> None:
        """Refuse parameters frozen or unfrozen after wrapping: masters, gradient traffic
        and uploads were set up for ``requires_grad`` as it was then."""
        for entry in self.entries.values():
            if entry.param.requires_grad != entry.trainable:
                now = "frozen" if entry.trainable else "unfrozen"
                raise RuntimeError(
                    f"parameter {entry.name} was {now} after the model was wrapped in "
                    "RoundPipe; set requires_grad before wrapping it"
                )

    def trainable(self, uid: int) -> bool:
        return self.entries[uid].trainable

    # -- gradients -----------------------------------------------------------------

    def accumulate_grad(self, uid: int, grad: torch.Tensor, scale: float | None = None) -> None:
        """Add a downloaded gradient, unscaled by the loss ``scale`` it was computed with."""
        entry = self.entries[uid]
        assert entry.master is not None
        grad = grad.to(entry.optim_dtype, copy=True)
        if scale is not None:
            grad.div_(scale)
        with self._grad_lock:
            if entry.master.grad is None:
                entry.master.grad = grad
            else:
                entry.master.grad.add_(grad)

    def scale_grads(self, factor: float) -> None:
        """Multiply every accumulated gradient by ``factor`` (to hand them to a GradScaler)."""
        with torch.no_grad():
            for _, master in self.masters():
                if master.grad is not None:
                    master.grad.mul_(factor)

    def discard_grads(self) -> None:
        for _, master in self.masters():
            master.grad = None
