"""CUDA's errors as the CUDA backend meets them: a refused host registration's stale
error, cleared so no later launch reports it, and the sticky errors that lose the
process's CUDA context (docs/design.md#cuda-backend)."""

from __future__ import annotations

import ctypes

import torch

HOST_REGISTER_READ_ONLY = 0x08
"""``cudaHostRegisterReadOnly``: the device only reads the memory (a read-only mapping)."""

STICKY_ERRORS = (
    "device-side assert",
    "illegal memory access",
    "illegal address",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "hardware stack error",
)
"""CUDA errors that corrupt the context: every later CUDA call of the process fails."""


class CudaContextLost(RuntimeError):
    """A sticky CUDA error: the process's CUDA context cannot run anything again."""


def context_lost(error: BaseException) -> CudaContextLost | None:
    """``error`` as a :class:`CudaContextLost` if it is a sticky CUDA error (raised at a
    later op, on any thread, than the kernel that caused it), else None."""
    text = str(error).lower()
    if not any(sticky in text for sticky in STICKY_ERRORS):
        return None
    lost = CudaContextLost(
        f"the CUDA context is lost ({str(error).strip().splitlines()[0]}): CUDA reports "
        "such an error at a later operation, possibly of another stage, so the op named "
        "may not be the one at fault, and nothing runs on this GPU again in this process. "
        "Restart the process; run it with CUDA_LAUNCH_BLOCKING=1 to find the kernel at fault"
    )
    lost.__cause__ = error
    return lost


def loaded_cudart_paths(maps: str) -> list[str]:
    """The CUDA runtime libraries in a ``/proc/<pid>/maps`` listing, once each."""
    paths = []
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if "libcudart.so" in path.rsplit("/", 1)[-1] and path not in paths:
            paths.append(path)
    return paths


def clear_last_error() -> None:
    """Reset CUDA's last error of this thread after a refused ``cudaHostRegister`` (the
    fallback is fine), so the next kernel launch check does not report it as its own.
    ``torch.cuda.cudart()`` has no ``cudaGetLastError`` in every torch (2.11 has none):
    it is called in the CUDA runtime library the process loaded."""
    get_last_error = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if get_last_error is not None:
        get_last_error()
        return
    try:
        with open("/proc/self/maps") as maps:
            paths = loaded_cudart_paths(maps.read())
    except OSError:
        return
    for path in paths:
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError):
            continue
