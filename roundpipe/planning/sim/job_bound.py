"""A lower bound on each iteration's end from a job-level relaxation of the schedule.

Three times per job (weights home, first output, last compute end) under constraints
the op graph implies, so each time is at most the simulated one, at a few operations
per job instead of several per microbatch: the planner rules out most plans with it
before simulating them (docs/design.md#lower-bounds).
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate

from ...core.plan import Plan
from .costs import CostModel
from .rounds import round_sizes

FORWARD, FUSED, BACKWARD = 0, 1, 2


class JobCosts:
    """A cost model's per-layer costs as prefix sums: each job's times in a few steps."""

    def __init__(self, costs: CostModel) -> None:
        layers = costs.layers
        self.costs = costs
        self.forward = list(accumulate(layers.forward, initial=0.0))
        self.backward = list(accumulate(layers.backward, initial=0.0))
        self.recompute = list(accumulate(layers.recompute, initial=0.0))
        self.bytes = list(accumulate(layers.param_bytes, initial=0))

    def jobs(self, plan: Plan) -> tuple[list[tuple], int]:
        """Per job of a round: kind, compute (forward, fused or recompute), backward,
        weight upload, input hop, gradient download, optimizer step, and the backward
        stage (its step) holding the job's first layer; and the number of forward jobs."""
        fwd, bwd, rec, size = self.forward, self.backward, self.recompute, self.bytes
        total = size[-1]
        num_layers = len(fwd) - 1
        backward = plan.backward_ranges()
        starts = [r.start for r in reversed(backward)]  # ascending
        jobs = []
        for r in plan.forward_ranges():
            q = len(backward) - bisect_right(starts, r.start)
            jobs.append(
                self._job(FORWARD, r, fwd[r.stop] - fwd[r.start], 0.0, q, total, num_layers)
            )
        for q, r in enumerate(backward):
            kind = FUSED if q == 0 else BACKWARD
            if kind == FUSED:
                a, b = (fwd[r.stop] - fwd[r.start]) + (bwd[r.stop] - bwd[r.start]), 0.0
            else:
                a, b = rec[r.stop] - rec[r.start], bwd[r.stop] - bwd[r.start]
            jobs.append(self._job(kind, r, a, b, q, total, num_layers))
        return jobs, len(plan.forward)

    def _job(self, kind, r, a, b, q, total, num_layers) -> tuple:
        costs = self.costs
        nbytes = self.bytes[r.stop] - self.bytes[r.start]
        grads = step = 0.0
        if kind != FORWARD:
            grads = costs.download_time(nbytes * costs.grad_bytes_ratio)
            share = nbytes / total if total else len(r) / num_layers
            step = costs.optimizer_time * share
        comm_in = 0.0 if r.start == 0 else costs.comm
        return (kind, a, b, costs.upload_time(nbytes), comm_in, grads, step, q)


def relaxed_iteration_ends(
    plan: Plan,
    costs: JobCosts,
    num_devices: int,
    num_microbatches: int,
    iterations: int,
    *,
    round_size: int,
    is_async: bool,
) -> list[float]:
    """Lower bounds on ``Simulation.iteration_ends`` (devices from 0), iteration by
    iteration."""
    return _relaxed(plan, costs, num_devices, num_microbatches, iterations, round_size, is_async)[0]


def relaxed_isolated_time(
    plan: Plan, costs: JobCosts, num_devices: int, num_microbatches: int, *, round_size: int
) -> float:
    """A lower bound on :func:`roundpipe.planning.sim.walk.isolated_time`: one iteration
    from idle and its synchronous step (each time here is at most the simulated one,
    the host optimizer's and the downloads' too)."""
    ends, host, downloads = _relaxed(
        plan, costs, num_devices, num_microbatches, 1, round_size, False
    )
    return max(ends[0], host, downloads)


def _relaxed(
    plan: Plan,
    costs: JobCosts,
    num_devices: int,
    num_microbatches: int,
    iterations: int,
    round_size: int,
    is_async: bool,
) -> tuple[list[float], float, float]:
    """The relaxed iteration ends, the host optimizer's last step end and the last
    gradient download's end."""
    jobs, num_forward = costs.jobs(plan)
    n, comm = num_devices, costs.costs.comm
    sizes = round_sizes(num_microbatches, round_size)
    cfree, wfree, dfree = [0.0] * n, [0.0] * n, [0.0] * n  # compute, weights, downloads
    before = [0.0] * n  # per device: the release of the job before the last one on it
    steps: list[list[float]] = []
    host = loss = 0.0
    ends: list[float] = []
    x = 0
    back = 2 if is_async else 1  # the step whose weights an iteration reads
    for iteration in range(iterations):
        steps.append([0.0] * (len(jobs) - num_forward))
        # steps run in job order, so the last one a job's layers need is the step of
        # the backward stage holding its first layer
        stale = steps[iteration - back] if iteration >= back else None
        end = 0.0
        for k, size in enumerate(sizes):
            gate = loss
            if k == 0 and stale is not None and not is_async:
                gate = max(gate, *stale)
            first = last = gate  # the previous job's first output and last compute end
            step_round = k == len(sizes) - 1
            for p, (kind, a, b, upload, comm_in, grads, step, q) in enumerate(jobs):
                d = x % n
                ready = gate if gate > wfree[d] else wfree[d]
                if before[d] > ready:  # the job two back on the device released it
                    ready = before[d]
                if stale is not None and stale[q] > ready:
                    ready = stale[q]
                weights = wfree[d] = ready + upload
                start = cfree[d] if cfree[d] > weights else weights
                if kind == BACKWARD:  # the recompute needs no gradient
                    arrives = first + comm
                    head = start + a
                    if arrives > head:
                        head = arrives
                    first = head + b
                    job_end = first + (size - 1) * (a + b)
                    tail = last + comm + b
                else:
                    arrives = first + comm_in if p else gate
                    if arrives > start:
                        start = arrives
                    first = start + a
                    job_end = start + size * a
                    tail = last + comm_in + a if p else 0.0
                if tail > job_end:
                    job_end = tail
                last = job_end
                release = job_end if job_end > gate else gate
                before[d] = cfree[d]
                cfree[d] = release
                if job_end > end:
                    end = job_end
                if kind != FORWARD:
                    done = (dfree[d] if dfree[d] > release else release) + grads
                    dfree[d] = done
                    if step_round:
                        host = (host if host > done else done) + step
                        steps[iteration][p - num_forward] = host
                    if kind == FUSED:
                        loss = job_end
                x += 1
        ends.append(end)
    return ends, host, max(dfree)
