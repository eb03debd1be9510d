"""A bounded pool of page-locked host blocks for downloads.

Every download must land in page-locked memory to be asynchronous. PyTorch's caching
host allocator rounds sizes up to powers of two and never gives memory back; this pool
uses size classes at most 6.25% apart, reuses a block once the copies recorded on it
have run, and keeps a bounded cache of idle blocks (docs/design.md#download-blocks).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch

PAGE = 4096
DEFAULT_CACHE_BYTES = 1 << 30
"""Idle page-locked bytes a pool keeps for reuse by default (1 GiB)."""


def block_size(nbytes: int) -> int:
    """The size class of a ``nbytes`` request: whole pages, and at most 1/16 above it."""
    if nbytes <= PAGE:
        return PAGE
    step = max(PAGE, 1 << (nbytes.bit_length() - 5))
    return -(-nbytes // step) * step


@dataclass(frozen=True)
class HostPoolStats:
    allocations: int
    """Blocks made page-locked since the pool was created."""
    reuses: int
    """Requests served from a cached block."""
    in_use_bytes: int
    """Held by live tensors."""
    pending_bytes: int
    """Freed, waiting for recorded copies to run before they can be reused."""
    cached_bytes: int
    """Idle and reusable (at most the pool's ``cache_bytes``)."""

    @property
    def held_bytes(self) -> int:
        """Page-locked bytes the pool still holds (0 after close once tensors died)."""
        return self.in_use_bytes + self.pending_bytes + self.cached_bytes


class _Block:
    __slots__ = ("address", "memory", "size", "uses")

    def __init__(self, memory: torch.Tensor, size: int) -> None:
        self.memory = memory  # uint8, ``size`` bytes, page-locked by the backend
        self.address = memory.data_ptr()
        self.size = size
        self.uses: list = []  # streams whose copies read or write it (record_use)


class _View:
    """Base of the buffer objects handed-out tensors view (a ctypes array over a block
    per size): it holds the block, and tells the pool when the last tensor dies."""

    block: _Block
    pool: HostBlockPool

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the pool may be gone
            self.pool._released(self.block)


class _ViewType(Protocol):
    """A ctypes array type over a block that is also a :class:`_View` (:func:`_view_type`)."""

    def from_address(self, address: int) -> _View: ...


@functools.cache
def _view_type(size: int) -> _ViewType:
    return cast(_ViewType, type("HostBlockView", (_View, ctypes.c_ubyte * size), {}))


class HostBlockPool:
    """Page-locked host blocks for downloads, reused by size class (see module doc)."""

    def __init__(
        self,
        cache_bytes: int,
        lock_memory: Callable[[int], torch.Tensor],
        unlock_memory: Callable[[torch.Tensor], None],
        mark: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """``lock_memory(size)``: a page-locked uint8 tensor of ``size`` bytes;
        ``unlock_memory(t)`` gives it back. ``mark(t)`` is called on each tensor handed
        out (the emulator marks its storage page-locked). Blocks are handed out as they
        are (a download overwrites all of it at once, in the op that asked for it)."""
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
        self.cache_bytes = cache_bytes
        self._lock_memory = lock_memory
        self._unlock_memory = unlock_memory
        self._mark = mark
        self._lock = threading.RLock()
        self._free: dict[int, list[_Block]] = collections.defaultdict(list)  # by size
        self._idle: collections.OrderedDict[int, _Block] = collections.OrderedDict()
        self._pending: list[tuple[_Block, list | None]] = []  # (block, events)
        self._freed: collections.deque[_Block] = collections.deque()  # from _View.__del__
        self._live: dict[int, _Block] = {}  # address -> block, while handed out
        self._allocations = self._reuses = 0
        self._in_use = self._cached = 0
        self.closed = False

    # -- handing out ---------------------------------------------------------------------

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous host tensor in a page-locked block."""
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)  # nothing to copy, nothing to lock
        block = self._take(block_size(nbytes))
        view = _view_type(block.size).from_address(block.address)
        view.block, view.pool = block, self  # the memory lives while a tensor views it
        tensor = torch.frombuffer(view, dtype=dtype, count=numel).view(shape)
        if self._mark is not None:
            self._mark(tensor)
        return tensor

    def record_use(self, tensor: torch.Tensor, stream) -> None:
        """An asynchronous copy on ``stream`` reads or writes ``tensor``'s block: the
        block is reused only after that stream's work issued before the free has run."""
        block = self._live.get(tensor.untyped_storage().data_ptr())
        if block is not None and stream not in block.uses:
            block.uses.append(stream)

    def _take(self, size: int) -> _Block:
        with self._lock:
            if self._freed or self._pending:
                self._collect()
            free = self._free.get(size)
            if free:
                block = free.pop()
                del self._idle[id(block)]
                self._cached -= size
                self._reuses += 1
            else:
                block = _Block(self._lock_memory(size), size)
                self._allocations += 1
            self._live[block.address] = block
            self._in_use += size
            return block

    # -- taking back ---------------------------------------------------------------------

    def _released(self, block: _Block) -> None:
        """The last tensor viewing ``block`` died: on any thread, maybe inside pool code
        (so it only queues the block; the next pool call files it under the lock)."""
        self._freed.append(block)
        if self.closed:  # set before close drains the queue: one of the two drains it
            with self._lock:
                self._drain_closed()

    def _drain_closed(self) -> None:
        """Under the lock, once closed: give back freed blocks at once."""
        while self._freed:
            block = self._freed.popleft()
            self._forget(block)
            self._unlock(block)

    def _forget(self, block: _Block) -> None:
        self._live.pop(block.address, None)
        self._in_use -= block.size

    def _collect(self) -> None:
        """Under the lock: file freed blocks, return those whose copies ran, trim."""
        while self._freed:
            block = self._freed.popleft()
            self._forget(block)
            if not block.uses:  # no copy recorded on it: reusable at once
                self._cache(block)
                continue
            uses, block.uses = block.uses, []
            events: list | None
            try:
                events = [stream.record() for stream in uses]
            except Exception:  # noqa: BLE001 - cannot order the reuse: never reuse it
                events = None
            self._pending.append((block, events))
        if self._pending:
            still = []
            for block, events in self._pending:
                if events is not None and all(event.query() for event in events):
                    self._cache(block)
                else:
                    still.append((block, events))
            self._pending = still
        if self._cached > self.cache_bytes:
            self._trim(self.cache_bytes)

    def _cache(self, block: _Block) -> None:
        self._free[block.size].append(block)
        self._idle[id(block)] = block
        self._cached += block.size

    def _trim(self, limit: int) -> None:
        while self._cached > limit and self._idle:
            _, block = self._idle.popitem(last=False)
            self._free[block.size].remove(block)
            self._cached -= block.size
            self._unlock(block)

    def _unlock(self, block: _Block) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the backend may be gone
            self._unlock_memory(block.memory)

    # -- statistics and closing ------------------------------------------------------------

    def stats(self) -> HostPoolStats:
        with self._lock:
            if not self.closed:
                self._collect()
            pending = sum(block.size for block, _ in self._pending)
            return HostPoolStats(
                self._allocations, self._reuses, self._in_use, pending, self._cached
            )

    def close(self, synchronize: Callable[[], None] | None = None) -> None:
        """Give back every idle and pending block (after ``synchronize()``, which waits
        for the device's copies); blocks in use are given back when their tensors die.
        Safe to call again."""
        with self._lock:
            if self.closed:
                return
            if synchronize is not None and (self._pending or self._freed):
                synchronize()
            self.closed = True
            self._drain_closed()  # their copies ran: synchronized above
            pending, self._pending = self._pending, []
            for block, _ in pending:
                self._unlock(block)
            self._trim(0)
