"""Background failures reach the caller and nothing waits forever; bookkeeping stays bounded.

Failures injected here are in the runtime's own host-side work (publishing weights
after a step, writing buffers back), which no layer or loss of the user's can cause.
"""

from __future__ import annotations

import pytest
import torch
from support.oracle import batch, mlp, mse_sum
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.runtime.versions import WeightVersions

CONFIG = RoundPipeRunConfig(num_microbatch=3, execute_plan="2,2|2,1,1,1,1")


def train(pipe: RoundPipe, seed: int = 1) -> torch.Tensor:
    x, y = batch(seed=seed)
    return pipe.forward_backward((x,), label=y, loss_fn=mse_sum)


def test_a_failing_publish_reaches_the_caller_and_the_next_calls_work(wrap, no_hang, monkeypatch):
    pipe, reference = wrap(mlp(), devices="emulated:2", model_run_config=CONFIG)
    optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
    real_publish = WeightVersions.publish
    failures = iter([True])

    def publish_once_broken(self, version, buffer):
        if next(failures, False):
            raise MemoryError("injected fault while publishing")
        real_publish(self, version, buffer)

    monkeypatch.setattr(WeightVersions, "publish", publish_once_broken)
    no_hang(train, pipe)
    pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()))

    def keep_training() -> None:
        train(pipe, 2)
        pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        pipe.synchronize()

    with pytest.raises(MemoryError, match="publishing weights version 1"):
        no_hang(keep_training)
    no_hang(pipe.synchronize)  # recovered: the masters were published again
    masters = [m.detach().clone() for m in pipe.optim_parameters()]
    for got, want in zip(pipe.model.parameters(), masters, strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
    no_hang(train, pipe, 3)  # and training goes on


class CountingNorm(nn.BatchNorm1d):
    """A BatchNorm whose buffers write back into host tensors we can break."""


def test_a_failing_buffer_write_back_reaches_the_caller(wrap, no_hang, monkeypatch):
    model = nn.Sequential(nn.Linear(8, 16), CountingNorm(16), nn.Tanh(), nn.Linear(16, 4))
    pipe, _ = wrap(model, devices="emulated:2", model_run_config=RoundPipeRunConfig(3))
    host_mean = model[1].running_mean
    real_copy = torch.Tensor.copy_

    def copy_refusing_running_mean(self, src, *args, **kwargs):
        if self is host_mean:
            raise OSError("injected fault writing a buffer back")
        return real_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_refusing_running_mean)
    with pytest.raises(OSError, match="injected fault writing a buffer back"):
        no_hang(train, pipe)
        no_hang(pipe.synchronize)
    monkeypatch.undo()
    no_hang(train, pipe)  # buffer gates were opened: no later call waits forever
    no_hang(pipe.synchronize)


def test_bookkeeping_stays_bounded_over_many_async_steps(wrap, no_hang):
    pipe, _ = wrap(
        mlp(depth=4, width=8),
        devices="emulated:2",
        model_run_config=CONFIG.replace(execute_plan=None, num_microbatch=2),
    )
    optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=1e-3)
    x, y = batch(size=4)
    sizes = []
    for _ in range(300):
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        ledger = pipe.runtime.session.ledger
        sizes.append(len(ledger.in_flight) + len(ledger.steps) + len(ledger.since_step))
    no_hang(pipe.synchronize)
    assert max(sizes[100:]) <= 8, f"calls and steps kept in the ledger grow: {sizes[-10:]}"
