"""Keeps the automatic plan in step with measured costs, without thrashing.

The planner asks a callable for the costs measured so far (the runtime passes its
profiler's ``cost_model``). Plans are scored with every cost measured: per-layer compute, the link's
bandwidth in each direction (weight uploads in the call's chunk size) and the time an
activation takes to hop between stages; with memory budgets, plans must fit them with
the activation bytes per microbatch measured at each layer's input. The partitioner runs
again only when measurements moved materially since the last time it ran
(:func:`devices_moved` for the layers, :func:`link_moved` for the link,
:func:`activations_moved` under budgets), and its new choice replaces the current plan only
if the simulator predicts it to be clearly faster under the new measurements (or the
current plan no longer fits the memory budgets), so near-ties measured with noise do not
make the plan flip back and forth. While the
plan keeps standing, checks become rarer (every 1, 2, 4, ... calls), so noisy
measurements of tiny layers do not cost a partitioner run on every call.

A re-plan runs on a daemon thread, off the caller's: calls keep the plan in force
until it is done, and its choice takes effect at the first call boundary after that.
Only the very first plan (or the first for a new device or microbatch count, or step
mode) is chosen on the caller's thread, since a call needs one.

Plans minimise what the steps make of an iteration (:meth:`AutoPlanner.saw_step`):
asynchronous steps overlap iterations, so the steady state (the default, until a step
says otherwise); a synchronous step makes each iteration stand alone, so its makespan.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

from ..core.plan import Plan
from .partition import auto_plan, fits, predict_iteration_time, should_replan, step_objective
from .sim.costs import CostModel

MIN_GAIN = 0.05
"""A new plan must be predicted at least this much faster to replace the current one."""
MAX_INTERVAL = 64
"""Calls between checks grow (doubling) up to this while the plan keeps standing."""
LINK_THRESHOLD = 0.15
"""A bandwidth or hop time must move by this fraction of itself to warrant a re-plan."""


class AutoPlanner:
    def __init__(
        self, measure: Callable[[int | None], CostModel], budgets: Sequence[int] | None
    ) -> None:
        """``measure(weight_chunk_bytes)``: the costs measured so far, weights priced as
        uploads in chunks of that size; ``budgets``: device memory per device (None:
        unbounded)."""
        self.measure = measure
        self.budgets = list(budgets) if budgets is not None else None
        self.replans = 0
        self._plan: Plan | None = None
        self._costs: CostModel | None = None
        self._key: tuple[int, int, int | None, str] | None = None
        self.objective = "steady"
        """What plans minimise: ``"steady"`` (asynchronous steps, and before any step)
        or ``"makespan"`` (synchronous steps); see :meth:`saw_step`."""
        self._interval = 1
        self._calls_since_check = 0
        self._replan: _Background | None = None

    @property
    def costs(self) -> CostModel | None:
        """The measurements the last partitioner run planned with (None before the first)."""
        return self._costs

    def saw_step(self, is_async: bool) -> None:
        """A step was queued: later calls are planned for its mode (a change of mode
        re-plans at the next call, on the caller's thread)."""
        self.objective = step_objective(is_async)

    def current(
        self, num_devices: int, num_microbatches: int, weight_chunk_bytes: int | None
    ) -> Plan:
        """The plan in force, without counting a call (a first plan is chosen if needed).
        ``weight_chunk_bytes`` is the run config's: weights upload in chunks of it."""
        key = (num_devices, num_microbatches, weight_chunk_bytes, self.objective)
        if self._plan is None or self._key != key:
            self._costs, self._key = self.measure(weight_chunk_bytes), key
            self._plan = _auto_plan(self._costs, key, self.budgets)
            self.replans += 1
        return self._plan

    def plan(self, num_devices: int, num_microbatches: int, weight_chunk_bytes: int | None) -> Plan:
        """The plan for a call starting now; starts a re-plan in the background when
        measurements warrant it, and adopts a finished one's choice."""
        key = (num_devices, num_microbatches, weight_chunk_bytes, self.objective)
        if self._plan is None or self._key != key:
            self._replan = None  # chosen for another pool, microbatch count or step mode
            return self.current(num_devices, num_microbatches, weight_chunk_bytes)
        if self._replan is not None:
            if self._replan.done.is_set():
                self._adopt(self._replan.result)
                self._replan = None
            return self._plan
        self._calls_since_check += 1
        if self._calls_since_check < self._interval:
            return self._plan
        self._calls_since_check = 0
        costs = self.measure(weight_chunk_bytes)
        assert self._costs is not None
        moved = devices_moved(self._costs, costs, num_devices) or link_moved(self._costs, costs)
        if not (moved or (self.budgets is not None and activations_moved(self._costs, costs))):
            return self._plan
        self._costs = costs
        current, budgets = self._plan, self.budgets
        self._replan = _Background(lambda: _better_plan(costs, key, current, budgets))
        return self._plan

    def _adopt(self, better: Plan | None) -> None:
        if better is not None:
            self._plan = better
            self.replans += 1
            self._interval = 1
        else:
            self._interval = min(2 * self._interval, MAX_INTERVAL)


class _Background:
    """``fn()`` on a daemon thread (a re-plan may take seconds on a deep model; it must
    not hold up the process's exit). A failure leaves ``result`` ``None``: the plan in
    force was valid when chosen and stays."""

    def __init__(self, fn: Callable[[], Plan | None]) -> None:
        self.done = threading.Event()
        self.result: Plan | None = None
        threading.Thread(target=self._run, args=(fn,), name="roundpipe-replan", daemon=True).start()

    def _run(self, fn: Callable[[], Plan | None]) -> None:
        try:
            self.result = fn()
        except Exception:  # noqa: BLE001 - e.g. no plan fits the new measurements
            self.result = None
        finally:
            self.done.set()


def devices_moved(old: CostModel, new: CostModel, num_devices: int) -> bool:
    """Whether some device's layer times moved enough to re-plan (``should_replan``
    device by device: on a mixed pool each class is measured on its own, and a pool
    that turns out mixed, or no longer, re-plans)."""
    if old.mixed != new.mixed:
        return True
    return any(
        should_replan(old.layers_on(d), new.layers_on(d))
        for d in (range(num_devices) if new.mixed else [0])
    )


def link_moved(old: CostModel, new: CostModel, threshold: float = LINK_THRESHOLD) -> bool:
    """Whether a link bandwidth or the activation hop time moved by more than
    ``threshold`` of its old value (a first measurement, from infinite or zero, counts)."""
    pairs = (
        (old.h2d_bandwidth, new.h2d_bandwidth),
        (old.d2h_bandwidth, new.d2h_bandwidth),
        (old.comm, new.comm),
    )
    return any(_moved(before, after, threshold) for before, after in pairs)


def activations_moved(old: CostModel, new: CostModel, threshold: float = LINK_THRESHOLD) -> bool:
    """Whether some layer's activation bytes per microbatch (what the memory fit counts)
    moved by more than ``threshold`` of the old value (a first measurement counts)."""
    pairs = zip(old.layers.activation_bytes, new.layers.activation_bytes, strict=True)
    return any(_moved(float(before), float(after), threshold) for before, after in pairs)


def _moved(before: float, after: float, threshold: float) -> bool:
    if before == after:
        return False
    if before in (0.0, math.inf) or after == math.inf:
        return True
    return abs(after - before) > threshold * before


def _better_plan(
    costs: CostModel, key: tuple[int, int, int | None, str], current: Plan, budgets
) -> Plan | None:
    """The partitioner's choice under ``costs`` if it is predicted clearly faster than
    ``current`` or ``current`` no longer fits the budgets, else ``None``."""
    candidate = _auto_plan(costs, key, budgets)
    if candidate == current:
        return None
    if not fits(current, costs, budgets):
        return candidate
    if _predict(candidate, costs, key) < (1 - MIN_GAIN) * _predict(current, costs, key):
        return candidate
    return None


def _predict(plan: Plan, costs: CostModel, key: tuple[int, int, int | None, str]) -> float:
    num_devices, num_microbatches, _, objective = key
    return predict_iteration_time(
        plan, costs, num_devices, num_microbatches, round_size=num_microbatches, objective=objective
    )


def _auto_plan(costs: CostModel, key: tuple[int, int, int | None, str], budgets) -> Plan:
    """The partitioner's choice for calls as the runtime runs them: every job of a call
    takes all of its microbatches, so a call is one round of ``num_microbatches``."""
    num_devices, num_microbatches, _, objective = key
    return auto_plan(
        costs,
        num_devices,
        num_microbatches,
        budgets,
        round_size=num_microbatches,
        objective=objective,
    )
