"""Where a run trains when ``--devices`` or ``--precision`` is not given: decided by the
machine (its GPUs, ``ROUNDPIPE_DEVICES``), after the options are merged."""

from __future__ import annotations

import os

from .usage import UsageError


def machine_defaults(devices: str | None, precision: str | None) -> tuple[str, str]:
    """``(devices, precision)`` with the missing ones filled: CUDA in bf16 where there is
    a GPU, else 2 emulated devices (or ``ROUNDPIPE_DEVICES``) in fp32; CUDA asked for
    where torch sees none is refused."""
    import torch

    if devices is None:
        cuda = torch.cuda.is_available()
        devices = "cuda" if cuda else os.environ.get("ROUNDPIPE_DEVICES") or "emulated:2"
    if devices.strip().startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(
            f"--devices {devices}: torch sees no CUDA GPU here; use 'emulated:N' on the CPU"
        )
    if precision is None:
        precision = "bf16" if devices.strip().startswith("cuda") else "fp32"
    return devices, precision
