"""How candidate plans are built, and which fit in memory (for :mod:`roundpipe.planning.partition`).

Greedy packing under a stage-time and a memory cap, the paper's rule, plans with
stages of one size, and the memory test: a stage must fit in half the budget of every
device it can land on (docs/design.md#partitioner).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from ..core.plan import Plan
from .sim.baselines import balanced_partition
from .sim.costs import CostModel, LayerCosts


def stage_footprint(costs: CostModel, layers: range, backward: bool) -> int:
    """Bytes a stage occupies on its device while it runs."""
    params = costs.layers.stage_param_bytes(layers)
    if not backward:
        working = max((costs.layers.activation_bytes[i] for i in layers), default=0)
        return params + working
    grads = int(params * costs.grad_bytes_ratio)
    return params + grads + costs.layers.stage_activation_bytes(layers)


def devices_visited(plan: Plan, num_devices: int) -> list[set[int]]:
    """For each job of a round, the devices it lands on as the cursor moves round to
    round (a placed plan's rounds all start at device 0: job j on j mod N)."""
    num_jobs = len(plan.forward) + len(plan.backward)
    if plan.placed:
        return [{j % num_devices} for j in range(num_jobs)]
    step = num_jobs % num_devices
    cursors = {(k * step) % num_devices for k in range(num_devices)}
    return [{(c + j) % num_devices for c in cursors} for j in range(num_jobs)]


def fits(plan: Plan, costs: CostModel, memory_budgets: Sequence[int] | None) -> bool:
    """Whether every stage fits in half the budget of every device it can run on."""
    if memory_budgets is None:
        return True
    stages = [(r, False) for r in plan.forward_ranges()]
    stages += [(r, True) for r in plan.backward_ranges()]
    visited = devices_visited(plan, len(memory_budgets))
    return all(
        stage_footprint(costs, layers, backward) <= min(memory_budgets[d] for d in devices) / 2
        for (layers, backward), devices in zip(stages, visited, strict=True)
    )


def equal_size_plans(num_layers: int) -> Iterator[Plan]:
    """Hand-tuned plans: a fused stage of ``f`` layers, every other stage of ``k`` (the
    last forward and the last backward stage take the remainder), for every f and k."""
    for fused in range(1, num_layers):
        for size in range(1, num_layers - fused + 1):
            yield equal_size(num_layers, fused, size)


def equal_size(num_layers: int, fused: int, size: int) -> Plan:
    """A fused stage of ``fused`` layers, every other stage of ``size`` (see above)."""
    rest = num_layers - fused
    stages = (size,) * (rest // size) + ((rest % size,) if rest % size else ())
    return Plan(stages, (fused, *stages[::-1]))


def paper_greedy_plan(layers: LayerCosts, slack: float = 1.1) -> Plan:
    """The paper's rule: pack contiguous layers greedily into stages whose time stays
    under ``slack`` times the slowest single layer of that kind of stage (forward;
    recompute + backward; the fused stage's forward + backward, packed from the top)."""
    n = layers.num_layers
    forward = list(layers.forward)
    backward = [r + b for r, b in zip(layers.recompute, layers.backward, strict=True)]
    fused_times = [f + b for f, b in zip(layers.forward, layers.backward, strict=True)]
    no_memory = [0] * n
    fused = pack(fused_times[::-1], slack * max(fused_times), no_memory, math.inf)[0]
    fused = min(fused, n - 1)
    rest = n - fused
    forward_stages = pack(forward[:rest], slack * max(forward), no_memory[:rest], math.inf)
    backward_stages = pack(backward[:rest][::-1], slack * max(backward), no_memory[:rest], math.inf)
    return Plan(tuple(forward_stages), (fused, *backward_stages))


def pack(times: Sequence[float], cap: float, sizes: Sequence[int], memory_cap: float) -> list[int]:
    """Greedily pack layers in order into stages under a time and a memory cap."""
    stages: list[int] = []
    time = size = 0.0
    for t, s in zip(times, sizes, strict=True):
        if stages and time + t <= cap * (1 + 1e-9) and size + s <= memory_cap:
            stages[-1] += 1
            time, size = time + t, size + s
        else:
            stages.append(1)
            time, size = t, s
    return stages


def rebalance(times: Sequence[float], sizes: list[int]) -> list[int]:
    """Same stage count, most even split (never longer than the greedy one)."""
    if len(sizes) <= 1:
        return sizes
    balanced = balanced_partition(times, len(sizes))
    return balanced if _longest(times, balanced) <= _longest(times, sizes) else sizes


def _longest(times: Sequence[float], sizes: Sequence[int]) -> float:
    longest, start = 0.0, 0
    for size in sizes:
        longest = max(longest, sum(times[start : start + size]))
        start += size
    return longest
