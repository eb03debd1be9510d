"""Back-pressure: while an asynchronous step runs, at most one call's gradients wait.

A call's downloaded gradients wait in host memory until the step before it has been
applied. With several calls per step and a slow step, a second call must not start (and
download a second full set of gradients) before that step is published; the first call
after a step still overlaps it.
"""

from __future__ import annotations

import threading

import torch
from support.oracle import batch, mlp, mse_sum

from roundpipe import RoundPipe, RoundPipeRunConfig

CONFIG = RoundPipeRunConfig(num_microbatch=2)
WAIT_S = 2.0


def test_a_second_call_waits_for_the_running_step_and_the_first_does_not(no_hang):
    model = mlp()
    second_started = threading.Event()
    marker = 7.0  # the second call's inputs (a recompute of the first call's may run later)

    def forward_hook(module, inputs, output) -> None:
        if torch.all(inputs[0] == marker):
            second_started.set()

    model[0].register_forward_hook(forward_hook)  # before wrapping: part of the layer

    with RoundPipe(model, devices="emulated:2", model_run_config=CONFIG) as pipe:
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=0.01)
        x, y = batch()
        no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
        seen: dict[str, bool] = {}

        def slow_step() -> None:
            # Runs while the caller issues the next calls: the first call after this step
            # may run; the second may not start before this step is published.
            seen["first ran during the step"] = first_done.wait(WAIT_S)
            seen["second started during the step"] = second_started.wait(WAIT_S)
            optimizer.step()
            optimizer.zero_grad()

        first_done = threading.Event()
        pipe.step(slow_step, is_async=True)
        no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
        first_done.set()
        no_hang(pipe.forward_backward, (torch.full_like(x, marker),), label=y, loss_fn=mse_sum)
        no_hang(pipe.step, lambda: (optimizer.step(), optimizer.zero_grad()), is_async=True)
        no_hang(pipe.synchronize)

    assert seen == {"first ran during the step": True, "second started during the step": False}
