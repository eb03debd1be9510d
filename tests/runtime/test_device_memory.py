"""Device memory bound: at most ``prefetch_stages`` + 1 stages of weights, one stage of
gradients (plus the fresh gradient of one layer before it is accumulated) and the
working microbatches, counted when the host allocates (the emulator takes memory at
issue time, as CUDA's caching allocator does, so a host that runs ahead fails here)
and, for what the layers compute, from each tensor's creation until it dies."""

from __future__ import annotations

import re

import pytest
import torch
from support.device_memory import drained
from support.oracle import mse_sum
from torch import nn

from roundpipe import EmulatedOptions, RoundPipe, RoundPipeRunConfig

WIDTH = 128
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4
PLAN = "2,2,2|2,2,2,2"  # every stage holds two layers
STAGE_BYTES = 2 * LAYER_BYTES


def wide_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(8)])


MICROBATCH_BYTES = 2 * WIDTH * 4  # one microbatch's activation (or its gradient)
# activations, gradients and labels being uploaded, and what autograd saves
WORKING = 16 * MICROBATCH_BYTES
GRADIENTS = STAGE_BYTES + LAYER_BYTES  # a stage's accumulated gradients + one fresh one


def bound(prefetch_stages: int) -> int:
    return (prefetch_stages + 1) * STAGE_BYTES + GRADIENTS + WORKING


def train(capacity=None, calls=2, prefetch_stages=1):
    config = RoundPipeRunConfig(
        num_microbatch=5, execute_plan=PLAN, prefetch_stages=prefetch_stages
    )
    options = EmulatedOptions(capacity_bytes=capacity, count_compute_memory=True)
    x, y = torch.randn(10, WIDTH), torch.randn(10, WIDTH)
    with RoundPipe(
        wide_model(), devices="emulated:4", model_run_config=config, emulated_options=options
    ) as wrapped:
        for _ in range(calls):
            wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        return [(d.max_memory_allocated(), drained(d)) for d in wrapped.pool]


@pytest.mark.parametrize("prefetch_stages", [1, 2])
def test_a_device_holds_at_most_prefetch_plus_one_stages_plus_working_microbatches(
    prefetch_stages,
):
    devices = train(calls=3, prefetch_stages=prefetch_stages)
    for peak, now in devices:
        assert peak <= bound(prefetch_stages)
        assert now == 0  # nothing leaks once the pipeline drained
    # really uploaded and counted: some device held all the stages it may (a host slowed
    # by a loaded machine may never get that far ahead on every device)
    assert max(peak for peak, _ in devices) >= (prefetch_stages + 1) * STAGE_BYTES


@pytest.mark.parametrize("prefetch_stages", [1, 2])
def test_training_fits_a_capacity_just_above_the_bound(prefetch_stages):
    capacity = bound(prefetch_stages)
    for _ in range(3):  # the host's run-ahead varies from run to run
        train(capacity=capacity, calls=3, prefetch_stages=prefetch_stages)


def test_a_capacity_just_below_two_stages_raises_out_of_memory_naming_the_stage():
    # device 0 prefetches its second stage while its first one still computes
    with pytest.raises(torch.OutOfMemoryError) as info:
        train(capacity=2 * STAGE_BYTES - 1)
    assert re.search(r"(forward|fused|backward) stage \d+ \(layers \d+-\d+\)", str(info.value))


def test_an_over_budget_stage_raises_out_of_memory_naming_the_stage():
    with pytest.raises(torch.OutOfMemoryError) as info:
        train(capacity=STAGE_BYTES // 2)
    message = str(info.value)
    assert re.search(r"(forward|fused|backward) stage \d+ \(layers \d+-\d+\)", message)
    assert "Try more microbatches" in message


def test_the_automatic_plan_fits_a_pool_of_unequal_devices():
    layer = 2 * LAYER_BYTES  # weights + gradients of one layer in a backward stage
    capacities = (int(5 * layer), int(2.2 * layer), int(5 * layer), int(5 * layer))
    # The planner's memory model counts each stage's weights and gradients, not the
    # fresh gradient of a layer before it is accumulated, nor a free still waiting for
    # its stream: weights and transfers only here (the planner issue will count them).
    options = EmulatedOptions(capacity_bytes=capacities, count_compute_memory=False)
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    with RoundPipe(wide_model(), devices="emulated:4", emulated_options=options) as wrapped:
        for _ in range(2):
            wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        peaks = [d.max_memory_allocated() for d in wrapped.pool]
    assert all(peak <= cap for peak, cap in zip(peaks, capacities, strict=True))
    # a plan sized for the big devices does not fit the small one: its last backward
    # stage (layers 0-2: weights and gradients of 3 layers, 3 units of `layer` where the
    # small device holds 2.2) is device 1's job in round-robin order, whatever the timing
    config = RoundPipeRunConfig(execute_plan="2,2,2|2,3,3")
    with (
        pytest.raises(torch.OutOfMemoryError, match="emulated device 1"),
        RoundPipe(
            wide_model(), devices="emulated:4", model_run_config=config, emulated_options=options
        ) as wrapped,
    ):
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)


def test_device_memory_reports_each_devices_allocated_and_peak_bytes():
    config = RoundPipeRunConfig(num_microbatch=5, execute_plan=PLAN)
    options = EmulatedOptions(count_compute_memory=True)
    x, y = torch.randn(10, WIDTH), torch.randn(10, WIDTH)
    with RoundPipe(
        wide_model(), devices="emulated:4", model_run_config=config, emulated_options=options
    ) as wrapped:
        before = wrapped.device_memory()
        assert [row["device"] for row in before] == [f"emulated:{i}" for i in range(4)]
        assert all(row["allocated"] == row["peak"] == 0 for row in before)
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        for device in wrapped.pool:
            drained(device)
        rows = wrapped.device_memory()
        keys = {"device", "allocated", "peak", "reserved", "peak_reserved", "alloc_retries"}
        assert [set(row) for row in rows] == [keys] * 4
        for row, device in zip(rows, wrapped.pool, strict=True):
            assert row["peak"] == device.max_memory_allocated()
            assert row["allocated"] == device.memory_allocated() == 0
            # no caching allocator: it reserves what its tensors hold, never retries
            assert (row["reserved"], row["peak_reserved"]) == (row["allocated"], row["peak"])
            assert row["alloc_retries"] == 0
            # two stages' weights were on every device at once (a stage and its prefetch)
            assert 2 * STAGE_BYTES <= row["peak"] <= bound(1)
        wrapped.reset_peak_memory()
        assert all(row["peak"] == row["allocated"] == 0 for row in wrapped.device_memory())
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        assert all(row["peak"] >= 2 * STAGE_BYTES for row in wrapped.device_memory())
