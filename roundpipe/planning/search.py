"""The automatic planner's search (for :func:`roundpipe.planning.partition.auto_plan`).

Finds the plan that simulating every candidate would pick while simulating few: lower
bounds (:mod:`roundpipe.planning.sim.bounds`) skip candidates that cannot win and order
the rest, then local moves refine the best (docs/design.md#partitioner).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from heapq import heappop, heappush

from ..core.plan import Plan
from .mixed import device_sized_plans
from .rules import equal_size, fits, pack, paper_greedy_plan, rebalance, stage_footprint
from .sim.bounds import PlanBounds
from .sim.costs import CostModel
from .sim.roundpipe_schedule import isolated_iteration_time, steady_mean

CAP_FACTORS = (1.0, 1.05, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 10.0)
"""Stage-time caps tried, as multiples of the slowest unavoidable stage."""
REFINE_BUDGET = 12
"""Simulations refinement may spend; on the randomised profiles of the tests it rarely
gains more than a percent or two over the best candidate."""
OBJECTIVES = ("steady", "makespan")
"""What a plan is scored by: the steady-state iteration of asynchronous steps, or one
isolated iteration from idle with a synchronous step (docs/design.md#partitioner)."""
NEAR_OPTIMAL = 0.005
"""Refinement stops once a plan is predicted within this fraction of the lower bound
on every plan's iteration time, and only takes moves that gain more than this."""


class Search:
    """Candidate generation, scoring and refinement for one cost model and pool."""

    def __init__(
        self,
        costs: CostModel,
        num_devices: int,
        num_microbatches: int,
        memory_budgets: Sequence[int] | None,
        round_size: int | None,
        objective: str = "steady",
    ) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        self.costs = costs
        self.objective = objective
        self.num_devices = num_devices
        self.num_microbatches = num_microbatches
        self.memory_budgets = memory_budgets
        self.round_size = round_size or num_devices
        self.bounds = PlanBounds(
            costs,
            num_devices,
            num_microbatches,
            round_size=self.round_size,
            isolated=objective == "makespan",
        )
        self._scores: dict[Plan, float] = {}
        self._tight: dict[Plan, float] = {}
        self._stages: dict = {}  # stage durations, shared by every plan scored
        self._refine_budget = REFINE_BUDGET * (4 if costs.mixed else 1)
        layers = costs.layers
        self.n = layers.num_layers
        self.forward = list(layers.forward)
        self.backward = [r + b for r, b in zip(layers.recompute, layers.backward, strict=True)]
        self.fused = [f + b for f, b in zip(layers.forward, layers.backward, strict=True)]

    @property
    def simulated(self) -> int:
        return len(self._scores)

    def score(self, plan: Plan) -> float:
        """The predicted time of the objective (``predict_iteration_time``), ties to
        fewer stages: fewer uploads and less host traffic."""
        if plan not in self._scores:
            args = (plan, self.costs, self.num_devices, self.num_microbatches)
            if self.objective == "makespan":  # exact: no bound can be above it
                time = isolated_iteration_time(
                    *args, round_size=self.round_size, stages=self._stages
                )
            else:  # an estimate from a short run: never below the bounds
                mean = steady_mean(*args, round_size=self.round_size, stages=self._stages)
                time = max(mean, self.tight(plan))
            self._scores[plan] = time * (1 + 1e-9 * (len(plan.forward) + len(plan.backward)))
        return self._scores[plan]

    def tight(self, plan: Plan) -> float:
        if plan not in self._tight:
            self._tight[plan] = self.bounds.tight(plan)
        return self._tight[plan]

    def best(self, plans: Iterable[Plan], incumbent: Plan | None = None) -> Plan | None:
        """The best-scoring plan of ``plans`` (and ``incumbent``), as if every plan were
        simulated: see the module docstring."""
        best = incumbent
        best_score = self.score(best) if best is not None else math.inf
        ordered = sorted((self.bounds.of(p), i, p) for i, p in enumerate(plans))
        heap: list[tuple[float, int, Plan]] = []
        k = 0
        while True:
            while k < len(ordered) and (not heap or ordered[k][0] < heap[0][0]):
                cheap, i, plan = ordered[k]
                k += 1
                if cheap >= best_score:
                    k = len(ordered)
                elif self.tight(plan) < best_score:
                    heappush(heap, (self.tight(plan), i, plan))
            if not heap or heap[0][0] >= best_score:
                return best
            plan = heappop(heap)[2]
            if self.score(plan) < best_score:
                best, best_score = plan, self.score(plan)

    def candidates(self) -> Iterator[Plan]:
        seen: set[Plan] = set()
        base = max(max(self.backward[:-1], default=0.0), self.fused[-1])
        for memory_cap in self._memory_caps():
            for factor in CAP_FACTORS:
                cap = base * factor
                greedy = pack(self.fused[::-1], cap, self._mem(True)[::-1], memory_cap)[0]
                for fused in sorted({greedy - 1, greedy, greedy + 1} - {0}):
                    plan = self._plan(fused, cap, memory_cap)
                    if plan is not None and plan not in seen and self._fits(plan):
                        seen.add(plan)
                        yield plan
        # One layer per stage needs the least memory per stage: if anything fits, it does
        # (packing under a time cap, then rebalancing, can miss it on a tight budget).
        finest = Plan((1,) * (self.n - 1), (1,) * self.n)
        sized = device_sized_plans(self.costs, self.num_devices, self.memory_budgets)
        for plan in (finest, paper_greedy_plan(self.costs.layers), *sized):
            if plan not in seen and self._fits(plan):
                seen.add(plan)
                yield plan

    def equal_size_plans(self, incumbent: Plan | None) -> Iterator[Plan]:
        """Plans with stages of one size that could beat ``incumbent``: fused sizes whose
        work or loss chain bound is already above it are skipped whole."""
        best = self.score(incumbent) if incumbent is not None else math.inf
        for fused in range(1, self.n):
            if self.bounds.fused_floor(fused) >= best:
                continue
            for size in range(1, self.n - fused + 1):
                plan = equal_size(self.n, fused, size)
                if self._fits(plan):
                    yield plan

    def refine(self, plan: Plan) -> Plan:
        """Local moves (see :func:`neighbours`) while one gains more than
        ``NEAR_OPTIMAL`` and the simulation budget lasts; moves are tried in the order of
        their job-level bounds, the likeliest gain first."""
        improved, spent = True, self.simulated
        while improved and not self._near_optimal(plan):
            improved = False
            goal = self.score(plan) * (1 - NEAR_OPTIMAL)
            moves = [
                (self.tight(p), i, p)
                for i, p in enumerate(neighbours(plan, self.backward))
                if self._fits(p) and self.bounds.of(p) < goal
            ]
            for bound, _, neighbour in sorted(moves):
                if bound >= goal or self.simulated - spent >= self._refine_budget:
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

    def _near_optimal(self, plan: Plan) -> bool:
        return self.score(plan) <= (1 + NEAR_OPTIMAL) * self.bounds.floor

    def _plan(self, fused: int, cap: float, memory_cap: float) -> Plan | None:
        if fused > self.n:
            return None
        rest = self.n - fused
        backward = pack(self.backward[:rest][::-1], cap, self._mem(True)[:rest][::-1], memory_cap)
        forward = pack(self.forward[:rest], cap, self._mem(False)[:rest], memory_cap)
        backward = rebalance(self.backward[:rest][::-1], backward)
        forward = rebalance(self.forward[:rest], forward)
        return Plan(tuple(forward), (fused, *backward))

    def _fits(self, plan: Plan) -> bool:
        return fits(plan, self.costs, self.memory_budgets)

    def _memory_caps(self) -> list[float]:
        if self.memory_budgets is None:
            return [math.inf]
        return sorted({min(self.memory_budgets) / 2, max(self.memory_budgets) / 2})

    def _mem(self, backward: bool) -> list[int]:
        return [stage_footprint(self.costs, range(i, i + 1), backward) for i in range(self.n)]


def neighbours(plan: Plan, backward_times: Sequence[float]) -> Iterator[Plan]:
    """Plans one move away: one layer across a forward or a backward stage boundary;
    across the fused boundary (the last forward stage gives or takes it, and the first
    backward stage or the whole run of backward boundaries below moves with it); two
    adjacent stages merged; a stage split in two. Placed as ``plan``."""
    forward, backward = plan.forward, plan.backward
    for moved in _shifted(forward, first=0):
        yield plan.with_sizes(moved, backward)
    for moved in _shifted(backward, first=1):  # boundary 0 is the fused one
        yield plan.with_sizes(forward, moved)
    if len(backward) >= 2 and forward:
        for delta in (1, -1):
            last = (*forward[:-1], forward[-1] - delta)
            last = tuple(n for n in last if n)  # a forward stage the fused one swallowed
            if not last or min(last) < 1:
                continue
            one = (backward[0] + delta, backward[1] - delta, *backward[2:])
            run = (backward[0] + delta, *backward[1:-1], backward[-1] - delta)
            for moved in {one, run}:
                if min(moved) >= 1:
                    yield plan.with_sizes(last, moved)
    for moved in _merged(forward, first=0):
        yield plan.with_sizes(moved, backward)
    for moved in _merged(backward, first=1):
        yield plan.with_sizes(forward, moved)
    for moved in _split(forward, first=0):
        yield plan.with_sizes(moved, backward)
    times = list(backward_times[: plan.num_layers - backward[0]])[::-1]  # top layer first
    for moved in _split(backward, first=1, times=times):
        yield plan.with_sizes(forward, moved)


def _shifted(sizes: tuple[int, ...], first: int) -> Iterator[tuple[int, ...]]:
    for i in range(first, len(sizes) - 1):
        for delta in (1, -1):
            moved = list(sizes)
            moved[i] += delta
            moved[i + 1] -= delta
            if min(moved) >= 1:
                yield tuple(moved)


def _merged(sizes: tuple[int, ...], first: int) -> Iterator[tuple[int, ...]]:
    for i in range(first, len(sizes) - 1):
        yield (*sizes[:i], sizes[i] + sizes[i + 1], *sizes[i + 2 :])


def _split(
    sizes: tuple[int, ...], first: int, times: Sequence[float] | None = None
) -> Iterator[tuple[int, ...]]:
    """Each stage of two or more layers cut in two halves (by layers, or by ``times``:
    the stages' layers in order after the first ``first`` stages)."""
    start = 0
    for i, size in enumerate(sizes):
        if i >= first and size >= 2:
            cut = size // 2
            if times is not None:
                stage = times[start : start + size]
                total, acc, cut = sum(stage), 0.0, 1
                for k in range(1, size):
                    acc += stage[k - 1]
                    if acc >= total / 2:
                        cut = k
                        break
                else:
                    cut = size - 1
            yield (*sizes[:i], cut, size - cut, *sizes[i + 1 :])
        if i >= first:
            start += size
