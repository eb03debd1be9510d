"""A failing ``step_fn`` keeps the gradients, as in PyTorch.

Sync or async, wherever its error is reported, with a GradScaler too: a retried step
applies the kept gradients, and calls after the failure accumulate on them. What the
failing ``step_fn`` did to the weights before it raised is not rolled back, as in
PyTorch.

Every "after the failure" check compares with plain PyTorch. A failed *call* discards
its gradients: ``test_failed_call_gradients.py``. What the errors say is tested in
``test_error_messages.py``.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from support.faults import IN_FUSED_STAGE, failing_step, run_failed_async_step, sgd_step, train_call
from support.oracle import (
    assert_weights_close,
    batch,
    mlp,
    mse_sum,
    pytorch_sgd_step,
    pytorch_sgd_steps,
    reference_loss_and_grads,
)
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig

NUM_MICROBATCH = 4
LR = 0.1


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def pytorch_sgd(reference: nn.Module, steps: list[list[int]]) -> nn.Module:
    """PyTorch: one SGD step per entry of ``steps``, over the summed gradients of its batches."""
    return pytorch_sgd_steps(reference, steps, NUM_MICROBATCH, LR)


# -- a failing step_fn keeps the gradients --------------------------------------------


STEP_CONFIG = RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH, execute_plan="2,2|2,1,1,1,1")


class FailingStep:
    """A step_fn that raises before touching anything; ``ran`` is set when it ran."""

    def __init__(self) -> None:
        self.ran = threading.Event()

    def __call__(self) -> None:
        self.ran.set()
        raise ArithmeticError("injected fault in step_fn")


def failed_sync_step(model: RoundPipe, error_of) -> BaseException:
    return error_of(model.step, FailingStep(), is_async=False)


def queue_failing_async_step(model: RoundPipe) -> None:
    step = FailingStep()
    model.step(step, is_async=True)
    assert step.ran.wait(10), "the optimizer thread never ran the step"
    time.sleep(0.2)  # the thread hands the error back right after step_fn raised


def failed_async_step_reported_by_forward_backward(model: RoundPipe, error_of) -> BaseException:
    queue_failing_async_step(model)
    return error_of(train_call, model, 9)


def failed_async_step_reported_by_step(model: RoundPipe, error_of) -> BaseException:
    queue_failing_async_step(model)
    return error_of(model.step, lambda: None, is_async=True)


def failed_async_step_reported_by_synchronize(model: RoundPipe, error_of) -> BaseException:
    queue_failing_async_step(model)
    return error_of(model.synchronize)


STEP_FAILURES = [
    pytest.param(failed_sync_step, id="sync-reported-by-step"),
    pytest.param(failed_async_step_reported_by_forward_backward, id="async-by-forward_backward"),
    pytest.param(failed_async_step_reported_by_step, id="async-by-step"),
    pytest.param(failed_async_step_reported_by_synchronize, id="async-by-synchronize"),
]


@pytest.mark.parametrize("fail", STEP_FAILURES)
def test_retried_step_after_a_failing_step_fn_applies_the_kept_gradients(
    fail, wrap, no_hang, error_of
):
    model, reference = wrap(mlp(), devices="emulated:3", model_run_config=STEP_CONFIG)
    optimizer = sgd(model.optim_parameters())
    no_hang(train_call, model, 1)
    error = fail(model, error_of)
    assert "injected fault in step_fn" in str(error)
    no_hang(model.step, sgd_step(optimizer), is_async=False)
    no_hang(model.synchronize)
    assert_weights_close(model.model, pytorch_sgd(reference, [[1]]))


def test_calls_after_a_failing_step_fn_accumulate_on_the_kept_gradients(wrap, no_hang, error_of):
    model, reference = wrap(mlp(), devices="emulated:3", model_run_config=STEP_CONFIG)
    optimizer = sgd(model.optim_parameters())
    no_hang(train_call, model, 1)
    failed_sync_step(model, error_of)
    no_hang(train_call, model, 2)
    no_hang(model.step, sgd_step(optimizer), is_async=False)
    no_hang(model.synchronize)
    assert_weights_close(model.model, pytorch_sgd(reference, [[1, 2]]))


def sgd_applied(reference: nn.Module, times: int) -> nn.Module:
    """``reference`` after ``times`` SGD steps (lr 0.1) with the gradients of one call."""
    expected = copy.deepcopy(reference)
    x, y = batch()
    reference_loss_and_grads(expected, x, y, NUM_MICROBATCH)
    optimizer = torch.optim.SGD(expected.parameters(), lr=0.1)
    for _ in range(times):
        optimizer.step()
    return expected


def test_failing_synchronous_step_leaves_the_weights_as_step_fn_left_them(
    faulty, no_hang, error_of
):
    # step_fn ran optimizer.step() and then raised: like PyTorch, nothing is rolled back.
    model, reference, _ = faulty(IN_FUSED_STAGE)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    no_hang(train_call, model)
    error_of(model.step, failing_step(optimizer), is_async=False)
    no_hang(model.synchronize)
    expected = sgd_applied(reference, times=1)
    for got, want in zip(model.model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(got.detach(), want.detach(), atol=1e-6, rtol=1e-6)


def test_failed_synchronous_step_can_be_retried_with_the_kept_gradients(faulty, no_hang, error_of):
    # The gradients are kept, so the retry applies them again, as PyTorch would.
    model, reference, _ = faulty(IN_FUSED_STAGE)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    no_hang(train_call, model)
    error_of(model.step, failing_step(optimizer), is_async=False)
    no_hang(model.step, sgd_step(optimizer), is_async=False)
    no_hang(model.synchronize)
    expected = sgd_applied(reference, times=2)
    for got, want in zip(model.model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(got.detach(), want.detach(), atol=1e-6, rtol=1e-6)


def test_model_trains_like_pytorch_after_failing_async_step(
    faulty, no_hang, error_of, trains_like_pytorch
):
    model, reference, _ = faulty(IN_FUSED_STAGE)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    run_failed_async_step(model, no_hang)
    error_of(train_call, model)  # reports the step's failure; this call does not run
    no_hang(model.step, sgd_step(optimizer), is_async=False)  # applies the kept gradients
    trains_like_pytorch(model, sgd_applied(reference, times=2))


SCALER_CONFIG = RoundPipeRunConfig(num_microbatch=3)


def test_retrying_a_failed_step_with_a_grad_scaler_applies_the_unscaled_gradients(no_hang):
    net = mlp()
    x, y = batch()
    expected = pytorch_sgd_step(net, x, y, SCALER_CONFIG.num_microbatch, LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    pipe = RoundPipe(net, devices="emulated:2", model_run_config=SCALER_CONFIG, grad_scaler=scaler)
    try:
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=LR)
        no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)

        def flaky() -> None:
            raise ValueError("transient failure before the optimizer ran")

        def step_fn() -> None:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

        with pytest.raises(ValueError, match="transient"):
            no_hang(pipe.step, flaky, is_async=False)
        no_hang(pipe.step, step_fn, is_async=False)  # the retry a failing step_fn allows
        no_hang(pipe.synchronize)
        assert_weights_close(pipe.model, expected)
    finally:
        no_hang(pipe.close)
