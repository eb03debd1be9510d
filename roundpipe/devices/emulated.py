"""N virtual devices inside one process, on the CPU (DESIGN.md §5).

Each stream is an ordered queue run by its own thread; events are recorded on one
stream and waited on by others exactly as CUDA does. Where it matters the emulator
is never kinder than a GPU:

- device memory is taken when the host allocates it, as CUDA's caching allocator
  does, checked against a per-device capacity (``torch.OutOfMemoryError``), handed
  out poisoned, and reusable by other streams only after the work recorded on them
  has run (:mod:`.emulated_memory`);
- transfers go through one FIFO copy engine per direction per device and a host
  memory bus shared by all devices; there are no transfer priorities
  (:mod:`.emulated_link`).

Optional models: link and host bandwidth, kernel time per op, and *jitter* (a
random delay before every op) so that a missing event wait shows up as a wrong
result. Threads start on first use, never at import.
"""

from __future__ import annotations

import collections
import contextlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .base import (
    MAPPED_FILE_ATTR,
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
from .emulated_link import CopyEngine, HostBus, Tickets
from .emulated_memory import ComputeAllocations, DeviceMemory

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
    """Host→device bandwidth per device in GB/s (one FIFO copy engine); ``None`` is
    instant."""
    d2h_gbps: float | None = None
    host_gbps: float | None = None
    """Host-memory bandwidth shared by the copies of all devices; ``None`` is unlimited."""
    kernel_time: Callable[[OpInfo], float] | None = None
    """Modelled seconds of a layer's kernels: called with ``OpInfo(kind, layers=...)``
    for each layer's forward (kind "forward" or "recompute") and each stage's
    backward (kind "backward", all the stage's layers). A compute op then lasts the
    sum of its layers' modelled times, or its real host time if that is longer."""
    jitter_s: float = 0.0
    """Upper bound of a random delay inserted before every stream op."""
    seed: int = 0
    poison_memory: bool = True
    """Fill every block handed out with NaN (all bits set for integers)."""
    count_compute_memory: bool | None = None
    """Count what layers compute (activations, saved tensors, logits) as device memory
    from its creation until it dies, as on a GPU. ``None``: when a capacity is set (it
    costs a Python hook per operator)."""


class _RunningOp(threading.local):
    """Per stream thread: the stream it runs and the ticket of the op running now."""

    stream: _EmulatedStream | None = None
    ticket: int = -1


_RUNNING = _RunningOp()


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
        self.engine: CopyEngine | None = None  # the copy engine its ops use, if any
        self._items: collections.deque = collections.deque()
        # reentrant: a tensor freed while the lock is held may record an event here
        self._cond = threading.Condition(threading.RLock())
        self._thread: threading.Thread | None = None
        self._busy = False  # the thread is handling an item
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

    def _put(self, item) -> None:
        self._ensure_thread()
        with self._cond:
            if self.engine is not None and item is not _STOP and item[0] == "run" and self._idle():
                # nothing stands before it: its copies are ready now, as on a GPU
                self.engine.op_started(item[2][1])
            self._items.append(item)
            self._cond.notify()

    def _idle(self) -> bool:
        """Under the lock: no item queued and none being run."""
        return not self._items and not self._busy

    def _take(self):
        with self._cond:
            while not self._items:
                self._cond.wait()
            self._busy = True
            return self._items.popleft()

    def _next_ready_ticket(self) -> int | None:
        """The ticket of the next op if nothing unfinished stands before it."""
        with self._cond:
            for item in self._items:
                if item is _STOP:
                    return None
                op, payload, issued = item
                if op == "run":
                    return issued[1]
                if op == "wait" and not payload.query():
                    return None
        return None

    def submit(self, fn: Callable[[], None], info: OpInfo) -> None:
        self._put(("run", fn, (info, self.device.pool.tickets.next())))
        if info.pageable:  # as CUDA does: the host waits until the copy has been staged
            self.record().wait(None)

    def record(self) -> Event:
        event = _EmulatedEvent()
        self._put(("record", event, None))
        return event

    def wait(self, event: Event) -> None:
        if not isinstance(event, _EmulatedEvent):
            raise TypeError(f"an emulated stream cannot wait on {type(event).__name__}")
        self._put(("wait", event, None))

    def stop(self) -> None:
        if self._thread is not None:
            self._put(_STOP)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        _RUNNING.stream = self
        while True:
            item = self._take()
            if item is _STOP:
                return
            op, payload, issued = item
            if op == "record":
                payload._complete(self.error)
            elif op == "wait":
                payload.wait_done()
                if payload.error is not None and self.error is None:
                    self.error = payload.error
            else:
                if self.engine is not None:
                    self.engine.op_started(issued[1])
                if self.error is None:
                    self._run_op(payload, issued[0], issued[1])
                if self.engine is not None:
                    self.engine.op_finished(issued[1], self._next_ready_ticket())
            # What the op referenced (its device tensors) dies now, not when the next
            # op arrives: an op that ran holds nothing on a GPU either.
            item = payload = None
            with self._cond:
                self._busy = False

    def _run_op(self, fn: Callable[[], None], info: OpInfo, ticket: int) -> None:
        _RUNNING.ticket = ticket
        options = self.device.options
        if options.jitter_s:
            time.sleep(self._rng.uniform(0.0, options.jitter_s))
        start = time.perf_counter()
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - sticky, reported through events
            self.error = exc
        finally:
            _RUNNING.ticket = -1
        # The op lasts as long as its modelled kernels, slept here after it released any
        # lock it held. The host work of running it counts towards that time, as a GPU
        # kernel runs while the host launches the next: only what is left is slept.
        modelled = self.device.modelled
        owed, modelled.pending = modelled.pending, 0.0
        left = owed - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
        self.device.pool.record_span(self.device.index, self.name, info, start)


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
        self.h2d = CopyEngine(options.h2d_gbps, pool.host_bus)
        self.d2h = CopyEngine(options.d2h_gbps, pool.host_bus)
        for name, engine in (("weight_upload", self.h2d), ("act_upload", self.h2d)):
            self.streams[name].engine = engine
        self.streams["download"].engine = self.d2h
        self.memory = DeviceMemory(
            index, self.memory_capacity(), options.poison_memory, lambda: _RUNNING.stream
        )

    def __repr__(self) -> str:
        return f"emulated:{self.index}"

    def empty_like(self, host: torch.Tensor) -> torch.Tensor:
        return self.memory.allocate(host, _RUNNING.stream)

    def allocate(self, host: torch.Tensor, stream: Stream) -> torch.Tensor:
        return self.memory.allocate(host, stream)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        self._transfer(self.h2d, src.numel() * src.element_size())
        dst.copy_(src)

    def to_host(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        self._transfer(self.d2h, tensor.numel() * tensor.element_size())
        return tensor.detach().clone(memory_format=torch.contiguous_format)

    def _transfer(self, engine: CopyEngine, nbytes: int) -> None:
        running = _RUNNING.stream
        if running is not None and running.engine is engine:
            engine.transfer(nbytes, _RUNNING.ticket, held=True)
        else:  # a copy from a compute op or from outside any op: ready from now on
            engine.transfer(nbytes, self.pool.tickets.next(), held=False)

    def keep_alive(self, tensor: torch.Tensor, stream: Stream) -> None:
        self.memory.keep_alive(tensor, stream)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return getattr(tensor.untyped_storage(), "roundpipe_pinned", False)

    def is_on_device(self, tensor: torch.Tensor) -> bool:
        return self.memory.is_resident(tensor)

    def compute_scope(self, info: OpInfo) -> contextlib.AbstractContextManager[None]:
        scope = contextlib.ExitStack()
        if info.kind in RANDOM_KINDS:
            scope.enter_context(_CPU_RNG_LOCK)
        count = self.options.count_compute_memory
        if count or (count is None and self.memory.capacity is not None):
            scope.enter_context(ComputeAllocations(self.memory, _RUNNING.stream))
        return scope

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
        return self.memory.in_use()

    def max_memory_allocated(self) -> int:
        return self.memory.peak()

    def reset_peak_memory(self) -> None:
        self.memory.reset_peak()


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
        self.tickets = Tickets()
        self.host_bus = HostBus(self.options.host_gbps)
        self.devices = [EmulatedDevice(self, i, self.options) for i in range(num_devices)]
        self._recording = False
        self._spans: list[SpanRecord] = []
        self._spans_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EmulatedDevicePool({len(self.devices)})"

    def pin(self, tensor: torch.Tensor, mode: str) -> torch.Tensor:
        # No page-locking on the CPU: the storage is marked, so copies from it are
        # asynchronous and copies from anything else block the issuing thread, as on CUDA.
        # (The mode was validated by the caller.)
        if mode != "off" and getattr(tensor.untyped_storage(), MAPPED_FILE_ATTR, None) is None:
            tensor.untyped_storage().roundpipe_pinned = True
        return tensor

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

    def record_span(self, device: int, stream: str, info: OpInfo, start: float) -> None:
        if self._recording:
            span = SpanRecord(device, stream, info, start, time.perf_counter())
            with self._spans_lock:
                self._spans.append(span)

    def close(self) -> None:
        for device in self.devices:
            device.memory.closed = True
            for stream in device.streams.values():
                stream.stop()
