"""The real backend: CUDA (and ROCm, which PyTorch exposes through ``torch.cuda``).

The one module that makes vendor-specific calls. It follows the documented CUDA
semantics the runtime relies on: stream ops run at once on the calling thread inside
``torch.cuda.stream(s)``, events order streams without blocking the host, copies are
non-blocking from and to page-locked memory, and ``record_stream`` keeps memory used on
another stream alive (docs/design.md#cuda-backend).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..core.op_kinds import StreamName
from .base import (
    MAPPED_FILE_ATTR,
    RANDOM_KINDS,
    Device,
    DevicePool,
    Event,
    OpInfo,
    SpanRecord,
    Stream,
    Timer,
    without_grad,
)
from .cuda_errors import HOST_REGISTER_READ_ONLY, clear_last_error, context_lost
from .cuda_timeline import CudaTimeline
from .host_blocks import DEFAULT_CACHE_BYTES, PAGE, HostBlockPool
from .host_registrations import REGISTRATIONS

DELAY_VARIABLE = "ROUNDPIPE_CUDA_DELAY_CYCLES"
"""Set, every stream op first spins that many GPU cycles on its stream: the GPU analogue
of the emulator's jitter, which widens every race window (``bench/gpu_check.sh``)."""

# No stream priorities: copy engines serve copies of one direction in issue order
# whatever their stream's priority, so the runtime orders transfers itself (it issues
# weight chunks behind the activation uploads pending at that moment).


class _CudaEvent(Event):
    def __init__(self, event: torch.cuda.Event, error: BaseException | None) -> None:
        self.event = event
        self.error = error

    def synchronize(self) -> None:
        self.event.synchronize()
        if self.error is not None:
            raise self.error

    def query(self) -> bool:
        return self.event.query()

    def wait_launched(self) -> None:
        if self.error is not None:  # the ops before it were launched when submitted
            raise self.error


class _CudaTimer(Timer):
    """A pair of timing events on the current stream."""

    def __init__(self) -> None:
        # blocking: ``seconds`` waits on the stop event, which must not spin a core
        self._start = torch.cuda.Event(enable_timing=True, blocking=True)
        self._stop = torch.cuda.Event(enable_timing=True, blocking=True)

    def start(self) -> None:
        self._start.record()

    def stop(self) -> None:
        self._stop.record()

    def seconds(self) -> float:
        self._stop.synchronize()
        return self._start.elapsed_time(self._stop) / 1e3


class _CudaStream(Stream):
    device: CudaDevice

    def __init__(self, device: CudaDevice, name: str) -> None:
        self.device = device
        self.name = name
        self.error: BaseException | None = None
        self.stream = torch.cuda.Stream(device=device.index)

    def submit(self, fn: Callable[[], None], info: OpInfo) -> None:
        if self.error is not None:
            return
        pool = self.device.pool
        with torch.cuda.device(self.device.index), torch.cuda.stream(self.stream):
            if pool.delay_cycles:  # widens every race window (a missing wait then shows)
                torch.cuda._sleep(pool.delay_cycles)
            start = pool.timeline.op_start(self.stream)
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - sticky, reported through events
                self.error = pool.note_error(exc)
                return
            pool.timeline.op_end(self.device.position, self.name, info, start, self.stream)

    def record(self) -> Event:
        # blocking: a host waiting on it sleeps instead of spinning against the CPU optimizer
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)
        return _CudaEvent(event, self.error)

    def wait(self, event: Event) -> None:
        if not isinstance(event, _CudaEvent):
            raise TypeError(f"a CUDA stream cannot wait on {type(event).__name__}")
        self.stream.wait_event(event.event)
        if event.error is not None and self.error is None:
            self.error = event.error


class CudaDevice(Device):
    def __init__(self, pool: CudaDevicePool, index: int, position: int) -> None:
        self.pool = pool
        self.index = index
        """The GPU's number; workers sharing a GPU (``cuda:0,0``) have the same."""
        self.position = position
        """The worker's place in the pool (its timeline row)."""
        self.torch_device = torch.device("cuda", index)
        self.streams = {name: _CudaStream(self, name.value) for name in StreamName}

    def __repr__(self) -> str:
        return f"cuda:{self.index}"

    @functools.cached_property
    def device_class(self) -> str:
        """The GPU's model name (``torch.cuda.get_device_properties``)."""
        return torch.cuda.get_device_properties(self.index).name

    def empty_like(self, host: torch.Tensor) -> torch.Tensor:
        return torch.empty(host.shape, dtype=host.dtype, device=self.torch_device)

    def allocate(self, host: torch.Tensor, stream: Stream) -> torch.Tensor:
        assert isinstance(stream, _CudaStream)
        # the caching allocator files the block under the current stream
        with torch.cuda.device(self.index), torch.cuda.stream(stream.stream):
            return torch.empty(host.shape, dtype=host.dtype, device=self.torch_device)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        dst.copy_(src, non_blocking=True)
        self.pool.host_blocks.record_use(src, stream)

    def to_host(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        out = self.pool.host_blocks.empty(tensor.shape, tensor.dtype)
        out.copy_(without_grad(tensor), non_blocking=True)
        self.pool.host_blocks.record_use(out, stream)
        return out

    def keep_alive(self, tensor: torch.Tensor, stream: Stream) -> None:
        assert isinstance(stream, _CudaStream)
        tensor.record_stream(stream.stream)

    def compute_scope(self, info: OpInfo) -> contextlib.AbstractContextManager[object]:
        # Random kernels draw their offsets from the GPU's generator when launched.
        # Workers sharing one GPU (e.g. "cuda:0,0") must not interleave "seed the
        # generator, then launch" (random_scope), so those launches hold the GPU's lock.
        if info.kind in RANDOM_KINDS:
            return self.pool.rng_lock(self.index)
        return contextlib.nullcontext()

    def timer(self) -> Timer:
        return _CudaTimer()

    def memory_capacity(self) -> int | None:
        """What plans may use: the GPU's memory less the pool's headroom, shared equally
        by the workers on this GPU (``cuda:0,0``: half each)."""
        total = torch.cuda.get_device_properties(self.index).total_memory
        usable = max(0, int(total * (1 - self.pool.headroom_fraction)) - self.pool.headroom_bytes)
        return usable // self.pool.workers_on(self.index)

    @contextlib.contextmanager
    def random_scope(self, seed: int, module: Any) -> Iterator[None]:
        # Kernels take the generator's seed and offset as arguments when launched, so
        # the state can be put back as soon as the layer's kernels are launched.
        generator = torch.cuda.default_generators[self.index]
        state = generator.get_state()
        generator.manual_seed(seed)
        try:
            yield
        finally:
            generator.set_state(state)

    def get_rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.index)

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state, self.index)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.index)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.index)

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.index)

    def reserved_memory(self) -> tuple[int, int, int]:
        retries = torch.cuda.memory_stats(self.index).get("num_alloc_retries", 0)
        index = self.index
        return torch.cuda.memory_reserved(index), torch.cuda.max_memory_reserved(index), retries


class CudaDevicePool(DevicePool):
    kind = "cuda"

    def __init__(
        self,
        indices: list[int],
        headroom_bytes: int = 1 << 30,
        headroom_fraction: float = 0.08,
        host_cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        """GPUs ``indices``. Plans leave ``headroom_bytes`` plus ``headroom_fraction`` of
        each GPU's memory unused, for the CUDA context, cuBLAS workspaces and the caching
        allocator's fragmentation. Downloads land in page-locked blocks of which at most
        ``host_cache_bytes`` are kept idle for reuse."""
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA devices were requested but torch.cuda is not available")
        count = torch.cuda.device_count()
        bad = [i for i in indices if not 0 <= i < count]
        if bad:
            raise ValueError(f"CUDA device(s) {bad} do not exist; this machine has {count}")
        if headroom_bytes < 0 or not 0 <= headroom_fraction < 1:
            raise ValueError(
                f"headroom_bytes must be >= 0 and headroom_fraction in [0, 1), got "
                f"{headroom_bytes} and {headroom_fraction}"
            )
        self.headroom_bytes = headroom_bytes
        self.headroom_fraction = headroom_fraction
        self._rng_locks = {i: threading.RLock() for i in indices}
        self._registered: list[int] = []  # addresses this pool holds (REGISTRATIONS)
        self._host_registered: set[int] = set()  # addresses of registered host blocks
        self.host_blocks = HostBlockPool(host_cache_bytes, self._lock_block, self._unlock_block)
        self.devices: list[CudaDevice] = [
            CudaDevice(self, i, position) for position, i in enumerate(indices)
        ]
        self.delay_cycles = int(os.environ.get(DELAY_VARIABLE, "0") or 0)
        """GPU clock cycles every stream op is delayed by (a test knob, 0 in use)."""
        self.pin_fallbacks = 0
        """Tensors ``pin(mode="auto")`` could not register and copied into pinned memory."""
        self.lost: BaseException | None = None
        """A sticky CUDA error (:func:`context_lost`): every later op fails with it."""
        self.timeline = CudaTimeline()

    def __repr__(self) -> str:
        return f"CudaDevicePool({[d.index for d in self.devices]})"

    def pin(self, tensor: torch.Tensor, mode: str) -> torch.Tensor:
        """Page-lock ``tensor``. ``"register"`` locks its own storage in place
        (``cudaHostRegister``; shared with other pools that lock it too, undone when the
        last holder gives it back: :meth:`close`, :meth:`unpin`): no copy and none of the
        power-of-two rounding of ``pin_memory()``'s caching host allocator, which could
        double the host memory of the weights. ``"auto"`` registers and falls back to
        ``"alloc"`` (a pinned copy) where registering fails.

        A tensor that is a view of a file mapping (its storage object carries a
        ``roundpipe_mapped_file`` attribute, as ``roundpipe.from_pretrained`` sets on a
        LoRA model's frozen base weights) stays pageable in every mode: registering it
        would lock the whole file in RAM and a pinned copy would duplicate it; the
        driver stages uploads from pageable memory."""
        storage = tensor.untyped_storage()
        if getattr(storage, MAPPED_FILE_ATTR, None) is not None:
            return tensor
        if mode == "off":
            return tensor
        if REGISTRATIONS.hold(storage.data_ptr()):  # locked by a pool: this one holds it too
            self._registered.append(storage.data_ptr())
            return tensor
        if tensor.is_pinned():
            return tensor
        if mode == "alloc":
            return tensor.pin_memory()
        if mode in ("register", "auto"):
            code = self._register(storage)
            if code == 0:
                return tensor
            if mode == "auto":
                self._note_fallback(code)
                return tensor.pin_memory()
            raise RuntimeError(
                f"cudaHostRegister failed with CUDA error {code}; use pin_model='alloc' or 'off'"
            )
        raise ValueError(f"pin_model must be 'auto', 'alloc', 'register' or 'off', got {mode!r}")

    def unpin(self, address: int) -> None:
        if address in self._registered:
            self._registered.remove(address)
            REGISTRATIONS.release(address, self._unregister)

    def _unregister(self, address: int) -> None:
        with torch.cuda.device(self.devices[0].index):
            torch.cuda.cudart().cudaHostUnregister(address)

    def workers_on(self, index: int) -> int:
        """How many of the pool's workers run on GPU ``index``."""
        return sum(device.index == index for device in self.devices)

    def _register(self, storage: torch.UntypedStorage) -> int:
        """``cudaHostRegister`` the storage (read-only where plain registration is
        refused: the GPU only reads weights and inputs); 0 or the CUDA error code."""
        code = self._host_register(storage.data_ptr(), storage.nbytes(), 0)
        if code != 0:
            code = self._host_register(
                storage.data_ptr(), storage.nbytes(), HOST_REGISTER_READ_ONLY
            )
        if code == 0:
            REGISTRATIONS.add(storage)  # kept alive until its last holder releases it
            self._registered.append(storage.data_ptr())
        return code

    def _host_register(self, address: int, size: int, flags: int) -> int:
        """``cudaHostRegister`` under the pool's first GPU (no context made on GPU 0 for
        ``cuda:1,2``); a refusal's error is cleared so no later launch reports it."""
        with torch.cuda.device(self.devices[0].index):
            result = torch.cuda.cudart().cudaHostRegister(address, size, flags)
        code = int(getattr(result, "value", result))
        if code != 0:
            clear_last_error()
        return code

    def _lock_block(self, size: int) -> torch.Tensor:
        """A page-locked host block of exactly ``size`` bytes (whole pages): the pages of
        a host allocation registered with ``cudaHostRegister``; only pages inside it, so
        no registration overlaps another. Falls back to ``pin_memory()`` if refused."""
        backing = torch.empty(size + PAGE, dtype=torch.uint8)
        offset = -backing.data_ptr() % PAGE
        block = backing[offset : offset + size]
        if self._host_register(block.data_ptr(), size, 0) != 0:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self._host_registered.add(block.data_ptr())
        return block

    def _unlock_block(self, block: torch.Tensor) -> None:
        if block.data_ptr() in self._host_registered:
            self._host_registered.discard(block.data_ptr())
            with torch.cuda.device(self.devices[0].index):
                torch.cuda.cudart().cudaHostUnregister(block.data_ptr())

    def _synchronize(self) -> None:
        for device in self.devices:
            torch.cuda.synchronize(device.index)

    def close(self) -> None:
        """Unregister the host memory :meth:`pin` registered and give back the download
        blocks (those still held by tensors when these die); safe to call again."""
        registered, self._registered = self._registered, []
        for address in registered:
            REGISTRATIONS.release(address, self._unregister)
        self.host_blocks.close(synchronize=self._synchronize)

    def rng_lock(self, index: int) -> threading.RLock:
        """Held while launching random kernels on GPU ``index`` (shared by its workers)."""
        return self._rng_locks[index]

    def _note_fallback(self, code: int) -> None:
        self.pin_fallbacks += 1
        if self.pin_fallbacks == 1:
            warnings.warn(
                f"cudaHostRegister refused a tensor (CUDA error {code}); it and any other "
                "refused one are copied into pinned memory instead, which costs host memory "
                "(pool.pin_fallbacks counts them; pin_model='off' keeps them pageable)",
                RuntimeWarning,
                stacklevel=4,
            )

    def note_error(self, error: BaseException) -> BaseException:
        """The error a stream op raised, as it is to be reported: a sticky CUDA error
        becomes the pool's lost context (:func:`context_lost`), reported from then on."""
        lost = self.lost or context_lost(error)
        if lost is not None:
            self.lost = lost
            return lost
        return error

    def clear_errors(self) -> None:
        if self.lost is not None:  # the context cannot run anything again
            return
        for device in self.devices:
            for stream in device.streams.values():
                stream.error = None

    def start_recording(self) -> None:
        self.timeline.start([(d.position, d.index) for d in self.devices])

    def spans(self) -> list[SpanRecord]:
        self._synchronize()
        return self.timeline.spans()
