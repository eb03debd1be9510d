"""The emulated backend's device memory, accounted the way CUDA's caching allocator does.

It charges and frees memory as a GPU would, so that capacity errors and stream-ordered
reuse show up in tests on the CPU (see ``docs/design.md``, "Emulated backend").
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ...errors import format_bytes


def poison_value(dtype: torch.dtype) -> float | int | bool:
    """What a poisoned block holds: NaN, all bits set for integers, True."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return -1 if dtype.is_signed else torch.iinfo(dtype).max


def poison(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.fill_(poison_value(tensor.dtype))


def _storage_objects_preserved() -> bool:
    t = torch.empty(1)
    return t.untyped_storage() is t.untyped_storage()


_BY_STORAGE = _storage_objects_preserved()


def _owner(tensor: torch.Tensor) -> object:
    """What owns a block's memory: its storage (freed when the last tensor using it,
    views and ``detach()`` aliases included, dies). PyTorch versions that do not keep
    one Python object per storage fall back to the tensor object handed out."""
    return tensor.untyped_storage() if _BY_STORAGE else tensor


class _Block:
    __slots__ = ("death", "nbytes", "stream", "uses")

    def __init__(self, nbytes: int, stream) -> None:
        self.nbytes = nbytes
        self.stream = stream  # the stream it was allocated for (None: unknown)
        self.uses: list = []  # other streams that used it (record_stream)
        self.death: weakref.ref | None = None  # calls _free when the owner dies


class DeviceMemory:
    """One emulated device's memory: capacity, in-use bytes, peak, pending frees.

    - Memory is taken when ``allocate`` is *called*. The runtime calls it on the issuing
      thread for what it can size then (a stage's weights), as PyTorch does on CUDA, so
      the capacity is checked against what the host has issued, not what has run.
    - A freed block is usable again by the stream it was allocated on at once (that
      stream's later work runs after the work that used it), and by any other stream
      only after the work issued, at the moment it was freed, on every stream the block
      was marked as used by (``keep_alive``, CUDA's ``record_stream``) has run. Until
      then it still counts as in use.
    - A block handed out is poisoned (NaN, or all bits set for integers), so reading
      memory nobody wrote (a missing copy, a chunk left out) gives a wrong result
      instead of a lucky zero.
    - What a layer computes on the device (activations, tensors autograd saves, logits)
      is device memory too: inside a compute op, :class:`ComputeAllocations` counts every
      tensor an operator creates (a storage that is none of its inputs') from its creation
      until its storage dies, and raises the out-of-memory error a kernel launch would.
    """

    def __init__(
        self,
        index: int,
        capacity: int | None,
        poison_blocks: bool,
        current_stream: Callable[[], object],
    ) -> None:
        self.index = index
        self.capacity = capacity
        self.poison_blocks = poison_blocks
        self._current_stream = current_stream
        self._lock = threading.Lock()
        self._in_use = 0
        self._peak = 0
        self._pending: list[tuple[int, list]] = []  # (bytes, events) of frees not yet reusable
        self._blocks: dict[int, _Block] = {}  # id(owner) -> block, while the memory lives
        self.closed = False

    # -- allocation ----------------------------------------------------------------

    def allocate(self, like: torch.Tensor, stream=None) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        self._take(nbytes)
        if self.poison_blocks:  # one call: allocated and poisoned
            tensor = torch.full(like.shape, poison_value(like.dtype), dtype=like.dtype)
        else:
            tensor = torch.empty(like.shape, dtype=like.dtype)
        self._track(tensor, nbytes, stream)
        return tensor

    def adopt(self, tensor: torch.Tensor, stream) -> None:
        """Count ``tensor``, just created by an operator of a compute op on ``stream``,
        until its storage dies."""
        nbytes = tensor.untyped_storage().nbytes()
        self._take(nbytes)
        self._track(tensor, nbytes, stream)

    def _take(self, nbytes: int) -> None:
        with self._lock:
            self._reclaim()
            if self.capacity is not None and self._in_use + nbytes > self.capacity:
                raise torch.OutOfMemoryError(
                    f"emulated device {self.index} is out of memory: allocating "
                    f"{format_bytes(nbytes)} with {format_bytes(self._in_use)} in use "
                    f"exceeds its capacity of {format_bytes(self.capacity)}"
                )
            self._in_use += nbytes
            self._peak = max(self._peak, self._in_use)

    def _track(self, tensor: torch.Tensor, nbytes: int, stream) -> None:
        block = _Block(nbytes, stream)
        owner = _owner(tensor)
        key = id(owner)
        self._blocks[key] = block
        block.death = weakref.ref(owner, functools.partial(self._free, key))

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        block = self._blocks.get(id(_owner(tensor)))
        if block is not None and stream is not block.stream and stream not in block.uses:
            block.uses.append(stream)

    def is_resident(self, tensor: torch.Tensor) -> bool:
        return id(_owner(tensor)) in self._blocks

    def _free(self, key: int, _death=None) -> None:
        """The block's tensor died (on any thread, possibly inside an op). Called while
        the owner is being destroyed, before its id can be reused."""
        block = self._blocks.pop(key, None)
        if block is None:
            return
        current = self._current_stream()
        waits = [s for s in block.uses if s is not current]
        events = []
        if waits and not self.closed:
            try:
                events = [stream.record() for stream in waits]
            except Exception:  # noqa: BLE001 - a stopped stream: nothing left to wait for
                events = []
        with self._lock:
            if events:
                self._pending.append((block.nbytes, events))
            else:
                self._in_use -= block.nbytes

    def _reclaim(self) -> None:
        """Under the lock: return frees whose recorded work has run."""
        if not self._pending:
            return
        still = []
        for nbytes, events in self._pending:
            if all(event.query() for event in events):
                self._in_use -= nbytes
            else:
                still.append((nbytes, events))
        self._pending = still

    # -- statistics ----------------------------------------------------------------

    def in_use(self) -> int:
        with self._lock:
            self._reclaim()
            return self._in_use

    def peak(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        with self._lock:
            self._reclaim()
            self._peak = self._in_use


class ComputeAllocations(TorchDispatchMode):
    """Inside a compute op: every tensor an operator creates is an allocation of the
    device's memory (what runs on a GPU allocates there). A storage that one of the
    operator's inputs already has is a view or an in-place result, not a new block."""

    def __init__(self, memory: DeviceMemory, stream) -> None:
        super().__init__()
        self.memory = memory
        self.stream = stream

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not _BY_STORAGE:
            return out
        inputs = {
            id(t.untyped_storage())
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if id(storage) in inputs or not storage.nbytes() or self.memory.is_resident(tensor):
                continue
            inputs.add(id(storage))
            self.memory.adopt(tensor, self.stream)
        return out
