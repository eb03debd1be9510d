"""Keeps the automatic plan in step with the profiler, without thrashing.

The partitioner runs again only when measurements moved materially since the last
time it ran (``should_replan``), and its new choice replaces the current plan only
if the simulator predicts it to be clearly faster under the new measurements, so
near-ties measured with noise do not make the plan flip back and forth. While the
plan keeps standing, checks become rarer (every 1, 2, 4, ... calls), so noisy
measurements of tiny layers do not cost a partitioner run on every call.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..partition import auto_plan, predict_iteration_time, should_replan
from ..plan import Plan
from ..sim.costs import LayerCosts
from .profiler import LayerProfiler

MIN_GAIN = 0.05
"""A new plan must be predicted at least this much faster to replace the current one."""
MAX_INTERVAL = 64
"""Calls between checks grow (doubling) up to this while the plan keeps standing."""


class AutoPlanner:
    def __init__(self, profiler: LayerProfiler, budgets: Sequence[int] | None) -> None:
        self.profiler = profiler
        self.budgets = list(budgets) if budgets is not None else None
        self.replans = 0
        self._plan: Plan | None = None
        self._costs: LayerCosts | None = None
        self._key: tuple[int, int] | None = None
        self._interval = 1
        self._calls_since_check = 0

    def current(self, num_devices: int, num_microbatches: int) -> Plan:
        """The plan in force, without counting a call (a first plan is chosen if needed)."""
        key = (num_devices, num_microbatches)
        if self._plan is None or self._key != key:
            self._costs, self._key = self.profiler.costs(), key
            self._plan = _auto_plan(self._costs, num_devices, num_microbatches, self.budgets)
            self.replans += 1
        return self._plan

    def plan(self, num_devices: int, num_microbatches: int) -> Plan:
        """The plan for a call starting now; re-plans when measurements warrant it."""
        key = (num_devices, num_microbatches)
        if self._plan is None or self._key != key:
            return self.current(*key)
        self._calls_since_check += 1
        if self._calls_since_check < self._interval:
            return self._plan
        self._calls_since_check = 0
        costs = self.profiler.costs()
        if not should_replan(self._costs, costs):
            return self._plan
        self._costs = costs
        candidate = _auto_plan(costs, num_devices, num_microbatches, self.budgets)
        if candidate != self._plan and self._predict(candidate, costs, key) < (
            1 - MIN_GAIN
        ) * self._predict(self._plan, costs, key):
            self._plan = candidate
            self.replans += 1
            self._interval = 1
        else:
            self._interval = min(2 * self._interval, MAX_INTERVAL)
        return self._plan

    @staticmethod
    def _predict(plan: Plan, costs: LayerCosts, key: tuple[int, int]) -> float:
        num_devices, num_microbatches = key
        return predict_iteration_time(
            plan, costs, num_devices, num_microbatches, round_size=num_microbatches
        )


def _auto_plan(costs, num_devices: int, num_microbatches: int, budgets) -> Plan:
    """The partitioner's choice for calls as the runtime runs them: every job of a call
    takes all of its microbatches, so a call is one round of ``num_microbatches``."""
    return auto_plan(costs, num_devices, num_microbatches, budgets, round_size=num_microbatches)
