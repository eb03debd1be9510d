"""Device pools: which devices jobs are dispatched to, chosen by a spec string.

``"cuda"`` (all visible GPUs), ``"cuda:0,2"``, ``"emulated:4"`` (4 virtual devices
on the CPU), ``"emulated:4@0.5"`` (all at half speed) or ``"emulated:4@1,1,0.5,0.5"``
(a speed per device: a mixed pool, ``EmulatedOptions.speeds``). Without an explicit
spec: all CUDA GPUs, or without CUDA the spec in ``ROUNDPIPE_DEVICES``, else
``emulated:2`` with a one-time notice.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import torch

from .base import (
    Device,
    DeviceOpError,
    DevicePool,
    Event,
    OpInfo,
    Slot,
    SpanRecord,
    Stream,
    Timer,
)
from .emulated.device import EmulatedDevicePool, EmulatedOptions, check_speeds

__all__ = [
    "Device",
    "DeviceOpError",
    "DevicePool",
    "EmulatedDevicePool",
    "EmulatedOptions",
    "Event",
    "OpInfo",
    "SPEC_FORMS",
    "Slot",
    "SpanRecord",
    "Stream",
    "Timer",
    "device_count",
    "make_pool",
]

_notice_given = False

SPEC_FORMS = (
    "'cuda' (all GPUs), 'cuda:0,2' (GPU indices), 'emulated:N' (N virtual devices), "
    "'emulated:N@S' (all at speed S) or 'emulated:N@S1,...,SN' (one speed per device, "
    "each above 0, e.g. 'emulated:4@1,1,0.5,0.5')"
)
"""The spec strings a pool is built from, for messages."""


def make_pool(
    spec: str | DevicePool | None = None, emulated_options: EmulatedOptions | None = None
) -> DevicePool:
    """Build the device pool named by ``spec`` (see module docstring)."""
    if isinstance(spec, DevicePool):
        return spec
    if spec is None:
        spec = _default_spec()
    if not isinstance(spec, str):
        raise TypeError(f"devices must be a spec string or a DevicePool, got {type(spec).__name__}")
    kind, named = _parsed(spec)
    if kind == "emulated":
        count, speeds = named
        return EmulatedDevicePool(count, _with_speeds(spec, emulated_options, speeds))
    from .cuda import CudaDevicePool  # imported lazily: touches CUDA

    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device spec {spec!r} asks for CUDA, but torch.cuda is not available here; "
            "use 'emulated:N' to run on the CPU"
        )
    return CudaDevicePool(named if named is not None else list(range(torch.cuda.device_count())))


def device_count(spec: str) -> int:
    """How many devices the spec string ``spec`` names (``"cuda"``: every GPU torch
    sees), checked as :func:`make_pool` checks it, without building a pool."""
    kind, named = _parsed(spec)
    if kind == "emulated":
        return named[0]
    return torch.cuda.device_count() if named is None else len(named)


def _parsed(spec: str) -> tuple[str, Any]:
    """``("emulated", (N, speeds or None))`` or ``("cuda", indices or None)`` for the spec
    string ``spec``."""
    kind, colon, rest = spec.strip().partition(":")
    kind = kind.strip()
    if kind == "emulated":
        count, at, speeds = rest.partition("@")
        number = _emulated_count(spec, count if colon else None)
        return kind, (number, _emulated_speeds(spec, speeds, number) if at else None)
    if kind == "cuda":
        return kind, _cuda_indices(spec, rest if colon else None)
    raise ValueError(f"unknown device spec {spec!r}: write {SPEC_FORMS}")


def _emulated_count(spec: str, count: str | None) -> int:
    """The N of ``"emulated:N"``; it must be written and at least 1."""
    try:
        number = int(count) if count is not None else None
    except ValueError:
        number = None
    if number is None or number < 1:
        raise ValueError(
            f"bad device spec {spec!r}: an emulated pool needs at least one device; write "
            f"{SPEC_FORMS}"
        )
    return number


def _emulated_speeds(spec: str, written: str, count: int) -> float | tuple[float, ...]:
    """The speeds after the ``@`` of ``"emulated:N@..."``: one for all or one per device."""
    try:
        speeds = tuple(_speed(text) for text in written.split(","))
        check_speeds(speeds if len(speeds) > 1 else speeds[0], count)
    except ValueError as error:
        raise ValueError(f"bad device spec {spec!r}: {error}; write {SPEC_FORMS}") from None
    return speeds if len(speeds) > 1 else speeds[0]


def _speed(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{text.strip()!r} is not a device speed") from None


def _with_speeds(
    spec: str, options: EmulatedOptions | None, speeds: float | tuple[float, ...] | None
) -> EmulatedOptions | None:
    """``options`` with the speeds the spec string wrote, if it wrote any."""
    if speeds is None:
        return options
    options = options or EmulatedOptions()
    given = options.speeds if isinstance(options.speeds, (tuple, list)) else (options.speeds,)
    if any(speed != 1.0 for speed in given):
        raise ValueError(
            f"device spec {spec!r} gives device speeds and emulated_options gives speeds="
            f"{options.speeds!r}: give them once, in the spec string or in EmulatedOptions"
        )
    return dataclasses.replace(options, speeds=speeds)


def _cuda_indices(spec: str, indices: str | None) -> list[int] | None:
    """The GPU indices of ``"cuda:0,2"``; ``None`` for all GPUs (``"cuda"``)."""
    if indices is None:
        return None
    try:
        parsed = [int(i) for i in indices.split(",")]
    except ValueError:
        parsed = []
    if not parsed or min(parsed) < 0:
        raise ValueError(
            f"bad device spec {spec!r}: write 'cuda' (all GPUs) or GPU indices >= 0 "
            "such as 'cuda:0,2'"
        )
    return parsed


def _default_spec() -> str:
    global _notice_given
    if torch.cuda.is_available():
        return "cuda"
    env = os.environ.get("ROUNDPIPE_DEVICES")
    if env:
        return env
    if not _notice_given:
        _notice_given = True
        warnings.warn(
            "roundpipe: no CUDA device found and ROUNDPIPE_DEVICES is not set; "
            "using 2 emulated devices on the CPU",
            stacklevel=3,
        )
    return "emulated:2"
