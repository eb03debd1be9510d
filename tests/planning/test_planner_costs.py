"""The automatic planner plans with the transfer costs the runtime pays: the profiler
measures the link from the transfers the runtime does, and the planner's cost model
charges weight uploads and activation hops at what was measured."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

from roundpipe import EmulatedOptions, RoundPipe, RoundPipeRunConfig
from roundpipe.core.plan import Plan
from roundpipe.planning.partition import auto_plan
from roundpipe.planning.planner import AutoPlanner, link_moved
from roundpipe.runtime.profiler import MIN_TIMED_BYTES, LayerProfiler

WIDTH, ROWS, MICROBATCHES = 256, 128, 4
H2D_GBPS, D2H_GBPS = 0.05, 0.025


def squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).sum()


def num_stages(plan: Plan) -> int:
    return len(plan.forward) + len(plan.backward)


def hand_fed_profiler(num_layers: int, hop_bytes: int, gbps: float = 10.0) -> LayerProfiler:
    """Layers of 1 ms forward and recompute, 2 ms backward; a link of ``gbps`` both ways."""
    profiler = LayerProfiler([1000] * num_layers, [2**20] * num_layers)
    for layer in range(num_layers):
        profiler.record("forward", [layer], 1e-3)
        profiler.record("recompute", [layer], 1e-3)
        profiler.record("backward", [layer], 2e-3)
    for link in ("h2d", "d2h"):
        profiler.record_transfer(link, 10 * 2**20, 10 * 2**20 / (gbps * 1e9))
    profiler.record_boundary(hop_bytes)
    return profiler


def test_the_profiler_measures_the_emulated_link_and_the_boundary_activation_size():
    options = EmulatedOptions(
        h2d_gbps=H2D_GBPS,
        d2h_gbps=D2H_GBPS,
        kernel_time=lambda info: 0.002 * len(info.layers),
    )
    config = RoundPipeRunConfig(num_microbatch=MICROBATCHES)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(6)])
    x = torch.randn(MICROBATCHES * ROWS, WIDTH)
    y = torch.randn(MICROBATCHES * ROWS, WIDTH)
    with RoundPipe(
        model, devices="emulated:2", emulated_options=options, model_run_config=config
    ) as pipe:
        for _ in range(4):
            pipe.forward_backward((x,), label=y, loss_fn=squared_error)
        pipe.synchronize()
        profiler = pipe.profiler
        assert profiler.bandwidth("h2d") == pytest.approx(H2D_GBPS * 1e9, rel=0.3)
        assert profiler.bandwidth("d2h") == pytest.approx(D2H_GBPS * 1e9, rel=0.3)
        assert profiler.boundary_bytes() == ROWS * WIDTH * 4  # one microbatch, fp32
        # what the memory fit counts per layer (the issuer does not say which layer's
        # input a download is, so every layer takes the largest seen)
        assert profiler.activation_bytes() == (ROWS * WIDTH * 4,) * 6
        planned_with = pipe.planner.costs
        assert planned_with is not None and planned_with.comm > 0
        assert planned_with.h2d_bandwidth < math.inf
        assert planned_with.weight_chunk_bytes == config.weight_chunk_bytes


def test_cost_model_charges_a_hop_its_download_and_its_upload():
    profiler = LayerProfiler([10, 10], [40, 40])
    profiler.record_transfer("h2d", 2**20, 2**20 / 4e9)
    profiler.record_transfer("d2h", 2**20, 2**20 / 2e9)
    profiler.record_boundary(1000)
    profiler.record_boundary(3000)
    model = profiler.cost_model(weight_chunk_bytes=4096)
    assert model.h2d_bandwidth == pytest.approx(4e9)
    assert model.d2h_bandwidth == pytest.approx(2e9)
    assert model.comm == pytest.approx(2000 / 2e9 + 2000 / 4e9)
    assert model.weight_chunk_bytes == 4096
    assert model.layers == profiler.costs()


def test_cost_model_charges_nothing_for_the_link_before_it_was_measured():
    profiler = LayerProfiler([10, 10], [40, 40])
    profiler.record_boundary(1000)
    model = profiler.cost_model(weight_chunk_bytes=None)
    assert model.h2d_bandwidth == model.d2h_bandwidth == math.inf
    assert model.comm == 0


def test_transfers_too_small_to_time_are_not_taken_for_bandwidth():
    profiler = LayerProfiler([10], [40])
    profiler.record_transfer("h2d", MIN_TIMED_BYTES - 1, 1e-6)
    assert profiler.bandwidth("h2d") == math.inf


def test_bandwidth_is_smoothed_like_compute_times():
    profiler = LayerProfiler([10], [40], smoothing=0.5)
    profiler.record_transfer("d2h", 2**20, 2**20 / 1e9)
    profiler.record_transfer("d2h", 2**20, 2**20 / 3e9)
    assert profiler.bandwidth("d2h") == pytest.approx(2e9)


def test_the_planner_uses_fewer_stages_when_activation_hops_are_expensive():
    # A hop (2.5 ms down and 2.5 ms up) costs more than a layer's forward and backward.
    profiler = hand_fed_profiler(num_layers=16, hop_bytes=25_000_000)
    free_hops = auto_plan(profiler.costs(), 8, 9, round_size=9)
    paid_hops = AutoPlanner(profiler.cost_model, None).current(8, 9, 2**20)
    assert num_stages(paid_hops) < num_stages(free_hops)


def test_a_first_link_measurement_or_a_material_change_warrants_a_replan():
    unmeasured = LayerProfiler([10], [40]).cost_model(None)
    measured = hand_fed_profiler(num_layers=1, hop_bytes=1000, gbps=10.0).cost_model(None)
    nearly_the_same = hand_fed_profiler(num_layers=1, hop_bytes=1000, gbps=10.5).cost_model(None)
    slower = hand_fed_profiler(num_layers=1, hop_bytes=1000, gbps=5.0).cost_model(None)
    assert link_moved(unmeasured, measured)
    assert not link_moved(measured, nearly_the_same)
    assert link_moved(measured, slower)


def test_the_planner_adopts_a_plan_with_fewer_stages_once_it_measured_costly_hops():
    profiler = LayerProfiler([1000] * 16, [2**20] * 16)
    for layer in range(16):
        profiler.record("forward", [layer], 1e-3)
        profiler.record("recompute", [layer], 1e-3)
        profiler.record("backward", [layer], 2e-3)
    planner = AutoPlanner(profiler.cost_model, None)
    first = planner.plan(8, 9, 2**20)
    for link in ("h2d", "d2h"):
        profiler.record_transfer(link, 10 * 2**20, 10 * 2**20 / 10e9)
    profiler.record_boundary(25_000_000)
    plan, deadline = first, time.monotonic() + 20
    while plan == first and time.monotonic() < deadline:
        plan = planner.plan(8, 9, 2**20)  # starts the re-plan, then adopts it when done
        time.sleep(0.01)
    assert planner.costs.comm > 0
    assert num_stages(plan) < num_stages(first)
