"""Which host storages are registered with ``cudaHostRegister``, for the whole process.

Several pools may page-lock one storage (two pipes over one frozen base): the first
registers it, the others hold it too, and it is unregistered only when the last holder
gives it back, never under another pool's copies. A holder gives a storage back at its
``close()``, or earlier when the runtime stops using it (a parameter the user replaced:
:meth:`roundpipe.devices.base.DevicePool.unpin`), so replaced storages do not stay
locked and alive until then.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class HostRegistrations:
    """Registered storages by address, each with the number of holds on it."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[torch.UntypedStorage, int]] = {}
        self._lock = threading.Lock()

    def hold(self, address: int) -> bool:
        """Take one more hold on a registered storage; whether it is registered."""
        with self._lock:
            if address not in self._held:
                return False
            storage, holds = self._held[address]
            self._held[address] = (storage, holds + 1)
            return True

    def add(self, storage: torch.UntypedStorage) -> None:
        """A storage just registered, with its first hold (kept alive until released)."""
        with self._lock:
            self._held[storage.data_ptr()] = (storage, 1)

    def release(self, address: int, unregister: Callable[[int], None]) -> None:
        """Give one hold back; the last one unregisters the storage (``unregister``)."""
        with self._lock:
            if address not in self._held:
                return
            storage, holds = self._held[address]
            if holds > 1:
                self._held[address] = (storage, holds - 1)
                return
            del self._held[address]
        unregister(address)

    def holds(self, address: int) -> int:
        with self._lock:
            return self._held.get(address, (None, 0))[1]


REGISTRATIONS = HostRegistrations()
"""The process's registrations (CUDA's page-locked ranges are per process)."""
