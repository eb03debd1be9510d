"""Lower bounds on a plan's steady-state iteration time, or on one isolated iteration
(pure arithmetic, no simulation).

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
from .job_bound import JobCosts, relaxed_isolated_time, relaxed_iteration_ends
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
        isolated: bool = False,
    ) -> None:
        """``isolated``: bound one iteration from idle with a synchronous step (the
        makespan objective, :func:`~roundpipe.planning.sim.walk.isolated_time`) instead
        of the steady state; every steady-state bound holds for it too, and it adds the
        first upload, the last microbatch's way back and the last step. On a mixed pool
        every device is bounded as the fastest (:meth:`CostModel.fastest`), except for
        a placed plan's own load on each device."""
        self.device_costs = costs
        costs = costs.fastest()
        layers = costs.layers
        self.costs, self.num_devices, self.num_microbatches = costs, num_devices, num_microbatches
        self.round_size, self.is_async = round_size or num_devices, is_async
        self.isolated = isolated
        self.n = layers.num_layers
        self.comm = costs.comm
        self.rounds = round_sizes(num_microbatches, round_size or num_devices)
        # the steps run one at a time: the async steady state and an isolated iteration
        # (which ends with its whole step) last at least that long
        self.optimizer = costs.optimizer_time if is_async or isolated else 0.0
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
        """No schedule of ``plan`` has a shorter steady-state iteration (``isolated``:
        a shorter isolated one)."""
        stages = []
        start = 0
        for size in plan.forward:
            stages.append(sum(self.forward[start : start + size]))
            start += size
        hops = len(plan.forward) if start > 0 else 0
        fused = sum(self.fused_times[start:])
        chain = self._chain(stages, fused, hops)
        if self.isolated:
            chain = max(chain, self._isolated_path(plan, stages, fused, hops))
        return max(self._work[plan.backward[0] - 1], chain, self._placed_load(plan))

    def _placed_load(self, plan: Plan) -> float:
        """A placed plan runs job j on device j mod N in every iteration: no iteration is
        shorter than the compute of the busiest device's jobs, timed on that device."""
        if not plan.placed:
            return 0.0
        loads = [0.0] * self.num_devices
        timed = [costs.jobs(plan)[0] for costs in self._device_jobs]  # per device, every job
        for j in range(len(timed[0])):
            device = j % self.num_devices
            _, compute, backward, *_ = timed[device][j]
            loads[device] += compute + backward
        return self.num_microbatches * max(loads)

    @cached_property
    def _device_jobs(self) -> list[JobCosts]:
        """Each device's job times (its own layer costs on a mixed pool)."""
        return [JobCosts(self.device_costs.on_device(d)) for d in range(self.num_devices)]

    @cached_property
    def _jobs(self) -> JobCosts:
        return JobCosts(self.costs)

    def tight(self, plan: Plan) -> float:
        """:meth:`of`, and the job-level relaxation's steady state (no long run of ``plan``
        is faster: each of its iterations ends no later than the simulated one). The
        relaxation moves the cursor on, so a placed plan has only :meth:`of`."""
        if plan.placed:
            return self.of(plan)
        if self.isolated:
            relaxed = relaxed_isolated_time(
                plan,
                self._jobs,
                self.num_devices,
                self.num_microbatches,
                round_size=self.round_size,
            )
            return max(self.of(plan), relaxed)
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
        return max(self._flow(stages, fused, hops), self.optimizer)

    def _flow(self, stages: list[float], fused: float, hops: int) -> float:
        """The rounds' loss chains: each round's microbatches through the forward stages
        into the fused one as through a flow shop, the next round after the last loss."""
        first = sum(stages) + fused + hops * self.comm
        slowest = max([fused, *stages])
        return sum(first + (size - 1) * slowest for size in self.rounds)

    def _isolated_path(self, plan: Plan, stages: list[float], fused: float, hops: int) -> float:
        """From idle: the first job's weights upload before its first compute; the rounds'
        loss chains follow; then the last microbatch's gradient runs back through every
        backward stage (a hop and the stage's backward each: the recompute need not wait),
        and the last stage's gradients download and are stepped."""
        costs, layers = self.costs, self.costs.layers
        first = (plan.forward_ranges() or plan.backward_ranges())[0]
        path = costs.upload_time(layers.stage_param_bytes(first))
        path += self._flow(stages, fused, hops)
        backward = plan.backward_ranges()
        path += sum(self.comm + layers.stage_backward(r) for r in backward[1:])
        last = backward[-1]
        nbytes, total = layers.stage_param_bytes(last), sum(layers.param_bytes)
        share = nbytes / total if total else len(last) / self.n
        return (
            path
            + costs.download_time(nbytes * costs.grad_bytes_ratio)
            + (costs.optimizer_time * share)
        )
