"""The device abstraction the runtime is written against.

Everything the runtime does on a device is a *stream op*, a closure run in its
stream's order; results travel in :class:`Slot` objects filled inside ops and ordered
by events, and errors are sticky per stream, as on CUDA. One interface, so the runtime
is written once for CUDA and the emulator (docs/design.md#devices).
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.op_kinds import StreamName
from .host_blocks import HostBlockPool

RANDOM_KINDS = frozenset({"forward", "recompute", "fused"})
"""Compute ops that run layers, so may draw random numbers (dropout)."""

MAPPED_FILE_ATTR = "roundpipe_mapped_file"
"""Set on the storage of a host tensor that is a view of a file mapping (its value is
the path): such memory is never page-locked (it would lock the whole file in RAM)."""


def without_grad(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached if it requires grad (only then: every torch call lets another
    host thread take the interpreter)."""
    return tensor.detach() if tensor.requires_grad else tensor


@dataclass(frozen=True)
class OpInfo:
    """What a stream op is, for timing models, timelines and error messages."""

    kind: str  # forward | recompute | backward | fused | upload | download | ...
    label: str = ""
    nbytes: int = 0
    layers: tuple[int, ...] = ()
    job: int = -1  # index of the schedule job the op belongs to (-1: none)
    op: int = -1  # index of the op in its job's program (roundpipe.core.program; -1: none)
    pageable: bool = False
    """A host-to-device copy reading pageable (not page-locked) host memory: CUDA stages
    it through a pinned buffer of the driver's, so issuing it blocks the host thread
    until the stream reaches the copy and the data is staged."""


@dataclass(frozen=True)
class SpanRecord:
    """One executed op, as seen by the device (wall-clock seconds)."""

    device: int
    stream: str
    info: OpInfo
    start: float
    end: float
    ran: float = 0.0
    """Emulator: seconds its closure ran on the device's executor thread (0 on CUDA)."""
    cpu: float = 0.0
    """Emulator: CPU seconds that thread used meanwhile (less than ``ran`` when it waited
    for the interpreter lock or a core)."""


class Slot:
    """A value handed from one stream op to another, ordered by an event."""

    __slots__ = ("value",)

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def take(self) -> Any:
        """The value, emptied from the slot so device memory is freed as soon as possible."""
        value, self.value = self.value, None
        return value


class Timer(abc.ABC):
    """Measures device time between ``start()`` and ``stop()``, issued inside stream ops."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    @abc.abstractmethod
    def seconds(self) -> float:
        """The measured time; call only after the ops it timed have completed."""


class Event(abc.ABC):
    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until the work before this event finished; raise its error."""

    @abc.abstractmethod
    def query(self) -> bool:
        """Whether the work before this event finished."""

    def wait_launched(self) -> None:
        """Block the host until every op before this event was *launched* (its closure
        ran, so the host objects it makes exist, e.g. the host tensor a download fills,
        though the device may still be copying into it); raise the error of a failed op.
        On CUDA closures run when submitted, so this returns at once; the emulator runs
        them on the device's executor thread, so it waits for the event."""
        self.synchronize()

    def wait(self, timeout: float | None) -> bool:
        """Block until the work before this event finished or ``timeout`` seconds passed;
        whether it finished (its error is raised by :meth:`synchronize`)."""
        if timeout is None:
            with contextlib.suppress(Exception):
                self.synchronize()
            return True
        deadline = time.monotonic() + timeout
        while not self.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)
        return True


class Stream(abc.ABC):
    device: Device
    name: str
    error: BaseException | None
    """The sticky error: the first op that failed; later ops are skipped until cleared."""

    @abc.abstractmethod
    def submit(self, fn: Callable[[], None], info: OpInfo) -> None:
        """Run ``fn`` in stream order. ``fn`` may launch work (CUDA) or do it (emulated)."""

    @abc.abstractmethod
    def record(self) -> Event:
        """An event that completes when everything submitted so far has run."""

    @abc.abstractmethod
    def wait(self, event: Event) -> None:
        """Make later ops of this stream wait for ``event`` (no host blocking)."""


class Device(abc.ABC):
    """One accelerator (or one emulated one) with its four streams."""

    index: int
    torch_device: torch.device
    streams: Mapping[StreamName, Stream]

    @property
    def compute(self) -> Stream:
        return self.streams[StreamName.COMPUTE]

    @property
    @abc.abstractmethod
    def device_class(self) -> str:
        """The kind of card: devices of one class are the same kind of card, with the
        same speed per layer and the same random-number (dropout) masks for a seed;
        plans and profiles are per class (a CUDA GPU's model name, e.g. "NVIDIA GeForce
        RTX 4090"; ``"emulated"``, or ``"emulated@0.5x"`` at another speed)."""

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether copies from host ``tensor`` are asynchronous (page-locked memory)."""
        return tensor.is_pinned()

    @property
    def weight_upload(self) -> Stream:
        return self.streams[StreamName.WEIGHT_UPLOAD]

    @property
    def act_upload(self) -> Stream:
        return self.streams[StreamName.ACT_UPLOAD]

    @property
    def download(self) -> Stream:
        return self.streams[StreamName.DOWNLOAD]

    @abc.abstractmethod
    def empty_like(self, host: torch.Tensor) -> torch.Tensor:
        """Inside an op: uninitialised (contiguous) device memory shaped like ``host``."""

    @abc.abstractmethod
    def allocate(self, host: torch.Tensor, stream: Stream) -> torch.Tensor:
        """On the issuing thread, outside any op: uninitialised device memory shaped like
        ``host`` for work about to be issued on ``stream``. It is taken now, as CUDA's
        caching allocator takes it when the host asks, whatever the device is running;
        so the host must not allocate for work further ahead than memory allows. Only
        ``host``'s ``shape``, ``dtype``, ``numel()`` and ``element_size()`` are read (a
        stand-in such as ``runtime.transfer.TensorMeta`` will do)."""

    @abc.abstractmethod
    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        """Inside an op of ``stream``: asynchronously copy host ``src`` into device ``dst``."""

    def copy_in_all(
        self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream: Stream
    ) -> None:
        """Inside an op of ``stream``: :meth:`copy_in` of each pair, as one transfer."""
        for dst, src in zip(dsts, srcs, strict=True):
            self.copy_in(dst, src, stream)

    def to_device(self, host: torch.Tensor, stream: Stream) -> torch.Tensor:
        """Inside an op of ``stream``: an asynchronous host→device copy of ``host``."""
        tensor = self.empty_like(host)
        self.copy_in(tensor, host, stream)
        return tensor

    @abc.abstractmethod
    def to_host(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        """Inside an op of ``stream``: an asynchronous device→host copy (pinned if possible),
        a plain host tensor (no autograd history, whatever ``tensor`` requires)."""

    @abc.abstractmethod
    def keep_alive(self, tensor: torch.Tensor, stream: Stream) -> None:
        """Tell the allocator ``tensor`` is used by ``stream`` (``record_stream`` on CUDA)."""

    @abc.abstractmethod
    def compute_scope(self, info: OpInfo) -> contextlib.AbstractContextManager[object]:
        """Context for running layer code of this device inside a compute op."""

    @abc.abstractmethod
    def timer(self) -> Timer:
        """A timer for work issued on the current stream."""

    def model_kernel_time(self, info: OpInfo) -> None:  # noqa: B027 - optional hook
        """Called after the kernels of ``info`` were issued; the emulated backend charges
        their modelled run time to the running op (it ends no earlier). Real devices do
        nothing."""

    def memory_capacity(self) -> int | None:
        """Usable device memory in bytes, or None if unlimited."""
        return None

    @abc.abstractmethod
    def random_scope(self, seed: int, module: Any) -> contextlib.AbstractContextManager[None]:
        """Inside a compute op, around one layer (``module``, its shell) run: the layer's
        random numbers (dropout) are drawn from a generator seeded with ``seed``, as
        after ``torch.manual_seed(seed)``, whatever other threads draw meanwhile; the
        device's generator is left as it was (docs/design.md#random-numbers)."""

    @abc.abstractmethod
    def get_rng_state(self) -> torch.Tensor:
        """The device generator's state (what a checkpoint saves; layers run by
        RoundPipe draw from :meth:`random_scope` instead)."""

    @abc.abstractmethod
    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore a generator state captured by :meth:`get_rng_state`."""

    @abc.abstractmethod
    def memory_allocated(self) -> int:
        """Bytes of device memory currently held by tensors."""

    @abc.abstractmethod
    def max_memory_allocated(self) -> int:
        """Peak of :meth:`memory_allocated` since the last reset."""

    @abc.abstractmethod
    def reset_peak_memory(self) -> None: ...

    def reserved_memory(self) -> tuple[int, int, int]:
        """What the device's allocator holds beyond the tensors: bytes reserved now, the
        peak since the last reset, and how often an allocation had to free cached
        blocks and retry (``torch.cuda``'s ``memory_reserved``, ``max_memory_reserved``
        and ``num_alloc_retries``). A device without a caching allocator reserves
        exactly what its tensors hold."""
        return self.memory_allocated(), self.max_memory_allocated(), 0

    def is_on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.torch_device


class DevicePool(abc.ABC):
    """The devices jobs are dispatched to, round-robin."""

    devices: Sequence[Device]
    kind: str  # "cuda" | "emulated"
    host_blocks: HostBlockPool
    """The page-locked host blocks downloads land in (bounded, reused)."""

    def __len__(self) -> int:
        return len(self.devices)

    def __iter__(self) -> Iterator[Device]:
        return iter(self.devices)

    def device_classes(self) -> list[str]:
        """Each device's :attr:`Device.device_class`, in pool order."""
        return [device.device_class for device in self.devices]

    @property
    def mixed(self) -> bool:
        """Whether the pool holds devices of more than one class."""
        return len(set(self.device_classes())) > 1

    @abc.abstractmethod
    def pin(self, tensor: torch.Tensor, mode: str) -> torch.Tensor:
        """Page-lock a host tensor per ``mode`` ("alloc" | "register" | "off")."""

    def unpin(self, address: int) -> None:  # noqa: B027 - optional hook
        """Give back what :meth:`pin` took for the storage at ``address`` (a CUDA host
        registration), once the runtime no longer uses it; nothing to give by default."""

    @abc.abstractmethod
    def clear_errors(self) -> None:
        """After a failure has been reported: let the streams run again."""

    def spans(self) -> list[SpanRecord]:
        """Executed ops recorded since :meth:`start_recording` (empty if not recording)."""
        return []

    def start_recording(self) -> None:  # noqa: B027 - optional hook
        """Begin recording a timeline of executed ops."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop any threads the pool owns."""


class DeviceOpError(RuntimeError):
    """A stream op failed; carries the op that failed in its message, the cause chained."""
