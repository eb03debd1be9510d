"""One rule for failures, wherever their error surfaces (decided semantics of issue 6).

- A failed CALL never has its gradients reach a step. If it accumulated any gradient,
  every gradient accumulated since the last step before it is discarded, the exception
  carries a note saying so, and a queued step whose calls include it is skipped (weights
  unchanged). This holds whether the error surfaces at the next ``forward_backward``,
  ``step``, ``synchronize`` or ``close``.
- A failed call that accumulated nothing (a shape error in layer 0's forward) keeps the
  gradients of the good calls before it.
- A failing ``step_fn`` KEEPS the gradients (sync or async, wherever its error is
  reported): a retried step applies them, as in PyTorch.
- A layer raising ``StopIteration`` raises ``StopIteration`` with its own message, not
  ``RuntimeError: generator raised StopIteration``.

Every "after the failure" check trains one more call and compares with plain PyTorch.
"""

from __future__ import annotations

import copy
import re
import threading
import time
from collections.abc import Callable

import pytest
import torch
from oracle import (
    assert_weights_close,
    batch,
    mlp,
    mse_sum,
    reference_loss_and_grads,
)
from test_errors import FaultyLayer
from torch import nn

from roundpipe import EmulatedOptions, RoundPipe, RoundPipeRunConfig

NUM_MICROBATCH = 4
LR = 0.1
SETTLE_S = 0.5  # time for a background failure to finish before the next public call


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def sgd_step(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    return lambda: (optimizer.step(), optimizer.zero_grad())


def train_call(model: RoundPipe, seed: int) -> torch.Tensor:
    x, y = batch(seed=seed)
    return model.forward_backward((x,), label=y, loss_fn=mse_sum)


def notes(error: BaseException) -> str:
    return " ".join(getattr(error, "__notes__", []))


def says_gradients_were_discarded(error: BaseException) -> bool:
    """A note claims a discard ("... were discarded"), not its absence ("no ... discarded")."""
    return any(
        "discarded" in note and not re.search(r"\b(no|not|nothing)\b[^.;()]*\bdiscarded", note)
        for note in getattr(error, "__notes__", [])
    )


def named(name: str) -> Callable[[str], str]:
    return lambda message: f"{name}: {message}"


def pytorch_sgd(reference: nn.Module, steps: list[list[int]]) -> nn.Module:
    """PyTorch: one SGD step per entry of ``steps``, over the summed gradients of its batches."""
    model = copy.deepcopy(reference)
    optimizer = sgd(model.parameters())
    for seeds in steps:
        for seed in seeds:
            x, y = batch(seed=seed)
            reference_loss_and_grads(model, x, y, NUM_MICROBATCH)
        sgd_step(optimizer)()
    return model


# -- a fault in a background backward stage -------------------------------------------


class BackwardFault:
    """Armed: the next backward of the faulty layer waits for ``release``, then raises.

    A switch for test_errors' ``FaultyLayer``: it fires in the ``"backward"`` phase only.
    """

    def __init__(self) -> None:
        self.armed = False
        self.release = threading.Event()
        self.fired = threading.Event()
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> BackwardFault:
        return self  # RoundPipe runs deep copies of a layer; they must share the switch

    def arm(self) -> None:
        self.armed = True

    def fires(self, phase: str) -> bool:
        if phase != "backward":
            return False
        with self._lock:
            fires, self.armed = self.armed, False
        if fires:
            self.release.wait(10)
            self.fired.set()
        return fires


FAULTY_LAYER = 2
# Forward stage: layers 0-4; the fused stage: layer 5; backward stages: 4, 3, 2, 1, 0.
# Layer 2 is in a backward stage of its own: layers 3 and 5 (which have parameters)
# download their gradients before it fails; layer 0 never gets any.
BACKGROUND_CONFIG = RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH, execute_plan="5|1,1,1,1,1,1")


def slow_backward(info) -> float:
    return 0.01 if info.kind == "backward" else 0.0


@pytest.fixture
def faulty_model(wrap):
    """(model, reference, fault): six layers, the faulty identity at ``FAULTY_LAYER``."""
    fault = BackwardFault()
    layers = list(mlp(depth=5))
    layers.insert(FAULTY_LAYER, FaultyLayer(fault))
    model, reference = wrap(
        nn.Sequential(*layers),
        devices="emulated:3",
        model_run_config=BACKGROUND_CONFIG,
        emulated_options=EmulatedOptions(kernel_time=slow_backward),
    )
    return model, reference, fault


def fail_in_background_with_a_step_queued(model: RoundPipe, fault: BackwardFault, no_hang):
    """After one good synchronous step: a call whose backward fails after it returned,
    with an asynchronous step queued behind it; the fault is released only then."""
    optimizer = sgd(model.optim_parameters())
    no_hang(train_call, model, 1)
    no_hang(model.step, sgd_step(optimizer), is_async=False)
    fault.arm()
    no_hang(train_call, model, 2)  # returns while the armed backward waits for release
    no_hang(model.step, sgd_step(optimizer), is_async=True)
    fault.release.set()
    return optimizer


def settle(fault: BackwardFault) -> None:
    assert fault.fired.wait(10), "the armed backward never ran"
    time.sleep(SETTLE_S)


def surfaces_at_forward_backward(model, fault, error_of) -> BaseException:
    settle(fault)
    return error_of(train_call, model, 9)


def surfaces_at_step(model, fault, error_of) -> BaseException:
    settle(fault)
    return error_of(model.step, lambda: None, is_async=True)


def surfaces_at_synchronize(model, fault, error_of) -> BaseException:
    return error_of(model.synchronize)


SURFACES = [
    pytest.param(surfaces_at_forward_backward, id="forward_backward"),
    pytest.param(surfaces_at_step, id="step"),
    pytest.param(surfaces_at_synchronize, id="synchronize"),
]


@pytest.mark.parametrize("surface", SURFACES)
def test_background_failure_note_says_gradients_were_discarded(
    surface, faulty_model, no_hang, error_of
):
    model, _, fault = faulty_model
    fail_in_background_with_a_step_queued(model, fault, no_hang)
    error = surface(model, fault, error_of)
    assert says_gradients_were_discarded(error), f"no discard note: {error!r} {notes(error)!r}"


@pytest.mark.parametrize("surface", SURFACES)
def test_next_step_after_a_background_failure_applies_only_new_gradients(
    surface, faulty_model, no_hang, error_of
):
    """The failed call's partial gradients never reach a step; its queued step was skipped."""
    model, reference, fault = faulty_model
    optimizer = fail_in_background_with_a_step_queued(model, fault, no_hang)
    surface(model, fault, error_of)

    loss = no_hang(train_call, model, 3)
    no_hang(model.step, sgd_step(optimizer), is_async=False)
    no_hang(model.synchronize)

    x, y = batch(seed=3)
    want = reference_loss_and_grads(pytorch_sgd(reference, [[1]]), x, y, NUM_MICROBATCH)
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    assert_weights_close(model.model, pytorch_sgd(reference, [[1], [3]]))


def test_background_failure_reported_by_close_notes_the_discard(faulty_model, no_hang, error_of):
    model, _, fault = faulty_model
    fail_in_background_with_a_step_queued(model, fault, no_hang)
    error = error_of(model.close)
    assert says_gradients_were_discarded(error), f"no discard note: {error!r} {notes(error)!r}"
    with pytest.raises(RuntimeError, match="closed"):
        train_call(model, 3)


def test_background_failure_reported_by_close_skips_the_queued_step(
    faulty_model, no_hang, error_of
):
    model, reference, fault = faulty_model
    fail_in_background_with_a_step_queued(model, fault, no_hang)
    error_of(model.close)
    expected = pytorch_sgd(reference, [[1]])  # the good step only
    for (name, master), want in zip(
        model.optim_named_parameters(), expected.parameters(), strict=True
    ):
        torch.testing.assert_close(
            master.detach(), want.detach(), atol=1e-5, rtol=1e-5, msg=named(name)
        )


# -- a failed call that accumulated nothing -------------------------------------------


SHAPE_CONFIG = RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH, execute_plan="2,2|2,1,1,1,1")


def too_narrow_input_call(model: RoundPipe) -> torch.Tensor:
    x, y = batch(seed=5)
    return model.forward_backward((x[:, :7],), label=y, loss_fn=mse_sum)  # layer 0 wants 8


@pytest.fixture
def model_with_a_shape_error(wrap, no_hang, error_of):
    """A good call (its backward still running), then a call failing in layer 0's forward."""
    model, reference = wrap(
        mlp(),
        devices="emulated:3",
        model_run_config=SHAPE_CONFIG,
        emulated_options=EmulatedOptions(kernel_time=slow_backward),
    )
    no_hang(train_call, model, 1)
    error = error_of(too_narrow_input_call, model)
    return model, reference, error


def test_shape_error_in_layer_0_keeps_earlier_gradients(model_with_a_shape_error, no_hang):
    model, reference, _ = model_with_a_shape_error
    optimizer = sgd(model.optim_parameters())
    no_hang(train_call, model, 2)
    no_hang(model.step, sgd_step(optimizer), is_async=False)
    no_hang(model.synchronize)
    assert_weights_close(model.model, pytorch_sgd(reference, [[1, 2]]))


def test_shape_error_in_layer_0_has_no_discard_note(model_with_a_shape_error):
    _, _, error = model_with_a_shape_error
    assert not says_gradients_were_discarded(error), f"a discard note: {notes(error)!r}"


# -- a failing step_fn keeps the gradients ---------------------------------------------


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


# -- StopIteration from a layer ---------------------------------------------------------


class StopsIteration(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise StopIteration("injected stop in a layer")


STOP_CONFIG = RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH, execute_plan="2,2|2,1,1,1,1")
IN_FORWARD_STAGE = 1  # forward stage 0 holds layers 0-1
IN_FUSED_STAGE = 5  # the fused stage holds layers 4-5


def model_with_stop_at(wrap, position: int) -> RoundPipe:
    layers = list(mlp(depth=5))
    layers.insert(position, StopsIteration())
    model, _ = wrap(nn.Sequential(*layers), devices="emulated:3", model_run_config=STOP_CONFIG)
    return model


def infer(model: RoundPipe) -> torch.Tensor:
    with torch.no_grad():  # grad mode is per thread, so it is entered on the calling one
        return model(batch()[0])


@pytest.mark.parametrize(
    "position, run",
    [
        pytest.param(IN_FORWARD_STAGE, lambda model: train_call(model, 1), id="forward-stage"),
        pytest.param(IN_FUSED_STAGE, lambda model: train_call(model, 1), id="fused-stage"),
        pytest.param(IN_FORWARD_STAGE, infer, id="inference"),
    ],
)
def test_stop_iteration_in_a_layer_reaches_the_caller_as_itself(position, run, wrap, no_hang):
    model = model_with_stop_at(wrap, position)
    with pytest.raises(StopIteration) as caught:
        no_hang(run, model)
    message = str(caught.value)
    assert "injected stop in a layer" in message, message
    assert re.search(rf"\blayer {position}\b", message), f"layer {position} not named: {message}"
