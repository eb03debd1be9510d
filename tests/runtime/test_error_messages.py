"""What an error says: a fault inside the pipeline reaches the caller with its own type,
names where it happened, and surfaces at the next public call when it happened in the
background; sizes in messages carry a unit.

Each fault test arms one fault at one place the runtime runs user code or moves data: a
layer's forward (in a forward stage, the fused stage, a backward stage's recompute), a
layer's backward, the loss function, a host<->device transfer, the optimizer step. The
error must keep the original exception type (or chain it) and name the stage, layer and
microbatch (the step, for a step_fn). A layer raising ``StopIteration`` raises
``StopIteration`` with its own message, not ``RuntimeError: generator raised
StopIteration``.

The model and its plan are described in ``support/faults.py``. Whether the gradients of
a failed call are kept, and that the model trains like PyTorch after each of these
faults, is tested in ``test_failed_call_gradients.py`` and
``test_failed_step_gradients.py``; close and threads after a failure in
``test_close_and_exit.py``.
"""

from __future__ import annotations

import re

import pytest
import torch
from support.faults import (
    CONFIG,
    IN_FORWARD_AND_BACKWARD_STAGE,
    IN_FUSED_STAGE,
    fail_transfer,
    failing_loss,
    failing_step,
    infer,
    oversized_batch,
    run_failed_async_step,
    train_call,
)
from support.oracle import mlp, mse_sum
from torch import nn

from roundpipe import EmulatedDevicePool, EmulatedOptions, RoundPipe
from roundpipe.errors import format_bytes


def assert_reports(error: BaseException, kind: type[BaseException], *where: str) -> None:
    """``error`` is (or chains) a ``kind`` and its message matches every regex in ``where``."""
    assert isinstance(error, kind) or isinstance(error.__cause__, kind), (
        f"{error!r} neither is nor chains a {kind.__name__}"
    )
    message = str(error)
    for pattern in where:
        assert re.search(pattern, message), f"{pattern!r} not found in {message!r}"


# -- a layer's forward ---------------------------------------------------------------------


def test_forward_stage_layer_error_names_stage_layer_and_microbatch(faulty, error_of):
    model, _, switch = faulty(IN_FORWARD_AND_BACKWARD_STAGE)
    switch.arm("forward", at=1)
    error = error_of(train_call, model)
    assert_reports(
        error, ValueError, "injected fault", r"forward stage 1\b", r"\blayer 2\b", r"microbatch 1\b"
    )


def test_fused_stage_layer_error_names_stage_layer_and_microbatch(faulty, error_of):
    model, _, switch = faulty(IN_FUSED_STAGE)
    switch.arm("grad forward", at=2)
    error = error_of(train_call, model)
    assert_reports(
        error, ValueError, "injected fault", r"fused stage 0\b", r"\blayer 4\b", r"microbatch 2\b"
    )


def test_inference_layer_error_names_stage_layer_and_microbatch(faulty, error_of):
    model, _, switch = faulty(IN_FUSED_STAGE)
    switch.arm("forward", at=3)
    error = error_of(infer, model)
    assert_reports(
        error, ValueError, "injected fault", r"\bstage\b", r"\blayer 4\b", r"microbatch 3\b"
    )


def test_backward_stage_recompute_error_names_stage_layer_and_microbatch(faulty, no_hang, error_of):
    model, _, switch = faulty(IN_FORWARD_AND_BACKWARD_STAGE)
    switch.arm("grad forward", at=2)
    no_hang(train_call, model)
    error = error_of(model.step, lambda: None, is_async=False)
    assert_reports(
        error,
        ValueError,
        "injected fault",
        r"backward stage 2\b",
        r"\blayer 2\b",
        r"microbatch 2\b",
    )


def test_backward_stage_error_reaches_caller_at_synchronize(faulty, no_hang, error_of):
    model, _, switch = faulty(IN_FORWARD_AND_BACKWARD_STAGE)
    switch.arm("grad forward", at=2)
    no_hang(train_call, model)
    error = error_of(model.synchronize)
    assert_reports(error, ValueError, "injected fault", r"backward stage 2\b")


# -- a layer's backward --------------------------------------------------------------------


def test_backward_stage_backward_error_names_stage_layers_and_microbatch(faulty, no_hang, error_of):
    model, _, switch = faulty(IN_FORWARD_AND_BACKWARD_STAGE)
    switch.arm("backward", at=1)
    no_hang(train_call, model)
    error = error_of(model.step, lambda: None, is_async=False)
    assert_reports(
        error,
        ValueError,
        "injected fault in backward",
        r"backward stage 2 \(layers 2-2\)",
        r"microbatch 1\b",
    )


def test_layer_grain_backward_error_names_the_layer(faulty, no_hang, error_of):
    config = CONFIG.replace(execute_plan="2,2|2,2,2", recompute_grain="layer")
    model, _, switch = faulty(IN_FORWARD_AND_BACKWARD_STAGE, config)  # backward stage: 2-3
    switch.arm("backward", at=0)
    no_hang(train_call, model)
    error = error_of(model.step, lambda: None, is_async=False)
    assert_reports(error, ValueError, "injected fault in backward", r"\blayer 2\b")


def test_fused_stage_backward_error_names_stage_layers_and_microbatch(faulty, error_of):
    model, _, switch = faulty(IN_FUSED_STAGE)
    switch.arm("backward", at=1)
    error = error_of(train_call, model)
    assert_reports(
        error,
        ValueError,
        "injected fault in backward",
        r"fused stage 0 \(layers 4-5\)",
        r"microbatch 1\b",
    )


# -- the loss function ---------------------------------------------------------------------


def test_loss_fn_error_keeps_its_type_and_names_the_microbatch(faulty, error_of):
    model, _, _ = faulty(IN_FUSED_STAGE)
    error = error_of(train_call, model, loss_fn=failing_loss(at=2))
    assert_reports(error, KeyError, "injected fault in loss_fn", "loss_fn", r"microbatch 2\b")


def test_loss_fn_error_names_the_fused_stage(faulty, error_of):
    model, _, _ = faulty(IN_FUSED_STAGE)
    error = error_of(train_call, model, loss_fn=failing_loss(at=2))
    assert_reports(error, KeyError, r"fused stage 0\b")


def test_located_error_chains_the_original_exception(faulty, error_of):
    model, _, _ = faulty(IN_FUSED_STAGE)
    error = error_of(train_call, model, loss_fn=failing_loss(at=0))
    assert isinstance(error.__cause__, KeyError)
    assert "injected fault in loss_fn" in str(error.__cause__)


# -- transfers -----------------------------------------------------------------------------


def test_weight_upload_over_capacity_raises_oom_naming_stage_and_remedy(faulty, error_of):
    # The first stage's Linear(8, 16) holds 576 bytes of weights.
    model, _, _ = faulty(IN_FUSED_STAGE, emulated_options=EmulatedOptions(capacity_bytes=512))
    error = error_of(train_call, model)
    assert_reports(
        error,
        torch.OutOfMemoryError,
        "out of memory",
        r"forward stage 0\b",
        "weight upload",
        "num_microbatch",
    )


def test_activation_upload_over_capacity_raises_oom_naming_stage_and_microbatch(faulty, error_of):
    model, _, _ = faulty(IN_FUSED_STAGE, emulated_options=EmulatedOptions(capacity_bytes=16384))
    x, y = oversized_batch()
    error = error_of(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
    assert_reports(
        error, torch.OutOfMemoryError, "out of memory", r"forward stage 0\b", r"microbatch 0\b"
    )


def test_failed_activation_upload_names_stage_and_microbatch(faulty, error_of, monkeypatch):
    model, _, _ = faulty(IN_FUSED_STAGE)
    # Device 0 runs forward stage 0 first; it uploads one input tensor per microbatch.
    fail_transfer(monkeypatch, model.pool.devices[0], "copy_in", "act_upload", at=2)
    error = error_of(train_call, model)
    assert_reports(
        error,
        OSError,
        "injected fault in copy_in",
        r"forward stage 0\b",
        "upload",
        r"microbatch 2\b",
    )


def test_failed_weight_upload_names_stage_and_device(faulty, error_of, monkeypatch):
    model, _, _ = faulty(IN_FUSED_STAGE)
    fail_transfer(monkeypatch, model.pool.devices[1], "copy_in_all", "weight_upload", at=0)
    error = error_of(train_call, model)
    assert_reports(
        error,
        OSError,
        "injected fault in copy_in_all",
        r"forward stage 1\b",
        "weight upload",
        "emulated:1",
    )


def test_failed_download_names_stage_and_microbatch(faulty, error_of, monkeypatch):
    model, _, _ = faulty(IN_FUSED_STAGE)
    fail_transfer(monkeypatch, model.pool.devices[0], "to_host", "download", at=0)
    error = error_of(train_call, model)
    assert_reports(
        error,
        OSError,
        "injected fault in to_host",
        r"forward stage 0\b",
        "download",
        r"microbatch 0\b",
    )


# -- the optimizer step --------------------------------------------------------------------


def test_failing_synchronous_step_raises_naming_the_step(faulty, no_hang, error_of):
    model, _, _ = faulty(IN_FUSED_STAGE)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    no_hang(train_call, model)
    error = error_of(model.step, failing_step(optimizer), is_async=False)
    assert_reports(error, ArithmeticError, "injected fault in step_fn", "optimizer step 1")


def test_failing_async_step_surfaces_at_next_forward_backward(faulty, no_hang, error_of):
    model, _, _ = faulty(IN_FUSED_STAGE)
    run_failed_async_step(model, no_hang)
    error = error_of(train_call, model)
    assert_reports(error, ArithmeticError, "injected fault in step_fn", "optimizer step 1")


def test_failing_async_step_surfaces_at_next_step(faulty, no_hang, error_of):
    model, _, _ = faulty(IN_FUSED_STAGE)
    run_failed_async_step(model, no_hang)
    error = error_of(model.step, lambda: None)
    assert_reports(error, ArithmeticError, "injected fault in step_fn", "optimizer step 1")


def test_failing_async_step_surfaces_at_synchronize(faulty, no_hang, error_of):
    model, _, _ = faulty(IN_FUSED_STAGE)
    run_failed_async_step(model, no_hang)
    error = error_of(model.synchronize)
    assert_reports(error, ArithmeticError, "injected fault in step_fn", "optimizer step 1")


# -- StopIteration from a layer ------------------------------------------------------------


class StopsIteration(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise StopIteration("injected stop in a layer")


STOP_IN_FORWARD_STAGE = 1  # forward stage 0 holds layers 0-1
STOP_IN_FUSED_STAGE = 5  # the fused stage holds layers 4-5


def model_with_stop_at(wrap, position: int) -> RoundPipe:
    layers = list(mlp(depth=5))
    layers.insert(position, StopsIteration())
    model, _ = wrap(nn.Sequential(*layers), devices="emulated:3", model_run_config=CONFIG)
    return model


@pytest.mark.parametrize(
    "position, run",
    [
        pytest.param(STOP_IN_FORWARD_STAGE, lambda model: train_call(model, 1), id="forward-stage"),
        pytest.param(STOP_IN_FUSED_STAGE, lambda model: train_call(model, 1), id="fused-stage"),
        pytest.param(STOP_IN_FORWARD_STAGE, infer, id="inference"),
    ],
)
def test_stop_iteration_in_a_layer_reaches_the_caller_as_itself(position, run, wrap, no_hang):
    model = model_with_stop_at(wrap, position)
    with pytest.raises(StopIteration) as caught:
        no_hang(run, model)
    message = str(caught.value)
    assert "injected stop in a layer" in message, message
    assert re.search(rf"\blayer {position}\b", message), f"layer {position} not named: {message}"


# -- sizes in messages ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "nbytes, text",
    [
        (0, "0 B"),
        (576, "576 B"),
        (1023, "1023 B"),
        (1536, "1.50 KiB"),
        (20_000, "19.5 KiB"),
        (123_456_789, "118 MiB"),
        (3 * 2**30, "3.00 GiB"),
        (80 * 2**40, "80.0 TiB"),
    ],
)
def test_byte_sizes_are_written_with_a_unit_and_three_significant_digits(nbytes, text):
    assert format_bytes(nbytes) == text


def test_an_out_of_memory_message_shows_small_sizes_in_bytes():
    pool = EmulatedDevicePool(1, EmulatedOptions(capacity_bytes=512))
    try:
        with pytest.raises(torch.OutOfMemoryError) as caught:
            pool.devices[0].empty_like(torch.zeros(200))
    finally:
        pool.close()
    message = str(caught.value)
    assert "allocating 800 B" in message and "capacity of 512 B" in message
    assert "0.00 MiB" not in message
