"""The runtime's planner learns the activation bytes per microbatch at each layer's input
(from the activations forward jobs download) and fits plans to the devices' memory with
them: a backward stage recomputes, so it holds every one of its layers' inputs."""

from __future__ import annotations

import time

from roundpipe.core.plan import Plan
from roundpipe.planning.planner import AutoPlanner, activations_moved
from roundpipe.planning.rules import stage_footprint
from roundpipe.runtime.profiler import LayerProfiler, TransferTiming

LAYERS, MIB = 16, 2**20
ACTIVATION = 25_000_000  # one microbatch's hidden state: a hop costs more than a layer
BUDGET = 2 * 60_000_000  # half of it per stage: two layers with their activations


def _profiler(gbps: float = 10.0) -> LayerProfiler:
    """Layers of 1 ms forward and recompute, 2 ms backward, 1 MiB of weights; a link of
    ``gbps`` both ways."""
    profiler = LayerProfiler([1000] * LAYERS, [MIB] * LAYERS)
    for layer in range(LAYERS):
        profiler.record("forward", [layer], 1e-3)
        profiler.record("recompute", [layer], 1e-3)
        profiler.record("backward", [layer], 2e-3)
    for link in ("h2d", "d2h"):
        profiler.record_transfer(link, 10 * MIB, 10 * MIB / (gbps * 1e9))
    return profiler


def _largest_backward_stage(plan: Plan) -> int:
    return max(plan.backward)


def _fits_with_activations(plan: Plan, activation: int = ACTIVATION) -> bool:
    """Every stage in half the budget, counting weights, gradients and (backward stages)
    one microbatch's input of each layer: computed here, not by the code under test."""
    for size in plan.backward:
        if 2 * size * MIB + size * activation > BUDGET / 2:
            return False
    return all(size * MIB + activation <= BUDGET / 2 for size in plan.forward)


def test_the_profiler_keeps_the_largest_activation_seen_at_each_layer_input() -> None:
    profiler = LayerProfiler([10] * 4, [40] * 4)
    assert profiler.activation_bytes() == (0, 0, 0, 0)
    profiler.record_boundary(100, layer=1)
    profiler.record_boundary(300, layer=1)
    profiler.record_boundary(200, layer=3)
    # a layer whose input was never downloaded is taken as large as the largest seen
    assert profiler.activation_bytes() == (300, 300, 300, 200)
    assert profiler.costs().activation_bytes == (300, 300, 300, 200)
    assert profiler.boundary_bytes() == 200  # the mean still prices a hop


def test_a_boundary_download_tells_the_profiler_its_layer() -> None:
    profiler = LayerProfiler([10] * 3, [40] * 3)
    timing = TransferTiming(None, "d2h", boundary=True, layer=2)
    timing.nbytes = 4096
    profiler.record_timing(timing)
    assert profiler.activation_bytes()[2] == 4096


def test_the_memory_fit_counts_the_measured_activations() -> None:
    profiler = _profiler()
    profiler.record_boundary(ACTIVATION)  # dear hops (5 ms): few, big stages win...
    unfit = AutoPlanner(profiler.cost_model, None).current(8, 9, MIB)
    assert not _fits_with_activations(unfit)  # ...where no budget holds them back
    planned = AutoPlanner(profiler.cost_model, [BUDGET] * 8).current(8, 9, MIB)
    assert _fits_with_activations(planned)
    assert _largest_backward_stage(planned) < _largest_backward_stage(unfit)
    costs = profiler.cost_model(MIB)
    for layers in planned.backward_ranges():
        assert stage_footprint(costs, layers, True) >= len(layers) * ACTIVATION


def test_the_planner_replans_to_fit_once_it_measured_larger_activations() -> None:
    small = ACTIVATION // 10
    profiler = _profiler(gbps=1.0)  # a slow link: hops of the small activation are dear
    profiler.record_boundary(small)
    planner = AutoPlanner(profiler.cost_model, [BUDGET] * 8)
    first = planner.plan(8, 9, MIB)
    assert _fits_with_activations(first, small)
    assert not _fits_with_activations(first)
    before = profiler.cost_model(MIB)
    for layer in range(1, LAYERS):
        profiler.record_boundary(ACTIVATION, layer=layer)
    assert activations_moved(before, profiler.cost_model(MIB))
    plan, deadline = first, time.monotonic() + 20
    while plan == first and time.monotonic() < deadline:
        plan = planner.plan(8, 9, MIB)  # starts the re-plan, then adopts it when done
        time.sleep(0.01)
    assert _fits_with_activations(plan)


def test_the_runtime_learns_each_layers_input_size() -> None:
    """Forward stages of one layer each download every layer's input; a narrow layer's
    input is learned as narrow, not as the widest boundary."""
    import torch
    from torch import nn

    from roundpipe import Plan, RoundPipe, RoundPipeRunConfig

    widths = [16, 64, 16, 64, 16, 8]
    layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False)]
    plan = Plan(forward=(1, 1, 1, 1), backward=(1, 1, 1, 1, 1))
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    rows = 6
    with RoundPipe(nn.Sequential(*layers), devices="emulated:2", model_run_config=config) as pipe:
        x, y = torch.randn(rows, 16), torch.randn(rows, 8)
        pipe.forward_backward((x,), label=y, loss_fn=lambda out, lab: ((out - lab) ** 2).sum())
        pipe.synchronize()
        learned = pipe.profiler.activation_bytes()
    per_row = [w * 4 * rows // 2 for w in widths[:-1]]  # fp32, one microbatch of 3 rows
    assert learned[1:4] == tuple(per_row[1:4])
