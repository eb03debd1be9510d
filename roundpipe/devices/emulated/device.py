"""N virtual devices inside one process, on the CPU: the emulated device, pool, options.

The device wires its parts together (an executor, four streams, two copy engines, its
memory) from plain values, so none of them refers back to it; what the emulator
models and where it is never kinder than a GPU is in ``docs/design.md``, "Emulated
backend". Threads start on first use, never at import.

Devices may differ: each has a speed (``EmulatedOptions.speeds``) dividing its
modelled kernel time, and devices of one speed form a device class whose dropout masks
differ from other classes' (``random.class_seed``), as masks differ between GPU models.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ...core.op_kinds import StreamName
from ..base import (
    MAPPED_FILE_ATTR,
    Device,
    DevicePool,
    OpInfo,
    SpanRecord,
    Stream,
    Timer,
    without_grad,
)
from ..host_blocks import DEFAULT_CACHE_BYTES, HostBlockPool
from .executor import DeviceExecutor, SpanSink
from .link import CopyEngine, HostBus, Tickets, sleep_until
from .memory import ComputeAllocations, DeviceMemory
from .random import class_seed, seeded
from .stream import RUNNING, EmulatedStream, HostEvent, StreamContext, WallClockTimer

_PINNED_ATTR = "roundpipe_pinned"
"""Set on the storage of a host tensor the emulator treats as page-locked."""

T = TypeVar("T")

DEFAULT_CLASS = "emulated"
"""The device class of emulated devices at speed 1.0 (they draw as after
``torch.manual_seed``)."""


@dataclass(frozen=True)
class EmulatedOptions:
    """Models for the emulated backend. All off by default."""

    capacity_bytes: int | tuple[int, ...] | None = None
    """Device memory per device (one number for all, or one per device, so pools of
    different sizes can be modelled); ``None`` is unlimited."""
    speeds: float | tuple[float, ...] = 1.0
    """Relative compute speed per device (one number for all, or one per device): a device
    at speed ``s`` takes ``kernel_time(info) / s``. Devices of one speed are one device
    class; a class other than speed 1.0 draws other dropout masks (docs/design.md,
    "Emulated backend")."""
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
    """Upper bound of a random delay (modelled time) inserted before every stream op."""
    seed: int = 0
    poison_memory: bool = True
    """Fill every block handed out with NaN (all bits set for integers)."""
    count_compute_memory: bool | None = None
    """Count what layers compute (activations, saved tensors, logits) as device memory
    from its creation until it dies, as on a GPU. ``None``: when a capacity is set (it
    costs a Python hook per operator)."""
    host_cache_bytes: int = DEFAULT_CACHE_BYTES
    """Idle bytes the pool of page-locked download blocks keeps for reuse."""


class EmulatedDevice(Device):
    streams: dict[StreamName, EmulatedStream]

    def __init__(self, pool: EmulatedDevicePool, index: int, options: EmulatedOptions) -> None:
        self.pool = pool
        self.index = index
        self.options = options
        self.speed: float = float(of_device(options.speeds, index))
        """Relative compute speed: modelled kernel times are divided by it."""
        self._device_class = (
            DEFAULT_CLASS if self.speed == 1.0 else f"{DEFAULT_CLASS}@{self.speed:g}x"
        )
        self.torch_device = torch.device("cpu")
        self.h2d = CopyEngine(options.h2d_gbps, pool.host_bus)
        self.d2h = CopyEngine(options.d2h_gbps, pool.host_bus)
        self.executor = DeviceExecutor(index, options.jitter_s, pool.span_sink)
        context = StreamContext(index, self.executor.lock, self.executor.put, pool.tickets.next)
        engines = {
            StreamName.WEIGHT_UPLOAD: self.h2d,
            StreamName.ACT_UPLOAD: self.h2d,
            StreamName.DOWNLOAD: self.d2h,
        }
        self.streams = {
            name: EmulatedStream(
                context, name.value, options.seed * 1009 + index * 17 + i, engines.get(name)
            )
            for i, name in enumerate(StreamName)
        }
        for stream in self.streams.values():
            stream.device = self  # the Stream interface's owner; streams never use it
        self.executor.streams = tuple(self.streams.values())
        self.memory = DeviceMemory(
            index, self.memory_capacity(), options.poison_memory, lambda: RUNNING.stream
        )

    def __repr__(self) -> str:
        return f"emulated:{self.index}"

    @property
    def device_class(self) -> str:
        """``"emulated"`` at speed 1.0, else e.g. ``"emulated@0.5x"``."""
        return self._device_class

    def empty_like(self, host: torch.Tensor) -> torch.Tensor:
        return self.memory.allocate(host, RUNNING.stream)

    def allocate(self, host: torch.Tensor, stream: Stream) -> torch.Tensor:
        return self.memory.allocate(host, stream)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        self._transfer(self.h2d, src.numel() * src.element_size())
        dst.copy_(src)

    def copy_in_all(
        self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: Stream
    ) -> None:
        # One torch call for all: each call lets other host threads take the interpreter,
        # and the executor is the device's critical path.
        self._transfer(self.h2d, sum(src.numel() * src.element_size() for src in srcs))
        torch._foreach_copy_(dsts, srcs)

    def to_host(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        # A block of the pool (marked page-locked). Its copy is done when the op ends
        # and the op holds it until then, so no use needs recording.
        out = self.pool.host_blocks.empty(tensor.shape, tensor.dtype)
        self._transfer(self.d2h, tensor.numel() * tensor.element_size())
        return out.copy_(without_grad(tensor))

    def _transfer(self, engine: CopyEngine, nbytes: int) -> None:
        """Book a copy on ``engine``: inside an op, from where the op has got to in
        modelled time (the op then lasts until the copy ends); outside any op, from now,
        sleeping until it ends (the copy is synchronous for the calling thread)."""
        if not engine.modelled:
            return
        op = RUNNING.op
        if op is None:
            sleep_until(engine.book(nbytes, self.pool.tickets.next(), time.perf_counter()))
            return
        # An op of a stream using this engine copies under its own ticket (the engine
        # was free for it when it started); any other books behind what the engine does.
        assert RUNNING.stream is not None
        ticket = op.ticket if RUNNING.stream.engine is engine else self.pool.tickets.next()
        end = engine.book(nbytes, ticket, op.cursor)
        RUNNING.charged += end - op.cursor
        op.cursor = end

    def keep_alive(self, tensor: torch.Tensor, stream: Stream) -> None:
        self.memory.keep_alive(tensor, stream)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return getattr(tensor.untyped_storage(), _PINNED_ATTR, False)

    def is_on_device(self, tensor: torch.Tensor) -> bool:
        return self.memory.is_resident(tensor)

    def compute_scope(self, info: OpInfo) -> contextlib.AbstractContextManager[object]:
        scope = contextlib.ExitStack()
        count = self.options.count_compute_memory
        if count or (count is None and self.memory.capacity is not None):
            scope.enter_context(ComputeAllocations(self.memory, RUNNING.stream))
        return scope

    def timer(self) -> Timer:
        return WallClockTimer()

    def model_kernel_time(self, info: OpInfo) -> None:
        """Charge the kernels' modelled time, divided by the device's speed, to the
        running op: it ends no earlier."""
        if self.options.kernel_time is not None:
            seconds = max(0.0, self.options.kernel_time(info)) / self.speed
            RUNNING.charged += seconds
            if RUNNING.op is not None:
                RUNNING.op.cursor += seconds

    def memory_capacity(self) -> int | None:
        return of_device(self.options.capacity_bytes, self.index)

    def random_scope(self, seed: int, module: Any) -> contextlib.AbstractContextManager[None]:
        # Masks depend on the kind of card, as on CUDA (the launch grid depends on the GPU
        # model); the default class draws exactly as after torch.manual_seed(seed).
        if self._device_class != DEFAULT_CLASS:
            seed = class_seed(seed, self._device_class)
        return seeded(seed, module)

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
    devices: list[EmulatedDevice]

    def __init__(self, num_devices: int, options: EmulatedOptions | None = None) -> None:
        if num_devices < 1:
            raise ValueError(f"an emulated pool needs at least one device, got {num_devices}")
        self.options = options or EmulatedOptions()
        capacity = self.options.capacity_bytes
        if isinstance(capacity, (tuple, list)) and len(capacity) != num_devices:
            raise ValueError(
                f"capacity_bytes lists {len(capacity)} capacities for {num_devices} devices"
            )
        check_speeds(self.options.speeds, num_devices)
        self.tickets = Tickets()
        self.host_bus = HostBus(self.options.host_gbps)
        self.host_blocks = HostBlockPool(
            self.options.host_cache_bytes,
            lambda size: torch.empty(size, dtype=torch.uint8),
            lambda memory: None,
            mark=_mark_page_locked,
        )
        self.span_sink = SpanSink()  # where the executors record spans (start_recording)
        self.devices = [EmulatedDevice(self, i, self.options) for i in range(num_devices)]

    def __repr__(self) -> str:
        return f"EmulatedDevicePool({len(self.devices)})"

    def pin(self, tensor: torch.Tensor, mode: str) -> torch.Tensor:
        # No page-locking on the CPU: the storage is marked, so copies from it are
        # asynchronous and copies from anything else block the issuing thread, as on CUDA.
        # (The mode was validated by the caller.)
        if mode != "off" and getattr(tensor.untyped_storage(), MAPPED_FILE_ATTR, None) is None:
            _mark_page_locked(tensor)
        return tensor

    def host_event(self) -> HostEvent:
        """An event the host completes with ``set()``: a stream that waits on it is held
        at that point without blocking its device's other streams."""
        return HostEvent()

    def clear_errors(self) -> None:
        for device in self.devices:
            for stream in device.streams.values():
                stream.error = None

    def start_recording(self) -> None:
        self.span_sink.start()

    def spans(self) -> list[SpanRecord]:
        return self.span_sink.spans()

    def close(self) -> None:
        """Run what was queued, then stop the executor threads."""
        for device in self.devices:
            device.memory.closed = True
            device.executor.stop()
        self.host_blocks.close()


def check_speeds(speeds: float | tuple[float, ...], num_devices: int) -> None:
    """Raise ValueError unless ``speeds`` is one speed, or one per device, each finite
    and above 0."""
    per_device = isinstance(speeds, (tuple, list))
    values = tuple(speeds) if isinstance(speeds, (tuple, list)) else (speeds,)
    if per_device and len(values) != num_devices:
        raise ValueError(
            f"speeds lists {len(values)} speeds for {num_devices} devices; give one speed "
            "for all devices or exactly one per device"
        )
    for speed in values:
        if isinstance(speed, bool) or not isinstance(speed, (int, float)):
            raise ValueError(f"a device speed must be a number, got {speed!r}")
        if not (math.isfinite(speed) and speed > 0):
            raise ValueError(
                f"a device speed must be finite and above 0 (1.0: full speed, 0.5: half "
                f"speed), got {speed!r}"
            )


def of_device(value: T | tuple[T, ...], index: int) -> T:
    """Device ``index``'s value of an option given once for all devices or one per
    device (``capacity_bytes``, ``speeds``)."""
    return value[index] if isinstance(value, (tuple, list)) else value


def _mark_page_locked(tensor: torch.Tensor) -> None:
    setattr(tensor.untyped_storage(), _PINNED_ATTR, True)
