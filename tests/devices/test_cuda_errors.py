"""What the CUDA backend makes of CUDA's errors, checked on the CPU: a sticky error is
reported as a lost context with what to do, and the CUDA runtime library the process
loaded is found to clear a refused registration's error (torch 2.11's cudart() has no
cudaGetLastError)."""

from __future__ import annotations

import pytest

from roundpipe.devices.cuda_errors import CudaContextLost, context_lost, loaded_cudart_paths

MAPS = """\
7f00 r--p 00000000 fd:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6
7f10 r-xp 00001000 fd:01 2 /venv/site-packages/nvidia/cu13/lib/libcudart.so.13
7f20 r--p 00002000 fd:01 2 /venv/site-packages/nvidia/cu13/lib/libcudart.so.13
7f30 rw-p 00000000 00:00 0
7f40 r-xp 00000000 fd:01 3 /venv/site-packages/torch/lib/libtorch_cuda.so
7f50 r-xp 00000000 fd:01 4 /opt/cuda path/lib64/libcudart.so.12.4.127
"""


def test_the_loaded_cuda_runtime_libraries_are_found_once_each():
    assert loaded_cudart_paths(MAPS) == [
        "/venv/site-packages/nvidia/cu13/lib/libcudart.so.13",
        "/opt/cuda path/lib64/libcudart.so.12.4.127",
    ]


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: device-side assert triggered\nCUDA kernel errors might be ...",
        "CUDA error: an illegal memory access was encountered",
        "CUDA error: unspecified launch failure",
        "CUDA error: misaligned address",
    ],
)
def test_a_sticky_cuda_error_is_a_lost_context_saying_what_to_do(message):
    error = RuntimeError(message)
    lost = context_lost(error)
    assert isinstance(lost, CudaContextLost)
    assert lost.__cause__ is error
    text = str(lost)
    assert message.splitlines()[0] in text
    assert "Restart the process" in text and "CUDA_LAUNCH_BLOCKING=1" in text


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        ValueError("a shape mismatch in the user's layer"),
        RuntimeError("CUDA error: invalid argument"),
    ],
)
def test_other_errors_are_not_a_lost_context(error):
    assert context_lost(error) is None


def test_once_the_context_is_lost_every_later_error_is_reported_as_that():
    from roundpipe.devices.cuda import CudaDevicePool

    pool = CudaDevicePool.__new__(CudaDevicePool)  # no GPU here: only its error rule
    pool.lost, pool.devices = None, []
    assert isinstance(pool.note_error(ValueError("a layer's own error")), ValueError)
    lost = pool.note_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert isinstance(lost, CudaContextLost)
    assert pool.note_error(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")) is lost
    pool.clear_errors()  # a recovery cannot make it usable again
    assert pool.lost is lost
