"""Lower bounds on a plan's steady-state iteration time (pure arithmetic, no simulation).

The planner simulates candidates in the order of these bounds and skips any whose bound
cannot beat the best simulated so far, so it finds the same plan as simulating every
candidate with far fewer simulations. The bounds (work, chain, optimizer, jobs) and
``floor`` are stated in docs/design.md#lower-bounds.
"""

from __future__ import annotations

from functools import cached_property
from itertools import accumulate

from ...core.plan import Plan
from .costs import CostModel
from .job_bound import JobCosts, relaxed_iteration_ends
from .rounds import round_sizes

RELAXED_WARMUP = 3
RELAXED_MEASURED = 12
"""The job-level relaxation is averaged over 12 iterations after 3 (cycles of 1, 2, 3, 4
and 6 iterations average out exactly); it is cheap enough to run long."""


class PlanBounds:
    def __init__(
        self,
        costs: CostModel,
        num_devices: int,
        num_microbatches: int,
        *,
        round_size: int | None = None,
        is_async: bool = True,
    ) -> None:
        layers = costs.layers
        self.costs, self.num_devices, self.num_microbatches = costs, num_devices, num_microbatches
        self.round_size, self.is_async = round_size or num_devices, is_async
        self.n = layers.num_layers
        self.comm = costs.comm
        self.rounds = round_sizes(num_microbatches, round_size or num_devices)
        self.optimizer = costs.optimizer_time if is_async else 0.0
        self.forward = layers.forward
        self.fused_times = [f + b for f, b in zip(layers.forward, layers.backward, strict=True)]
        compute = sum(layers.forward) + sum(layers.backward)
        recompute_prefix = list(accumulate(layers.recompute, initial=0.0))
        self._work = [  # by fused size - 1
            num_microbatches * (compute + recompute_prefix[self.n - fused]) / num_devices
            for fused in range(1, self.n + 1)
        ]

    @cached_property
    def floor(self) -> float:
        """The least bound of any plan (quadratic in the layers: only the search needs it)."""
        return min(self.fused_floor(f) for f in range(1, self.n + 1))

    def work(self, fused: int) -> float:
        """The work bound of any plan whose fused stage has ``fused`` layers (the layers
        below it are recomputed)."""
        return self._work[fused - 1]

    @property
    def least_work(self) -> float:
        """The work bound of the plan with the least compute (the largest fused stage)."""
        return min(self._work)

    def of(self, plan: Plan) -> float:
        """No schedule of ``plan`` has a shorter steady-state iteration."""
        stages = []
        start = 0
        for size in plan.forward:
            stages.append(sum(self.forward[start : start + size]))
            start += size
        hops = len(plan.forward) if start > 0 else 0
        fused = sum(self.fused_times[start:])
        return max(self._work[plan.backward[0] - 1], self._chain(stages, fused, hops))

    @cached_property
    def _jobs(self) -> JobCosts:
        return JobCosts(self.costs)

    def tight(self, plan: Plan) -> float:
        """:meth:`of`, and the job-level relaxation's steady state (no long run of ``plan``
        is faster: each of its iterations ends no later than the simulated one)."""
        warm, measured = RELAXED_WARMUP, RELAXED_MEASURED
        ends = relaxed_iteration_ends(
            plan,
            self._jobs,
            self.num_devices,
            self.num_microbatches,
            warm + measured,
            round_size=self.round_size,
            is_async=self.is_async,
        )
        return max(self.of(plan), (ends[-1] - ends[warm - 1]) / measured)

    def fused_floor(self, fused: int) -> float:
        """The least bound of any plan whose fused stage has ``fused`` layers."""
        start = self.n - fused
        stages = list(self.forward[:start])  # one layer per forward stage
        hops_free = 0  # a hop costs ``comm``; with fewer stages there are fewer hops
        return max(
            self._work[fused - 1],
            self._chain(stages, sum(self.fused_times[start:]), hops_free),
        )

    def _chain(self, stages: list[float], fused: float, hops: int) -> float:
        first = sum(stages) + fused + hops * self.comm
        slowest = max([fused, *stages])
        chain = sum(first + (size - 1) * slowest for size in self.rounds)
        return max(chain, self.optimizer)
