"""``forward_backward`` owns its inputs and labels from the moment it is called.

The caller may overwrite the tensors it passed as soon as the call returns (a data
loader reusing its buffer): the gradients must still be those of the original data.

The plan ``5|1,1,1,1,1,1`` puts layer 0 in a backward stage of its own, which recomputes
layer 0 from the call's input; the emulated backward kernels are slow, so that stage
still runs (and, without a copy, re-reads the caller's tensors) after the call returned.
Each test checks this precondition: layer 0's recompute started after the overwrite.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable

import pytest
import torch
from support.oracle import assert_grads_close, batch, mlp, mse_sum, reference_loss_and_grads
from torch import nn

from roundpipe import EmulatedOptions, OpInfo, RoundPipe, RoundPipeRunConfig

NUM_MICROBATCH = 4
CONFIG = RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH, execute_plan="5|1,1,1,1,1,1")
LAST_LAYER = 5
BACKWARD_S = 0.04


class SlowBackward:
    """Emulated kernel times: slow non-fused backward stages; notes when layer 0 recomputes."""

    def __init__(self) -> None:
        self.layer_0_recomputes: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, info: OpInfo) -> float:
        if info.kind == "recompute" and info.layers == (0,):
            with self._lock:
                self.layer_0_recomputes.append(time.perf_counter())
        if info.kind == "backward" and LAST_LAYER not in info.layers:
            return BACKWARD_S
        return 0.0

    def assert_recomputed_after(self, moment: float) -> None:
        assert self.layer_0_recomputes, "layer 0 was never recomputed; the plan did not apply"
        first = min(self.layer_0_recomputes)
        assert first > moment, (
            f"layer 0 was recomputed {moment - first:.3f} s before the overwrite: the test "
            "could not see a late read of the input"
        )


@pytest.fixture
def slow_pipe(wrap) -> Callable[[nn.Module], tuple[RoundPipe, nn.Module, SlowBackward]]:
    def build(module: nn.Module) -> tuple[RoundPipe, nn.Module, SlowBackward]:
        probe = SlowBackward()
        model, reference = wrap(
            module,
            devices="emulated:3",
            model_run_config=CONFIG,
            emulated_options=EmulatedOptions(kernel_time=probe),
        )
        return model, reference, probe

    return build


def overwrite(*tensors: torch.Tensor) -> float:
    """Overwrite the caller's tensors in place (with NaN); return when it happened."""
    for tensor in tensors:
        tensor.fill_(float("nan"))
    return time.perf_counter()


def test_overwriting_input_and_label_after_the_call_keeps_the_gradients(slow_pipe, no_hang):
    model, reference, probe = slow_pipe(mlp())
    x, y = batch()
    original_x, original_y = x.clone(), y.clone()
    loss = no_hang(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
    moment = overwrite(x, y)
    no_hang(model.synchronize)

    want = reference_loss_and_grads(reference, original_x, original_y, NUM_MICROBATCH)
    probe.assert_recomputed_after(moment)
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    assert_grads_close(model.model, reference)


def test_overwriting_outputs_call_inputs_keeps_outputs_and_gradients(slow_pipe, no_hang):
    model, reference, probe = slow_pipe(mlp())
    x, y = batch()
    original_x, original_y = x.clone(), y.clone()
    _, outputs = no_hang(
        model.forward_backward, (x,), label=y, loss_fn=mse_sum, return_outputs=True
    )
    moment = overwrite(x, y)
    no_hang(model.synchronize)

    reference_loss_and_grads(reference, original_x, original_y, NUM_MICROBATCH)
    with torch.no_grad():
        want = torch.cat([reference(xm) for xm in torch.tensor_split(original_x, NUM_MICROBATCH)])
    probe.assert_recomputed_after(moment)
    torch.testing.assert_close(outputs, want, atol=1e-5, rtol=1e-5)
    assert_grads_close(model.model, reference)


class KeywordInput(nn.Module):
    """Layer 0 called with keyword inputs: ``linear(input) * scale``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, **kwargs: torch.Tensor) -> torch.Tensor:
        return self.linear(kwargs["input"]) * kwargs["scale"]


def keyword_model() -> nn.Sequential:
    layers = list(mlp())
    return nn.Sequential(KeywordInput(layers[0]), *layers[1:])


def keyword_reference_grads(model: nn.Sequential, x, scale, y) -> torch.Tensor:
    total = torch.zeros(())
    pieces = [torch.tensor_split(t, NUM_MICROBATCH) for t in (x, scale, y)]
    for xm, sm, ym in zip(*pieces, strict=True):
        hidden = model[0](input=xm, scale=sm)
        loss = mse_sum(model[1:](hidden), ym) * xm.shape[0] / x.shape[0]  # its share of rows
        loss.backward()
        total = total + loss.detach()
    return total


def test_overwriting_keyword_inputs_after_the_call_keeps_the_gradients(slow_pipe, no_hang):
    model, reference, probe = slow_pipe(keyword_model())
    x, y = batch()
    scale = torch.linspace(0.5, 1.5, x.shape[0]).unsqueeze(1)
    originals = copy.deepcopy((x, scale, y))
    loss = no_hang(
        model.forward_backward,
        input_kwargs={"input": x, "scale": scale},
        label=y,
        loss_fn=mse_sum,
    )
    moment = overwrite(x, scale, y)
    no_hang(model.synchronize)

    want = keyword_reference_grads(reference, *originals)
    probe.assert_recomputed_after(moment)
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    assert_grads_close(model.model, reference)
