"""N virtual devices inside one process, on the CPU (DESIGN.md §9).

Each stream is an ordered queue run by its own thread; events are recorded on one
stream and waited on by others exactly as CUDA does; device tensors are separate
storage accounted against a per-device capacity, so an over-budget stage raises
``torch.OutOfMemoryError``. Optional models: host↔device bandwidth (one link per
direction per device, shared by that direction's streams, activation uploads served
before weight uploads), kernel time per op, and *jitter* (a random delay before
every op) so that a missing event wait shows up as a wrong result.

Threads start on first use, never at import.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import format_bytes
from .base import (
    RANDOM_KINDS,
    STREAM_NAMES,
    Device,
    DevicePool,
    Event,
    OpInfo,
    SpanRecord,
    Stream,
    Timer,
)

# The CPU generator is one per process, so is the lock that makes "capture RNG
# state, then draw from it" atomic across emulated devices (and across pools).
_CPU_RNG_LOCK = threading.RLock()


@dataclass(frozen=True)
class EmulatedOptions:
    """Models for the emulated backend. All off by default."""

    capacity_bytes: int | tuple[int, ...] | None = None
    """Device memory per device (one number for all, or one per device, so pools of
    different sizes can be modelled); ``None`` is unlimited."""
    h2d_gbps: float | None = None
    """Host→device bandwidth per device in GB/s; ``None`` transfers instantly."""
    d2h_gbps: float | None = None
    kernel_time: Callable[[OpInfo], float] | None = None
    """Modelled seconds of a layer's kernels: called with ``OpInfo(kind, layers=...)``
    for each layer's forward (kind "forward" or "recompute") and each stage's
    backward (kind "backward", all the stage's layers)."""
    jitter_s: float = 0.0
    """Upper bound of a random delay inserted before every stream op."""
    seed: int = 0
    prioritize_activations: bool = True
    """Activation uploads take the host→device link before queued weight uploads."""


class _Link:
    """One direction of a PCIe link: one transfer at a time, critical ones first."""

    def __init__(self, gbps: float | None, prioritize: bool) -> None:
        self._seconds_per_byte = 1.0 / (gbps * 1e9) if gbps else 0.0
        self._prioritize = prioritize
        self._cond = threading.Condition()
        self._busy = False
        self._critical_waiting = 0

    def transfer(self, nbytes: int, critical: bool) -> None:
        if not self._seconds_per_byte:
            return
        critical = critical and self._prioritize
        with self._cond:
            self._critical_waiting += critical
            while self._busy or (not critical and self._critical_waiting):
                self._cond.wait()
            self._critical_waiting -= critical
            self._busy = True
        try:
            time.sleep(nbytes * self._seconds_per_byte)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()


class _ModelledTime(threading.local):
    """Per stream thread: modelled kernel seconds owed (slept after the op) and in total."""

    pending = 0.0
    total = 0.0


class _WallClockTimer(Timer):
    """Wall time of the real work plus the modelled kernel time charged in between."""

    def __init__(self, modelled: _ModelledTime) -> None:
        self._modelled = modelled
        self._start = self._stop = 0.0

    def start(self) -> None:
        self._start = time.perf_counter() + self._modelled.total

    def stop(self) -> None:
        self._stop = time.perf_counter() + self._modelled.total

    def seconds(self) -> float:
        return self._stop - self._start


class _EmulatedEvent(Event):
    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def _complete(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()

    def wait_done(self) -> None:
        self._done.wait()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None) -> bool:
        return self._done.wait(timeout)


_STOP = object()


class _EmulatedStream(Stream):
    def __init__(self, device: EmulatedDevice, name: str, seed: int) -> None:
        self.device = device
        self.name = name
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._rng = random.Random(seed)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run,
                        name=f"roundpipe-emu{self.device.index}-{self.name}",
                        daemon=True,
                    )
                    self._thread.start()

    def submit(self, fn: Callable[[], None], info: OpInfo) -> None:
        self._ensure_thread()
        self._queue.put(("run", fn, info))

    def record(self) -> Event:
        event = _EmulatedEvent()
        self._ensure_thread()
        self._queue.put(("record", event, None))
        return event

    def wait(self, event: Event) -> None:
        if not isinstance(event, _EmulatedEvent):
            raise TypeError(f"an emulated stream cannot wait on {type(event).__name__}")
        self._ensure_thread()
        self._queue.put(("wait", event, None))

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            op, payload, info = item
            if op == "record":
                payload._complete(self.error)
            elif op == "wait":
                payload.wait_done()
                if payload.error is not None and self.error is None:
                    self.error = payload.error
            elif self.error is None:
                self._run_op(payload, info)

    def _run_op(self, fn: Callable[[], None], info: OpInfo) -> None:
        options = self.device.options
        if options.jitter_s:
            time.sleep(self._rng.uniform(0.0, options.jitter_s))
        start = time.perf_counter()
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - sticky, reported through events
            self.error = exc
        # Modelled kernel time is slept here, after the op released any lock it held.
        modelled = self.device.modelled
        owed, modelled.pending = modelled.pending, 0.0
        if owed > 0:
            time.sleep(owed)
        self.device.pool._record_span(self.device.index, self.name, info, start)


class EmulatedDevice(Device):
    def __init__(self, pool: EmulatedDevicePool, index: int, options: EmulatedOptions) -> None:
        self.pool = pool
        self.index = index
        self.options = options
        self.torch_device = torch.device("cpu")
        self.streams = {
            name: _EmulatedStream(self, name, options.seed * 1009 + index * 17 + i)
            for i, name in enumerate(STREAM_NAMES)
        }
        self.modelled = _ModelledTime()
        self._h2d = _Link(options.h2d_gbps, options.prioritize_activations)
        self._d2h = _Link(options.d2h_gbps, False)
        self._mem_lock = threading.Lock()
        self._allocated = 0
        self._peak = 0
        self._resident: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary()
        )

    def __repr__(self) -> str:
        return f"emulated:{self.index}"

    def empty_like(self, host: torch.Tensor) -> torch.Tensor:
        nbytes = host.numel() * host.element_size()
        capacity = self.memory_capacity()
        with self._mem_lock:
            if capacity is not None and self._allocated + nbytes > capacity:
                raise torch.OutOfMemoryError(
                    f"emulated device {self.index} is out of memory: allocating "
                    f"{format_bytes(nbytes)} with {format_bytes(self._allocated)} in use "
                    f"exceeds its capacity of {format_bytes(capacity)}"
                )
            self._allocated += nbytes
            self._peak = max(self._peak, self._allocated)
        tensor = torch.empty_like(host, memory_format=torch.contiguous_format)
        self._resident[id(tensor)] = tensor
        weakref.finalize(tensor, self._release, nbytes)
        return tensor

    def _release(self, nbytes: int) -> None:
        with self._mem_lock:
            self._allocated -= nbytes

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        self._h2d.transfer(src.numel() * src.element_size(), critical=stream.name == "act_upload")
        dst.copy_(src)

    def to_host(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        self._d2h.transfer(tensor.numel() * tensor.element_size(), critical=False)
        return tensor.detach().clone(memory_format=torch.contiguous_format)

    def keep_alive(self, tensor: torch.Tensor, stream: Stream) -> None:
        """Nothing to do: emulated memory is freed when the last reference dies."""

    def is_on_device(self, tensor: torch.Tensor) -> bool:
        resident = self._resident.get(id(tensor))
        return resident is tensor

    def compute_scope(self, info: OpInfo) -> contextlib.AbstractContextManager[None]:
        if info.kind in RANDOM_KINDS:
            return _CPU_RNG_LOCK
        return contextlib.nullcontext()

    def timer(self) -> Timer:
        return _WallClockTimer(self.modelled)

    def model_kernel_time(self, info: OpInfo) -> None:
        if self.options.kernel_time is not None:
            seconds = max(0.0, self.options.kernel_time(info))
            self.modelled.pending += seconds
            self.modelled.total += seconds

    def memory_capacity(self) -> int | None:
        capacity = self.options.capacity_bytes
        if isinstance(capacity, (tuple, list)):
            return capacity[self.index]
        return capacity

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def memory_allocated(self) -> int:
        return self._allocated

    def max_memory_allocated(self) -> int:
        return self._peak

    def reset_peak_memory(self) -> None:
        with self._mem_lock:
            self._peak = self._allocated


class EmulatedDevicePool(DevicePool):
    kind = "emulated"

    def __init__(self, num_devices: int, options: EmulatedOptions | None = None) -> None:
        if num_devices < 1:
            raise ValueError(f"an emulated pool needs at least one device, got {num_devices}")
        self.options = options or EmulatedOptions()
        capacity = self.options.capacity_bytes
        if isinstance(capacity, (tuple, list)) and len(capacity) != num_devices:
            raise ValueError(
                f"capacity_bytes lists {len(capacity)} capacities for {num_devices} devices"
            )
        self.devices = [EmulatedDevice(self, i, self.options) for i in range(num_devices)]
        self._recording = False
        self._spans: list[SpanRecord] = []
        self._spans_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EmulatedDevicePool({len(self.devices)})"

    def pin(self, tensor: torch.Tensor, mode: str) -> torch.Tensor:
        return tensor  # no page-locking on the CPU; the mode was validated by the caller

    def clear_errors(self) -> None:
        for device in self.devices:
            for stream in device.streams.values():
                stream.error = None

    def start_recording(self) -> None:
        with self._spans_lock:
            self._spans = []
            self._recording = True

    def spans(self) -> list[SpanRecord]:
        with self._spans_lock:
            return list(self._spans)

    def _record_span(self, device: int, stream: str, info: OpInfo, start: float) -> None:
        if self._recording:
            span = SpanRecord(device, stream, info, start, time.perf_counter())
            with self._spans_lock:
                self._spans.append(span)

    def close(self) -> None:
        for device in self.devices:
            for stream in device.streams.values():
                stream.stop()
