"""Host-memory home of the training state (DESIGN.md §2, §5).

For every trainable parameter: the user's parameter (model dtype, what devices
upload), an optional second upload buffer for the asynchronous optimizer, an fp32
(``optim_dtype``) *master* copy that the user's optimizer updates, and the master's
accumulated gradient.

Weight versions: version ``v`` (the weights after ``v`` optimizer steps) lives in
upload buffer ``v % 2``. A call reads one version for all its uploads. With the
asynchronous optimizer a call reads the version before the newest step, so the
optimizer can write the newest step into the other buffer meanwhile — training is
exactly one step stale, never a mix. Publishing version ``v`` overwrites version
``v - 2``, whose last reader finished before the step that publishes ``v`` began.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch
from torch import nn

from .layers import LayerBinding
from .sync import VersionGate

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
        self.spare: torch.Tensor | None = None  # upload buffer for odd versions
        self.spare_version = -1
        self.seen = (param.data_ptr(), param._version)

    def upload_source(self, version: int) -> torch.Tensor:
        if not self.trainable or version % 2 == 0 or self.spare is None:
            return self.param.data
        return self.spare

    def externally_modified(self) -> bool:
        return (self.param.data_ptr(), self.param._version) != self.seen


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
        self._pin = pin
        for entry in self.entries.values():
            pinned = pin(entry.param.data)
            if pinned is not entry.param.data:
                entry.param.data = pinned
            entry.seen = (entry.param.data_ptr(), entry.param._version)
        self.published = VersionGate(0)
        self._grad_lock = threading.Lock()
        self._masters_built = False
        self._odd_version_ready = False

    # -- master copies -------------------------------------------------------------

    def ensure_masters(self) -> None:
        if self._masters_built:
            return
        for entry in self.entries.values():
            if entry.trainable:
                master = entry.param.detach().to(entry.optim_dtype, copy=True)
                entry.master = nn.Parameter(master, requires_grad=True)
        self._masters_built = True

    def masters(self) -> Iterator[tuple[str, nn.Parameter]]:
        self.ensure_masters()
        for entry in self.entries.values():
            if entry.master is not None:
                yield entry.name, entry.master

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

    # -- weight versions -------------------------------------------------------------

    def publish(self, version: int) -> None:
        """Write the masters into the upload buffer of ``version`` and announce it."""
        with torch.no_grad():
            for entry in self.entries.values():
                if entry.master is None:
                    continue
                self._writable_source(entry, version).copy_(entry.master)
        self.published.advance_to(version)

    def republish_unchanged(self, version: int) -> None:
        """After a failed step: version ``version`` equals ``version - 1``."""
        with torch.no_grad():
            for entry in self.entries.values():
                if entry.master is None:
                    continue
                previous = entry.upload_source(version - 1)
                target = self._writable_source(entry, version)
                if target is not previous:
                    target.copy_(previous)
                entry.master.copy_(previous)
        self.published.advance_to(version)

    def _writable_source(self, entry: ParamEntry, version: int) -> torch.Tensor:
        """The upload buffer of ``version``, allocating the odd-version one on first use."""
        if version % 2 and entry.spare is None:
            entry.spare = self._pin(torch.empty_like(entry.param.data))
        return entry.upload_source(version)

    def make_model_current(self) -> None:
        """With nothing in flight: the user's parameters and ``.grad`` show the newest state."""
        version = self.published.value
        with torch.no_grad():
            for entry in self.entries.values():
                if entry.master is None:
                    continue
                source = entry.upload_source(version)
                if source is not entry.param.data:
                    entry.param.data.copy_(source)
                grad = entry.master.grad
                entry.param.grad = None if grad is None else grad.to(entry.param.dtype, copy=True)
                entry.seen = (entry.param.data_ptr(), entry.param._version)

    def adopt_external_writes(self, force: bool = False) -> list[str]:
        """With nothing in flight: take over weights the user wrote into the model."""
        adopted = []
        version = self.published.value
        with torch.no_grad():
            for entry in self.entries.values():
                if not (force or entry.externally_modified()):
                    continue
                adopted.append(entry.name)
                pinned = self._pin(entry.param.data)
                if pinned is not entry.param.data:
                    entry.param.data = pinned
                if entry.master is not None:
                    entry.master.copy_(entry.param.data)
                if entry.trainable and version % 2:
                    assert entry.spare is not None
                    entry.spare.copy_(entry.param.data)
                entry.seen = (entry.param.data_ptr(), entry.param._version)
        return adopted
