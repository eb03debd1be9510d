"""Download blocks bounded by a stage: at most one job's gradients per device wait.

A job's downloaded gradients stay in page-locked download blocks until they reach the
masters, and those of a call after an asynchronous step wait for that step. Without a
bound, a slow step would let the next call download every layer's gradients into
page-locked memory (host memory in proportion to the model); with it, each device
holds at most one job's gradients there, and the results are unchanged.
"""

from __future__ import annotations

import threading
import time

import torch
from support.oracle import mse_sum
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig

WIDTH = 256
DEPTH = 8
LAYER_GRAD_BYTES = (WIDTH * WIDTH + WIDTH) * 4
CONFIG = RoundPipeRunConfig(num_microbatch=2, execute_plan=f"{DEPTH - 1}|" + ",".join("1" * DEPTH))


def linears(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(4, WIDTH, generator=generator), torch.randn(4, WIDTH, generator=generator)


def test_a_call_after_a_slow_step_holds_one_jobs_gradients_per_device(no_hang):
    x, y = _inputs()
    release_step = threading.Event()
    with RoundPipe(linears(), devices="emulated:2", model_run_config=CONFIG) as pipe:
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=0.01)

        def slow_step() -> None:
            release_step.wait(60)
            optimizer.step()
            optimizer.zero_grad()

        no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
        pipe.step(slow_step, is_async=True)
        second = threading.Thread(
            target=pipe.forward_backward, args=((x,),), kwargs={"label": y, "loss_fn": mse_sum}
        )
        second.start()
        held = 0
        deadline = time.monotonic() + 1.5  # without the bound, all gradients are in by then
        while time.monotonic() < deadline:
            held = max(held, pipe.pool.host_blocks.stats().in_use_bytes)
            time.sleep(0.01)
        release_step.set()
        second.join(60)
        assert not second.is_alive()
        no_hang(pipe.step, lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
        no_hang(pipe.synchronize)
        trained = [p.detach().clone() for p in pipe.parameters()]

    # Two devices, each holding one backward job's gradients (one layer, in blocks up to
    # 1/16 larger) while the step runs; without the bound all eight layers' are there.
    assert 0 < held < 3 * LAYER_GRAD_BYTES, held

    # Plain PyTorch: both calls read the initial weights (the second runs beside the
    # asynchronous first step, one step stale), then two SGD steps apply their gradients.
    reference = linears()
    (mse_sum(reference(x), y) / 2).backward()  # the mean of the two microbatches' losses
    with torch.no_grad():
        for got, param in zip(trained, reference.parameters(), strict=True):
            torch.testing.assert_close(got, param - 2 * 0.01 * param.grad, rtol=1e-5, atol=1e-6)
