"""Emulated device memory: at most about two stages of weights plus the working microbatch."""

from __future__ import annotations

import re

import pytest
import torch
from oracle import mse_sum
from torch import nn

from roundpipe import EmulatedOptions, RoundPipe, RoundPipeRunConfig

WIDTH = 128
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4
PLAN = "2,2,2|2,2,2,2"  # every stage holds two layers
STAGE_BYTES = 2 * LAYER_BYTES


def wide_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(8)])


def train(capacity=None, calls=2):
    config = RoundPipeRunConfig(num_microbatch=5, execute_plan=PLAN)
    options = EmulatedOptions(capacity_bytes=capacity)
    x, y = torch.randn(10, WIDTH), torch.randn(10, WIDTH)
    with RoundPipe(
        wide_model(), devices="emulated:4", model_run_config=config, emulated_options=options
    ) as wrapped:
        for _ in range(calls):
            wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        return [(d.max_memory_allocated(), d.memory_allocated()) for d in wrapped.pool]


def test_a_device_holds_at_most_two_stages_of_weights_plus_a_microbatch():
    microbatch_bytes = 2 * WIDTH * 4 * 2  # input and incoming gradient of one microbatch
    for peak, now in train():
        assert peak <= 2 * STAGE_BYTES + 8 * microbatch_bytes  # a few microbatches in flight
        assert peak >= STAGE_BYTES  # something was really uploaded and counted
        assert now == 0  # nothing leaks once the pipeline drained


def test_training_fits_in_a_budget_of_two_stages_and_some_slack():
    train(capacity=int(2.2 * STAGE_BYTES), calls=3)


def test_an_over_budget_stage_raises_out_of_memory_naming_the_stage():
    with pytest.raises(torch.OutOfMemoryError) as info:
        train(capacity=STAGE_BYTES // 2)
    message = str(info.value)
    assert re.search(r"(forward|fused|backward) stage \d+ \(layers \d+-\d+\)", message)
    assert "Try more microbatches" in message


def test_the_automatic_plan_fits_a_pool_of_unequal_devices():
    layer = 2 * LAYER_BYTES  # weights + gradients of one layer in a backward stage
    capacities = (int(5 * layer), int(2.2 * layer), int(5 * layer), int(5 * layer))
    options = EmulatedOptions(capacity_bytes=capacities)
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    with RoundPipe(wide_model(), devices="emulated:4", emulated_options=options) as wrapped:
        for _ in range(2):
            wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        peaks = [d.max_memory_allocated() for d in wrapped.pool]
    assert all(peak <= cap for peak, cap in zip(peaks, capacities, strict=True))
    # a plan sized for the big devices does not fit the small one
    config = RoundPipeRunConfig(execute_plan="3,3|2,2,2,2")
    with (
        pytest.raises(torch.OutOfMemoryError, match="emulated device 1"),
        RoundPipe(
            wide_model(), devices="emulated:4", model_run_config=config, emulated_options=options
        ) as wrapped,
    ):
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
