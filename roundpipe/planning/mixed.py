"""Plans for a mixed pool: each stage sized for the device that runs it.

On a pool of unequal devices every call places job ``j`` on device ``j mod N``
(:meth:`roundpipe.core.schedule.Schedule.next_cursor`), so a plan can give a slow device
fewer layers than a fast one: all jobs then hand their microbatches on at one pace and
no device waits for a slower neighbour (docs/design.md#mixed-pools). These are the
candidates :class:`~roundpipe.planning.search.Search` adds for a mixed cost model; the
simulator, which times each job on its own device, picks among them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..core.plan import Plan
from .rules import stage_footprint
from .sim.costs import CostModel

CAP_STEPS = 24
"""Per-job time caps tried, geometrically spaced from the fastest device's longest
layer forward to one job holding the whole model."""


def device_sized_plans(
    costs: CostModel, num_devices: int, memory_budgets: Sequence[int] | None
) -> Iterator[Plan]:
    """Plans packed greedily under a per-job time cap ``T``: forward jobs from layer 0,
    then the fused job from the top, then backward jobs down to layer 0, each job taking
    layers while its time on its own device stays under ``T`` (and its footprint under
    half that device's budget); for every cap of a geometric range and every fused size
    whose time on its device stays under the cap."""
    n = costs.layers.num_layers
    if not costs.mixed or n < 2:
        return
    devices = [costs.layers_on(d) for d in range(num_devices)]
    least = min(max(c.forward) for c in devices) or 1e-9
    whole = max(sum(c.forward) + sum(c.backward) + sum(c.recompute) for c in devices)
    seen: set[Plan] = set()
    for step in range(CAP_STEPS):
        cap = least * (max(whole, least) / least) ** (step / (CAP_STEPS - 1))
        for fused in range(1, n):
            plan = _packed(costs, devices, fused, cap, memory_budgets)
            if plan is not None and plan not in seen:
                seen.add(plan)
                yield plan


def _packed(costs, devices, fused: int, cap: float, budgets) -> Plan | None:
    n, num_devices = costs.layers.num_layers, len(devices)
    rest = n - fused
    forward = _pack(
        costs, devices, range(rest), 0, cap, budgets, lambda c, i: c.forward[i], backward=False
    )
    if forward is None:
        return None
    device = len(forward) % num_devices
    top = devices[device]
    fused_time = sum(top.forward[i] + top.backward[i] for i in range(rest, n))
    if fused > 1 and fused_time > cap:
        return None  # a smaller fused stage is tried too
    if not _fits(costs, range(rest, n), True, budgets, device):
        return None
    backward = _pack(
        costs,
        devices,
        range(rest - 1, -1, -1),
        device + 1,
        cap,
        budgets,
        lambda c, i: c.recompute[i] + c.backward[i],
        backward=True,
    )
    if backward is None:
        return None
    return Plan(tuple(forward), (fused, *backward), placed=True)


def _pack(costs, devices, layers: range, first_job: int, cap, budgets, time, backward):
    """Stage sizes for ``layers`` in order, job ``first_job + k`` on its device."""
    sizes: list[int] = []
    job, spent, start = first_job, 0.0, None
    for i in layers:
        device = job % len(devices)
        t = time(devices[device], i)
        if start is not None:
            stage = range(min(start, i), max(start, i) + 1)
            if spent + t <= cap * (1 + 1e-9) and _fits(costs, stage, backward, budgets, device):
                sizes[-1] += 1
                spent += t
                continue
            job += 1
            device = job % len(devices)
            t = time(devices[device], i)
        if not _fits(costs, range(i, i + 1), backward, budgets, device):
            return None
        sizes.append(1)
        spent, start = t, i
    return sizes


def _fits(costs: CostModel, layers: range, backward: bool, budgets, device: int) -> bool:
    if budgets is None:
        return True
    return stage_footprint(costs, layers, backward) <= budgets[device] / 2


__all__ = ["device_sized_plans"]
