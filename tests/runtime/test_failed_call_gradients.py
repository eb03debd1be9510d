"""A failed call's gradients: discarded if it accumulated any, wherever its error surfaces.

- A failed CALL never has its gradients reach a step. If it accumulated any gradient,
  every gradient accumulated since the last step before it is discarded, the exception
  carries a note saying so, and a queued step whose calls include it is skipped (weights
  unchanged). This holds whether the error surfaces at the next ``forward_backward``,
  ``step``, ``synchronize`` or ``close``; and after a fault at any site (a layer's
  forward, recompute or backward, the loss function, out of memory, a transfer) the
  next call trains like plain PyTorch.
- A failed call that accumulated nothing (a shape or dtype error in layer 0's forward)
  keeps the gradients of the good calls before it.

Every "after the failure" check trains one more call and compares with plain PyTorch.
A failing ``step_fn`` keeps the gradients: ``test_failed_step_gradients.py``. What the
errors say is tested in ``test_error_messages.py``.
"""

from __future__ import annotations

import copy
import re
import threading
import time
from collections.abc import Callable

import pytest
import torch
from support.faults import (
    IN_FORWARD_AND_BACKWARD_STAGE,
    IN_FUSED_STAGE,
    FaultyLayer,
    fail_transfer,
    failing_loss,
    oversized_batch,
    sgd_step,
    train_call,
)
from support.oracle import (
    assert_weights_close,
    batch,
    mlp,
    mse_sum,
    pytorch_sgd_steps,
    reference_loss_and_grads,
)
from torch import nn

from roundpipe import EmulatedOptions, RoundPipe, RoundPipeRunConfig

NUM_MICROBATCH = 4
LR = 0.1
SETTLE_S = 0.5  # time for a background failure to finish before the next public call


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def pytorch_sgd(reference: nn.Module, steps: list[list[int]]) -> nn.Module:
    """PyTorch: one SGD step per entry of ``steps``, over the summed gradients of its batches."""
    return pytorch_sgd_steps(reference, steps, NUM_MICROBATCH, LR)


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


# -- a fault in a background backward stage -------------------------------------------


class BackwardFault:
    """Armed: the next backward of the faulty layer waits for ``release``, then raises.

    A switch for ``support.faults.FaultyLayer``: it fires in the ``"backward"`` phase only.
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


# -- a fault at each site: the next call trains like PyTorch --------------------------


@pytest.mark.parametrize(
    "position, phase, at",
    [(IN_FORWARD_AND_BACKWARD_STAGE, "forward", 1), (IN_FUSED_STAGE, "grad forward", 2)],
    ids=["forward-stage", "fused-stage"],
)
def test_model_trains_like_pytorch_after_a_layer_error(
    position, phase, at, faulty, error_of, trains_like_pytorch
):
    model, reference, switch = faulty(position)
    switch.arm(phase, at=at)
    error_of(train_call, model)
    trains_like_pytorch(model, reference)


def test_model_trains_like_pytorch_after_backward_stage_error(
    faulty, no_hang, error_of, trains_like_pytorch
):
    model, reference, switch = faulty(IN_FORWARD_AND_BACKWARD_STAGE)
    switch.arm("grad forward", at=2)
    no_hang(train_call, model)
    error_of(model.step, lambda: None, is_async=False)
    trains_like_pytorch(model, reference)


def test_model_trains_like_pytorch_after_loss_fn_error(faulty, error_of, trains_like_pytorch):
    model, reference, _ = faulty(IN_FUSED_STAGE)
    error_of(train_call, model, loss_fn=failing_loss(at=2))
    trains_like_pytorch(model, reference)


def test_model_trains_like_pytorch_after_oom_with_a_smaller_batch(
    faulty, error_of, trains_like_pytorch
):
    model, reference, _ = faulty(
        IN_FUSED_STAGE, emulated_options=EmulatedOptions(capacity_bytes=16384)
    )
    x, y = oversized_batch()
    error_of(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
    trains_like_pytorch(model, reference)


def test_model_trains_like_pytorch_after_failed_transfer(
    faulty, error_of, monkeypatch, trains_like_pytorch
):
    model, reference, _ = faulty(IN_FUSED_STAGE)
    fail_transfer(monkeypatch, model.pool.devices[0], "copy_in", "act_upload", at=2)
    error_of(train_call, model)
    trains_like_pytorch(model, reference)


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


BAD_INPUT_CONFIG = RoundPipeRunConfig(num_microbatch=3, execute_plan="2,2|2,1,1,1,1")


@pytest.mark.parametrize(
    "bad_input",
    [lambda x: x.double(), lambda x: x[:, :5]],
    ids=["wrong-dtype", "wrong-shape"],
)
def test_a_bad_input_to_layer_zero_keeps_the_gradients_of_earlier_calls(bad_input, wrap, no_hang):
    model, reference = wrap(mlp(), devices="emulated:3", model_run_config=BAD_INPUT_CONFIG)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    good = [batch(seed=1), batch(seed=2)]
    no_hang(model.forward_backward, (good[0][0],), label=good[0][1], loss_fn=mse_sum)
    with pytest.raises(RuntimeError):  # Linear(8, 16) refuses the input
        no_hang(model.forward_backward, (bad_input(good[0][0]),), label=good[0][1], loss_fn=mse_sum)
    no_hang(model.forward_backward, (good[1][0],), label=good[1][1], loss_fn=mse_sum)
    no_hang(model.step, sgd_step(optimizer), is_async=False)
    no_hang(model.synchronize)

    expected = copy.deepcopy(reference)
    for x, y in good:
        reference_loss_and_grads(expected, x, y, BAD_INPUT_CONFIG.num_microbatch)
    torch.optim.SGD(expected.parameters(), lr=0.1).step()
    assert_weights_close(model.model, expected)
