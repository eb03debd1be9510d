"""Fault injection for the failure tests: a layer that raises when armed, and failing
losses, transfers and step functions.

The six-layer model (:func:`faulty_sequential`) is a 5-layer MLP with a
:class:`FaultyLayer` inserted at a position. Under :data:`CONFIG` on three emulated
devices (the ``faulty`` fixture in ``conftest.py``), four microbatches and the plan
``2,2|2,1,1,1,1``, it runs forward stages 0 (layers 0-1) and 1 (layers 2-3), the fused
stage 0 (layers 4-5), then backward stages 1..4 (layers 3, 2, 1, 0).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig
from support.oracle import batch, mlp, mse_sum

NUM_MICROBATCH = 4
CONFIG = RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH, execute_plan="2,2|2,1,1,1,1")
IN_FORWARD_AND_BACKWARD_STAGE = 2  # forward stage 1, backward stage 2
IN_FUSED_STAGE = 4


class FaultSwitch:
    """Arms one fault: the ``at``-th call (0-based) in ``phase`` raises, once."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.at = 0
        self.calls = 0
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> FaultSwitch:
        return self  # RoundPipe runs deep copies of a layer; they must share the switch

    def arm(self, phase: str, at: int = 0) -> None:
        self.phase, self.at, self.calls = phase, at, 0

    def fires(self, phase: str) -> bool:
        with self._lock:
            if self.phase != phase:
                return False
            self.calls += 1
            if self.calls - 1 != self.at:
                return False
            self.phase = None
            return True


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises when the switch is armed for ``"backward"``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, switch: FaultSwitch) -> torch.Tensor:
        ctx.switch = switch
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.switch.fires("backward"):
            raise ValueError("injected fault in backward")
        return grad, None


class FaultyLayer(nn.Module):
    """An identity layer that raises when its switch is armed for the phase it runs in.

    Phases: ``"forward"`` (no autograd: a forward stage), ``"grad forward"`` (the fused
    stage or a backward stage's recompute), ``"backward"``. Any object with a
    ``fires(phase) -> bool`` method is a switch.
    """

    def __init__(self, switch: FaultSwitch) -> None:
        super().__init__()
        self.switch = switch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        phase = "grad forward" if torch.is_grad_enabled() else "forward"
        if self.switch.fires(phase):
            raise ValueError(f"injected fault in {phase}")
        return _FailingBackward.apply(x, self.switch)


def faulty_sequential(position: int) -> tuple[nn.Sequential, FaultSwitch]:
    """The six-layer test model: a FaultyLayer inserted at ``position`` into a 5-layer MLP."""
    switch = FaultSwitch()
    layers = list(mlp(depth=5))
    layers.insert(position, FaultyLayer(switch))
    return nn.Sequential(*layers), switch


def train_call(model: RoundPipe, seed: int = 1, loss_fn=mse_sum) -> torch.Tensor:
    """One ``forward_backward`` on ``batch(seed)``."""
    x, y = batch(seed=seed)
    return model.forward_backward((x,), label=y, loss_fn=loss_fn)


def infer(model: RoundPipe) -> torch.Tensor:
    with torch.no_grad():  # grad mode is per thread, so it is entered on the calling one
        return model(batch()[0])


def sgd_step(optimizer: torch.optim.Optimizer) -> Callable[[], object]:
    return lambda: (optimizer.step(), optimizer.zero_grad())


def failing_loss(at: int):
    """A loss function that raises KeyError on its ``at``-th call (0-based)."""
    calls = []

    def loss_fn(output, label):
        calls.append(None)
        if len(calls) - 1 == at:
            raise KeyError("injected fault in loss_fn")
        return mse_sum(output, label)

    return loss_fn


def oversized_batch():
    """A batch whose microbatch inputs (600 x 8 floats = 19,200 bytes) exceed 16 KiB."""
    generator = torch.Generator().manual_seed(3)
    size = 600 * NUM_MICROBATCH
    return torch.randn(size, 8, generator=generator), torch.randn(size, 4, generator=generator)


def fail_transfer(monkeypatch, device, method: str, stream: str, at: int) -> None:
    """Make ``device.<method>`` raise on its ``at``-th call (0-based) from ``stream``.

    ``copy_in`` is every host-to-device copy but weight chunks (``copy_in_all``, one
    call per chunk), ``to_host`` every device-to-host copy; all take the stream they
    run on as their last argument.
    """
    original = getattr(device, method)
    calls = []

    def transfer(*args):
        if args[-1].name == stream:
            calls.append(None)
            if len(calls) - 1 == at:
                raise OSError(f"injected fault in {method}")
        return original(*args)

    monkeypatch.setattr(device, method, transfer)


def failing_step(optimizer: torch.optim.Optimizer, ran: threading.Event | None = None):
    """A step_fn that updates the weights, then raises (a partial update)."""

    def step() -> None:
        optimizer.step()
        if ran is not None:
            ran.set()
        raise ArithmeticError("injected fault in step_fn")

    return step


def run_failed_async_step(model: RoundPipe, no_hang) -> None:
    """Train, queue a failing async step, and wait until the optimizer thread ran it."""
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    no_hang(train_call, model)
    no_hang(model.synchronize)
    ran = threading.Event()
    model.step(failing_step(optimizer, ran))
    assert ran.wait(30), "the optimizer thread never ran the step"
    time.sleep(0.2)  # the thread hands the error back right after step_fn raised
