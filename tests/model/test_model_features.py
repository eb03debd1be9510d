"""Layer features PyTorch models use train exactly as in PyTorch: dropout under recompute
(and in a plain forward), a weight tied across stages, BatchNorm buffers, and layers
passing dicts, tuples and non-tensors.

Frozen parameters and master weights: ``test_master_weights.py``; ``model(x)`` and a
backward through it: ``test_plain_forward.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.dropout_models import ReplayDropout, collect_logs, dropout_model
from support.oracle import (
    assert_grads_close,
    batch,
    mse_sum,
    reference_loss_and_grads,
    weighted_microbatches,
)
from support.pipes import pipe_on
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig


def run_dropout(devices, grain, preserve, shells_of):
    model = dropout_model()
    reference = copy.deepcopy(model)
    x, y = batch()
    config = RoundPipeRunConfig(
        num_microbatch=3, recompute_grain=grain, preserve_rng_state=preserve,
        execute_plan="2,2|3,1,1,1,1",
    )  # fmt: skip
    wrapped = RoundPipe(model, devices=f"emulated:{devices}", model_run_config=config)
    wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
    wrapped.synchronize()
    logs = shells_of(wrapped)
    wrapped.close()
    return model, reference, x, y, logs


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_recompute_draws_the_same_dropout_masks_as_the_forward(grain):
    *_, logs = run_dropout(3, grain, True, collect_logs)
    for _, log in logs:
        assert len(log["forward"]) == len(log["grad"]) == 3
        for drawn, redrawn in zip(log["forward"], log["grad"], strict=True):
            assert torch.equal(drawn, redrawn)


def test_without_rng_preservation_masks_differ():
    """Guards the test above: recompute really does redraw masks."""
    *_, logs = run_dropout(3, "stage", False, collect_logs)
    assert any(
        not torch.equal(a, b)
        for _, log in logs
        for a, b in zip(log["forward"], log["grad"], strict=False)
    )


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_dropout_gradients_are_the_gradients_of_the_computed_forward(grain):
    model, reference, x, y, logs = run_dropout(2, grain, True, collect_logs)
    for index, log in logs:
        reference[index] = ReplayDropout(log["forward"])
    reference_loss_and_grads(reference, x, y, 3)
    assert_grads_close(model, reference)


def test_backward_through_a_plain_forward_with_dropout_uses_the_forward_masks():
    model = dropout_model()
    reference = copy.deepcopy(model)
    x, y = batch()
    with pipe_on(model, devices=2, num_microbatch=3) as wrapped:
        mse_sum(wrapped(x), y).backward()
        wrapped.synchronize()
        logs = collect_logs(wrapped)
    for index, log in logs:
        assert all(torch.equal(a, b) for a, b in zip(log["forward"], log["grad"], strict=True))
        reference[index] = ReplayDropout(log["forward"])
    reference_loss_and_grads(reference, x, y, 3, scale_grads=False)  # the loss summed above
    assert_grads_close(model, reference)


class TiedEnds(nn.Module):
    """Embedding and output projection sharing one weight, on different stages."""

    def __init__(self, weight: nn.Parameter, first: bool) -> None:
        super().__init__()
        self.weight = weight
        self.first = first

    def forward(self, x):
        return x @ (self.weight if self.first else self.weight.t())


def tied_model():
    torch.manual_seed(0)
    shared = nn.Parameter(torch.randn(8, 16) * 0.3)
    return nn.Sequential(
        TiedEnds(shared, True), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), TiedEnds(shared, False)
    )


def test_a_weight_tied_across_stages_gets_the_summed_gradient():
    model = tied_model()
    reference = copy.deepcopy(model)
    x, _ = batch()
    y = torch.randn(13, 8)
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan="2,2|1,1,1,1,1")
    with RoundPipe(model, devices="emulated:3", model_run_config=config) as wrapped:
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        assert len(list(wrapped.optim_parameters())) == 3  # shared weight counted once
    reference_loss_and_grads(reference, x, y, 3)
    assert_grads_close(model, reference)


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


@pytest.mark.parametrize("plan", ["1,1|2,1,1", "3|1,1,1,1", "|4"])
def test_buffers_end_as_after_running_the_microbatches_in_order(plan):
    model = bn_model()
    reference = copy.deepcopy(model)
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan=plan)
    with RoundPipe(model, devices="emulated:2", model_run_config=config) as wrapped:
        for seed in (1, 2):
            x, y = batch(seed)
            wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
            reference_loss_and_grads(reference, x, y, 3)
        wrapped.synchronize()
        assert_grads_close(model, reference)
    bn, bn_ref = model[1], reference[1]
    torch.testing.assert_close(bn.running_mean, bn_ref.running_mean)
    torch.testing.assert_close(bn.running_var, bn_ref.running_var)
    assert bn.num_batches_tracked.item() == bn_ref.num_batches_tracked.item() == 6


class Splitter(nn.Module):
    """Returns a dict with a tensor, a non-tensor value and an integer tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x, scale=1.0):
        h = self.proj(x) * scale
        return {"hidden": h, "skip": h.tanh(), "tag": "mb", "ids": torch.arange(len(x))}


class Joiner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, state):
        assert state["tag"] == "mb" and state["ids"].dtype == torch.int64
        return (self.proj(state["hidden"]), state["skip"])


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 4)

    def forward(self, pair):
        hidden, skip = pair
        return self.proj(hidden + skip)


def rich_model():
    torch.manual_seed(0)
    return nn.Sequential(Splitter(), Joiner(), Head())


@pytest.mark.parametrize("plan", ["1,1|1,1,1", "2|1,2", "1|2,1"])
def test_layers_pass_dicts_tuples_and_non_tensors_with_gradients_across_stages(plan):
    model = rich_model()
    reference = copy.deepcopy(model)
    x, y = batch()
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan=plan)
    with RoundPipe(model, devices="emulated:3", model_run_config=config) as wrapped:
        loss = wrapped.forward_backward((x,), {"scale": 0.5}, label=y, loss_fn=mse_sum)
        wrapped.synchronize()
    total = torch.zeros(())
    for xm, ym, weight in weighted_microbatches(x, y, 3):
        out = reference[2](reference[1](reference[0](xm, scale=0.5)))
        step = mse_sum(out, ym) * weight
        step.backward()
        total += step.detach()
    torch.testing.assert_close(loss, total)
    assert_grads_close(model, reference)
