"""Faults injected inside the pipeline reach the caller, say where, never hang, and heal.

Each test arms one fault at one place the runtime runs user code or moves data: a
layer's forward (in a forward stage, the fused stage, a backward stage's
recompute), a layer's backward, the loss function, a host<->device transfer, the
optimizer step. The error must keep the original exception type (or chain it),
name the stage, layer and microbatch, and leave the model trainable: the next call
must match plain PyTorch exactly.

The model has six layers on three emulated devices, four microbatches, and the plan
``2,2|2,1,1,1,1``: forward stages 0 (layers 0-1) and 1 (layers 2-3), the fused
stage 0 (layers 4-5), then backward stages 1..4 (layers 3, 2, 1, 0).
"""

from __future__ import annotations

import copy
import re
import threading
import time

import pytest
import torch
from oracle import assert_grads_close, batch, mlp, mse_sum, reference_loss_and_grads
from torch import nn

from roundpipe import EmulatedOptions, RoundPipe, RoundPipeRunConfig

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
    stage or a backward stage's recompute), ``"backward"``.
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


@pytest.fixture
def faulty(wrap):
    """``faulty(position, config=CONFIG, **options)`` -> (model, reference, switch)."""

    def build(position: int, config: RoundPipeRunConfig = CONFIG, **options):
        module, switch = faulty_sequential(position)
        model, reference = wrap(module, devices="emulated:3", model_run_config=config, **options)
        return model, reference, switch

    return build


def assert_reports(error: BaseException, kind: type[BaseException], *where: str) -> None:
    """``error`` is (or chains) a ``kind`` and its message matches every regex in ``where``."""
    assert isinstance(error, kind) or isinstance(error.__cause__, kind), (
        f"{error!r} neither is nor chains a {kind.__name__}"
    )
    message = str(error)
    for pattern in where:
        assert re.search(pattern, message), f"{pattern!r} not found in {message!r}"


def train_call(model: RoundPipe, loss_fn=mse_sum):
    x, y = batch()
    return model.forward_backward((x,), label=y, loss_fn=loss_fn)


def sgd_step(optimizer: torch.optim.Optimizer):
    return lambda: (optimizer.step(), optimizer.zero_grad())


# -- a layer's forward -----------------------------------------------------------------


def test_forward_stage_layer_error_names_stage_layer_and_microbatch(faulty, error_of):
    model, _, switch = faulty(IN_FORWARD_AND_BACKWARD_STAGE)
    switch.arm("forward", at=1)
    error = error_of(train_call, model)
    assert_reports(
        error, ValueError, "injected fault", r"forward stage 1\b", r"\blayer 2\b", r"microbatch 1\b"
    )


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


def test_fused_stage_layer_error_names_stage_layer_and_microbatch(faulty, error_of):
    model, _, switch = faulty(IN_FUSED_STAGE)
    switch.arm("grad forward", at=2)
    error = error_of(train_call, model)
    assert_reports(
        error, ValueError, "injected fault", r"fused stage 0\b", r"\blayer 4\b", r"microbatch 2\b"
    )


def infer(model: RoundPipe) -> torch.Tensor:
    with torch.no_grad():  # grad mode is per thread, so it is entered on the calling one
        return model(batch()[0])


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


def test_model_trains_like_pytorch_after_backward_stage_error(
    faulty, no_hang, error_of, trains_like_pytorch
):
    model, reference, switch = faulty(IN_FORWARD_AND_BACKWARD_STAGE)
    switch.arm("grad forward", at=2)
    no_hang(train_call, model)
    error_of(model.step, lambda: None, is_async=False)
    trains_like_pytorch(model, reference)


# -- a layer's backward ------------------------------------------------------------------


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


# -- the loss function ----------------------------------------------------------------


def failing_loss(at: int):
    """A loss function that raises KeyError on its ``at``-th call (0-based)."""
    calls = []

    def loss_fn(output, label):
        calls.append(None)
        if len(calls) - 1 == at:
            raise KeyError("injected fault in loss_fn")
        return mse_sum(output, label)

    return loss_fn


def test_loss_fn_error_keeps_its_type_and_names_the_microbatch(faulty, error_of):
    model, _, _ = faulty(IN_FUSED_STAGE)
    error = error_of(train_call, model, loss_fn=failing_loss(at=2))
    assert_reports(error, KeyError, "injected fault in loss_fn", "loss_fn", r"microbatch 2\b")


def test_loss_fn_error_names_the_fused_stage(faulty, error_of):
    model, _, _ = faulty(IN_FUSED_STAGE)
    error = error_of(train_call, model, loss_fn=failing_loss(at=2))
    assert_reports(error, KeyError, r"fused stage 0\b")


def test_model_trains_like_pytorch_after_loss_fn_error(faulty, error_of, trains_like_pytorch):
    model, reference, _ = faulty(IN_FUSED_STAGE)
    error_of(train_call, model, loss_fn=failing_loss(at=2))
    trains_like_pytorch(model, reference)


def test_located_error_chains_the_original_exception(faulty, error_of):
    model, _, _ = faulty(IN_FUSED_STAGE)
    error = error_of(train_call, model, loss_fn=failing_loss(at=0))
    assert isinstance(error.__cause__, KeyError)
    assert "injected fault in loss_fn" in str(error.__cause__)


# -- transfers ---------------------------------------------------------------------------


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


def oversized_batch():
    """A batch whose microbatch inputs (600 x 8 floats = 19,200 bytes) exceed 16 KiB."""
    generator = torch.Generator().manual_seed(3)
    size = 600 * NUM_MICROBATCH
    return torch.randn(size, 8, generator=generator), torch.randn(size, 4, generator=generator)


def test_activation_upload_over_capacity_raises_oom_naming_stage_and_microbatch(faulty, error_of):
    model, _, _ = faulty(IN_FUSED_STAGE, emulated_options=EmulatedOptions(capacity_bytes=16384))
    x, y = oversized_batch()
    error = error_of(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
    assert_reports(
        error, torch.OutOfMemoryError, "out of memory", r"forward stage 0\b", r"microbatch 0\b"
    )


def test_model_trains_like_pytorch_after_oom_with_a_smaller_batch(
    faulty, error_of, trains_like_pytorch
):
    model, reference, _ = faulty(
        IN_FUSED_STAGE, emulated_options=EmulatedOptions(capacity_bytes=16384)
    )
    x, y = oversized_batch()
    error_of(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
    trains_like_pytorch(model, reference)


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


def test_model_trains_like_pytorch_after_failed_transfer(
    faulty, error_of, monkeypatch, trains_like_pytorch
):
    model, reference, _ = faulty(IN_FUSED_STAGE)
    fail_transfer(monkeypatch, model.pool.devices[0], "copy_in", "act_upload", at=2)
    error_of(train_call, model)
    trains_like_pytorch(model, reference)


# -- the optimizer step ------------------------------------------------------------------


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


def test_failing_synchronous_step_raises_naming_the_step(faulty, no_hang, error_of):
    model, _, _ = faulty(IN_FUSED_STAGE)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    no_hang(train_call, model)
    error = error_of(model.step, failing_step(optimizer), is_async=False)
    assert_reports(error, ArithmeticError, "injected fault in step_fn", "optimizer step 1")


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


def test_model_trains_like_pytorch_after_failing_async_step(
    faulty, no_hang, error_of, trains_like_pytorch
):
    model, reference, _ = faulty(IN_FUSED_STAGE)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    run_failed_async_step(model, no_hang)
    error_of(train_call, model)  # reports the step's failure; this call does not run
    no_hang(model.step, sgd_step(optimizer), is_async=False)  # applies the kept gradients
    trains_like_pytorch(model, sgd_applied(reference, times=2))


# -- lifetime and several models --------------------------------------------------------


def new_threads(before: set[threading.Thread]) -> list[str]:
    return [t.name for t in threading.enumerate() if t not in before and t.is_alive()]


def test_close_stops_every_thread_the_model_started(no_hang):
    before = set(threading.enumerate())
    model = RoundPipe(mlp(depth=6), devices="emulated:3", model_run_config=CONFIG)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    no_hang(train_call, model)
    model.step(sgd_step(optimizer))
    assert new_threads(before), "training started no thread; the check below would be vacuous"
    no_hang(model.close)
    assert new_threads(before) == []


def test_close_after_a_failed_call_stops_every_thread(no_hang, error_of):
    before = set(threading.enumerate())
    module, switch = faulty_sequential(IN_FUSED_STAGE)
    model = RoundPipe(module, devices="emulated:3", model_run_config=CONFIG)
    switch.arm("grad forward", at=1)
    error_of(train_call, model)
    no_hang(model.close)
    assert new_threads(before) == []


def test_models_in_one_process_train_independently(wrap, no_hang):
    first, first_reference = wrap(
        mlp(seed=1, depth=6), devices="emulated:3", model_run_config=CONFIG
    )
    second, second_reference = wrap(
        mlp(seed=2, depth=4),
        devices="emulated:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=3),
    )
    x, y = batch()
    first_loss = no_hang(first.forward_backward, (x,), label=y, loss_fn=mse_sum)
    second_loss = no_hang(second.forward_backward, (x,), label=y, loss_fn=mse_sum)
    no_hang(second.synchronize)
    no_hang(first.synchronize)
    for model, reference, loss, num in (
        (first, first_reference, first_loss, NUM_MICROBATCH),
        (second, second_reference, second_loss, 3),
    ):
        torch.testing.assert_close(loss, reference_loss_and_grads(reference, x, y, num))
        assert_grads_close(model.model, reference)


def test_failure_in_one_model_leaves_another_unaffected(faulty, wrap, no_hang, error_of):
    healthy, reference = wrap(
        mlp(seed=1, depth=6),
        devices="emulated:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=3),
    )
    broken, _, switch = faulty(IN_FUSED_STAGE)
    switch.arm("grad forward", at=1)
    x, y = batch()
    loss = no_hang(healthy.forward_backward, (x,), label=y, loss_fn=mse_sum)
    error_of(train_call, broken)  # fails while the healthy model's backward may still run
    no_hang(healthy.synchronize)
    torch.testing.assert_close(loss, reference_loss_and_grads(reference, x, y, 3))
    assert_grads_close(healthy.model, reference)


def test_close_reports_a_background_failure_nobody_has_seen_yet(faulty):
    model, _, switch = faulty(IN_FORWARD_AND_BACKWARD_STAGE)
    switch.arm("backward", at=0)
    model.forward_backward((batch()[0],), label=batch()[1], loss_fn=mse_sum)
    with pytest.raises(ValueError, match="injected fault"):
        model.close()
