"""Automatic layer partitioning: choose the plan the simulator predicts to be fastest.

DESIGN.md §6 and issue 3. Candidate plans come from greedy packing of contiguous
layers under a stage-time cap and a memory cap, for a range of caps and fused-stage
sizes (the paper scans caps between the slowest layer and 1.1x it; we scan wider,
because with a heavy head the best stage length is set by the fused stage). Every
candidate is then timed by the RoundPipe simulator — the same cost model that
predicts the steady-state iteration time — and the fastest is refined by moving
single stage boundaries while that helps.

Memory: one stage is prefetched while another runs, so a stage's footprint
(weights, gradients for backward stages, one microbatch's working activations)
must fit in half the budget of every device it can land on under round-robin.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from .plan import Plan, PlanError
from .sim.baselines import balanced_partition
from .sim.bounds import PlanBounds
from .sim.costs import CostModel, LayerCosts
from .sim.roundpipe_schedule import steady_iteration_time

CAP_FACTORS = (1.0, 1.05, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0)
"""Stage-time caps tried, as multiples of the slowest unavoidable stage."""
REFINE_BUDGET = 12
"""Simulations refinement may spend; on the randomised profiles of the tests it rarely
gains more than a percent or two over the best candidate."""
NEAR_OPTIMAL = 0.005
"""Refinement stops once a plan is predicted within this fraction of the lower bound
on every plan's iteration time, and only takes moves that gain more than this."""


def auto_plan(
    costs: LayerCosts | CostModel,
    num_devices: int,
    num_microbatches: int,
    memory_budgets: Sequence[int] | None = None,
    *,
    round_size: int | None = None,
    refine: bool = True,
) -> Plan:
    """The plan with the lowest predicted steady-state iteration time.

    ``costs`` may be plain :class:`LayerCosts` (built with ``LayerCosts.from_lists``
    from per-layer forward seconds, backward seconds and parameter bytes) or a full
    :class:`CostModel` with transfer costs. The last layer ends the fused stage
    (it is the head and loss); no layer is treated specially otherwise.
    ``memory_budgets`` gives each device's usable bytes (devices may differ).
    """
    model = costs if isinstance(costs, CostModel) else CostModel(costs)
    if memory_budgets is not None and len(memory_budgets) != num_devices:
        raise ValueError(
            f"got {len(memory_budgets)} memory budgets for {num_devices} devices; give one each"
        )
    search = _Search(model, num_devices, num_microbatches, memory_budgets, round_size)
    best = search.best(search.candidates())
    if best is None:
        raise PlanError(search.no_fit_message())
    return search.refine(best) if refine else best


def predict_iteration_time(
    plan: Plan,
    costs: LayerCosts | CostModel,
    num_devices: int,
    num_microbatches: int,
    *,
    round_size: int | None = None,
) -> float:
    """Predicted steady-state seconds per iteration of ``plan`` (async optimizer)."""
    model = costs if isinstance(costs, CostModel) else CostModel(costs)
    return steady_iteration_time(plan, model, num_devices, num_microbatches, round_size=round_size)


def should_replan(old: LayerCosts, new: LayerCosts, threshold: float = 0.15) -> bool:
    """Whether measurements moved enough that the current plan may no longer be best.

    True when the layer count changed, or some layer's forward+backward time (or
    parameter bytes) moved by more than ``threshold`` times the average layer's.
    Noise on individual small layers does not trigger a re-plan on every call.
    """
    if old.num_layers != new.num_layers:
        return True
    old_time = [f + b for f, b in zip(old.forward, old.backward, strict=True)]
    new_time = [f + b for f, b in zip(new.forward, new.backward, strict=True)]
    return _moved(old_time, new_time, threshold) or _moved(
        old.param_bytes, new.param_bytes, threshold
    )


def stage_footprint(costs: CostModel, layers: range, backward: bool) -> int:
    """Bytes a stage occupies on its device while it runs."""
    params = costs.layers.stage_param_bytes(layers)
    if not backward:
        working = max((costs.layers.activation_bytes[i] for i in layers), default=0)
        return params + working
    grads = int(params * costs.grad_bytes_ratio)
    return params + grads + costs.layers.stage_activation_bytes(layers)


def devices_visited(plan: Plan, num_devices: int) -> list[set[int]]:
    """For each job of a round, the devices it lands on as the cursor moves round to round."""
    num_jobs = len(plan.forward) + len(plan.backward)
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


class _Search:
    """Candidate generation, scoring and refinement for one cost model and pool."""

    def __init__(self, costs, num_devices, num_microbatches, memory_budgets, round_size):
        self.costs = costs
        self.num_devices = num_devices
        self.num_microbatches = num_microbatches
        self.memory_budgets = memory_budgets
        self.round_size = round_size
        self._scores: dict[Plan, float] = {}
        self.bounds = PlanBounds(
            costs, num_devices, num_microbatches, round_size=round_size or num_devices
        )
        layers = costs.layers
        self.n = layers.num_layers
        self.forward = list(layers.forward)
        self.backward = [r + b for r, b in zip(layers.recompute, layers.backward, strict=True)]
        self.fused = [f + b for f, b in zip(layers.forward, layers.backward, strict=True)]

    def best(self, plans: Iterator[Plan]) -> Plan | None:
        """The best-scoring plan, as if every plan were simulated: plans are simulated
        in the order of their lower bounds, until the next bound cannot beat the best."""
        best: Plan | None = None
        for bound, plan in _by_bound((self.bounds.of(p), p) for p in plans):
            if best is not None and bound >= self.score(best):
                break
            if best is None or self.score(plan) < self.score(best):
                best = plan
        return best

    def _near_optimal(self, plan: Plan) -> bool:
        return self.score(plan) <= (1 + NEAR_OPTIMAL) * self.bounds.floor

    def score(self, plan: Plan) -> float:
        if plan not in self._scores:
            time = predict_iteration_time(
                plan,
                self.costs,
                self.num_devices,
                self.num_microbatches,
                round_size=self.round_size,
            )
            # Ties go to fewer stages: fewer uploads and less host traffic.
            self._scores[plan] = time * (1 + 1e-9 * (len(plan.forward) + len(plan.backward)))
        return self._scores[plan]

    def candidates(self) -> Iterator[Plan]:
        seen: set[Plan] = set()
        base = max(max(self.backward[:-1], default=0.0), self.fused[-1])
        for memory_cap in self._memory_caps():
            for factor in CAP_FACTORS:
                cap = base * factor
                greedy = _pack(self.fused[::-1], cap, self._mem(True)[::-1], memory_cap)[0]
                for fused in sorted({greedy - 1, greedy, greedy + 1} - {0}):
                    plan = self._plan(fused, cap, memory_cap)
                    if plan is not None and plan not in seen and self._fits(plan):
                        seen.add(plan)
                        yield plan
        # One layer per stage needs the least memory per stage: if anything fits, it does
        # (packing under a time cap, then rebalancing, can miss it on a tight budget).
        finest = Plan((1,) * (self.n - 1), (1,) * self.n)
        rules = [finest, paper_greedy_plan(self.costs.layers)]
        # hand-tuned: every stage, the fused one too, of the same size
        rules += [_equal_size(self.n, size, size) for size in range(2, self.n // 2 + 1)]
        for plan in rules:
            if plan not in seen and self._fits(plan):
                seen.add(plan)
                yield plan

    def refine(self, plan: Plan) -> Plan:
        """Move single stage boundaries (and the fused boundary) while it helps."""
        improved, spent = True, len(self._scores)
        while improved and not self._near_optimal(plan):
            improved = False
            goal = self.score(plan) * (1 - NEAR_OPTIMAL)
            moves = _by_bound((self.bounds.of(p), p) for p in _neighbours(plan) if self._fits(p))
            for bound, neighbour in moves:
                if bound >= goal or len(self._scores) - spent >= REFINE_BUDGET:
                    break
                if self.score(neighbour) < goal:
                    plan, improved = neighbour, True
                    break
        return plan

    def no_fit_message(self) -> str:
        budget = min(self.memory_budgets or [0])
        heaviest = max(
            range(self.n), key=lambda i: stage_footprint(self.costs, range(i, i + 1), True)
        )
        need = stage_footprint(self.costs, range(heaviest, heaviest + 1), True)
        return (
            f"no plan fits the memory budgets: layer {heaviest} alone needs {need} bytes as a "
            f"backward stage, but half the smallest device budget is {budget // 2} bytes; "
            "give more memory, more devices of a larger kind, or split the layer"
        )

    def _plan(self, fused: int, cap: float, memory_cap: float) -> Plan | None:
        if fused > self.n:
            return None
        rest = self.n - fused
        backward = _pack(self.backward[:rest][::-1], cap, self._mem(True)[:rest][::-1], memory_cap)
        forward = _pack(self.forward[:rest], cap, self._mem(False)[:rest], memory_cap)
        backward = _rebalance(self.backward[:rest][::-1], backward)
        forward = _rebalance(self.forward[:rest], forward)
        return Plan(tuple(forward), (fused, *backward))

    def _fits(self, plan: Plan) -> bool:
        return fits(plan, self.costs, self.memory_budgets)

    def _memory_caps(self) -> list[float]:
        if self.memory_budgets is None:
            return [math.inf]
        return sorted({min(self.memory_budgets) / 2, max(self.memory_budgets) / 2})

    def _mem(self, backward: bool) -> list[int]:
        return [stage_footprint(self.costs, range(i, i + 1), backward) for i in range(self.n)]


def equal_size_plans(num_layers: int) -> Iterator[Plan]:
    """Hand-tuned plans: a fused stage of ``f`` layers, every other stage of ``k`` (the
    last forward and the last backward stage take the remainder), for every f and k."""
    for fused in range(1, num_layers):
        for size in range(1, num_layers - fused + 1):
            yield _equal_size(num_layers, fused, size)


def _equal_size(num_layers: int, fused: int, size: int) -> Plan:
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
    fused = _pack(fused_times[::-1], slack * max(fused_times), no_memory, math.inf)[0]
    fused = min(fused, n - 1)
    rest = n - fused
    forward_stages = _pack(forward[:rest], slack * max(forward), no_memory[:rest], math.inf)
    backward_stages = _pack(
        backward[:rest][::-1], slack * max(backward), no_memory[:rest], math.inf
    )
    return Plan(tuple(forward_stages), (fused, *backward_stages))


def _by_bound(bounded: Iterator[tuple[float, Plan]]) -> list[tuple[float, Plan]]:
    return sorted(bounded, key=lambda pair: pair[0])


def _pack(times: Sequence[float], cap: float, sizes: Sequence[int], memory_cap: float) -> list[int]:
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


def _rebalance(times: Sequence[float], sizes: list[int]) -> list[int]:
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


def _neighbours(plan: Plan) -> Iterator[Plan]:
    """Plans one boundary move away: one layer across a forward or a backward stage
    boundary, or across the fused boundary (the last forward stage gives or takes it)."""
    for forward in _shifted(plan.forward, first=0):
        yield Plan(forward, plan.backward)
    for backward in _shifted(plan.backward, first=1):  # boundary 0 is the fused one
        yield Plan(plan.forward, backward)
    if len(plan.backward) < 2 or not plan.forward:
        return
    for delta in (1, -1):
        backward = (plan.backward[0] + delta, plan.backward[1] - delta, *plan.backward[2:])
        forward = (*plan.forward[:-1], plan.forward[-1] - delta)
        forward = tuple(n for n in forward if n)  # a forward stage the fused one swallowed
        if min(backward) >= 1 and forward and min(forward) >= 1:
            yield Plan(forward, backward)


def _shifted(sizes: tuple[int, ...], first: int) -> Iterator[tuple[int, ...]]:
    for i in range(first, len(sizes) - 1):
        for delta in (1, -1):
            moved = list(sizes)
            moved[i] += delta
            moved[i + 1] -= delta
            if min(moved) >= 1:
                yield tuple(moved)


def _moved(old: Sequence[float], new: Sequence[float], threshold: float) -> bool:
    mean = sum(old) / len(old) if old else 0.0
    if mean == 0:
        return any(n != 0 for n in new)
    return max(abs(n - o) for o, n in zip(old, new, strict=True)) > threshold * mean
