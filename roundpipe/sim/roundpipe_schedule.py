"""Simulate RoundPipe by replaying the runtime's own lowered schedule.

One *round* is one ``roundpipe.schedule.lower(plan, N, cursor)`` job list run over
``R`` microbatches (default ``R = N``), exactly like one ``forward_backward`` call;
the next round continues the round-robin cursor. An iteration is as many rounds as
it takes to cover its microbatches, followed by the host optimizer step.

Per device, in job order:

- the stage's weights are uploaded on the device's host-to-device link, prefetched
  one job ahead: an upload waits until the job two before it on that device is done
  (weights freed, gradients downloaded), so a device holds at most two stages;
- a forward job runs microbatches ``0..R-1``, each after the previous stage's output
  for it arrived (``comm`` after it was produced);
- a backward job, per microbatch, recomputes from the saved stage input first (it
  needs no gradient), then waits for the incoming gradient and runs the backward;
- the fused job runs forward, loss and backward with no recompute;
- after a backward job's last microbatch its gradients are downloaded.

With the asynchronous optimizer the next round is dispatched as soon as this
round's loss is known, and an iteration's uploads only wait for the optimizer step
of two iterations before (weights are one step stale); the synchronous optimizer
holds the next iteration until the step is done.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

from ..plan import Plan
from ..schedule import Job, JobKind, Schedule, lower
from ..timeline import HOST, Timeline
from . import engine
from .costs import CostModel
from .engine import COMPUTE, D2H, H2D, OPTIMIZER, Dep, Op
from .result import SimResult, bubbles, busy_time, compute_makespan, peak_memory

STEADY_ITERATIONS = 4
"""Iterations simulated to measure the steady state (the first ones are warm-up)."""

_OUTPUT_OP = {JobKind.FORWARD: "f", JobKind.FUSED: "x", JobKind.BACKWARD: "b"}
"""Suffix of the op that produces a job's per-microbatch output."""


def round_sizes(num_microbatches: int, round_size: int) -> list[int]:
    """Microbatches per round: full rounds of ``round_size``, then the remainder."""
    if num_microbatches < 1 or round_size < 1:
        raise ValueError(
            f"need at least one microbatch and a round size of at least one, got "
            f"{num_microbatches} microbatches in rounds of {round_size}"
        )
    full, rest = divmod(num_microbatches, round_size)
    return [round_size] * full + ([rest] if rest else [])


def round_schedules(
    plan: Plan, num_devices: int, num_rounds: int, first_device: int = 0
) -> list[Schedule]:
    """The lowered schedule of each round, the cursor carried from round to round."""
    schedules, cursor = [], first_device
    for _ in range(num_rounds):
        schedule = lower(plan, num_devices, cursor)
        schedules.append(schedule)
        cursor = schedule.next_device
    return schedules


def simulate_roundpipe(
    plan: Plan,
    costs: CostModel,
    num_devices: int,
    num_microbatches: int,
    *,
    round_size: int | None = None,
    first_device: int = 0,
    is_async: bool = True,
) -> SimResult:
    """One iteration of RoundPipe, plus its steady-state iteration time."""
    plan.validate(costs.layers.num_layers)
    config = _Config(plan, costs, num_devices, round_size or num_devices, is_async)
    single = _Simulation(config)
    single.add_iterations(num_microbatches, 1, first_device)
    timings = engine.run(single.ops)
    spans = engine.spans(single.ops, timings)
    makespan = compute_makespan(spans)
    iteration_time = steady_iteration_time(
        plan,
        costs,
        num_devices,
        num_microbatches,
        round_size=round_size,
        is_async=is_async,
    )
    busy = busy_time(spans)
    return SimResult(
        schedule="roundpipe",
        num_devices=num_devices,
        makespan=makespan,
        busy=busy,
        bubbles=bubbles(spans, num_devices, makespan),
        exposed_comm=single.exposed_comm(timings),
        peak_memory=tuple(peak_memory(single.memory_intervals(timings), num_devices)),
        timeline=Timeline(spans),
        iteration_time=iteration_time,
        steady_bubble_ratio=max(0.0, 1.0 - busy / (num_devices * iteration_time)),
        detail=f"plan {plan}, rounds of {config.round_size}",
    )


def steady_iteration_time(
    plan: Plan,
    costs: CostModel,
    num_devices: int,
    num_microbatches: int,
    *,
    round_size: int | None = None,
    is_async: bool = True,
) -> float:
    """Seconds per iteration once iterations follow each other (the partitioner's objective)."""
    round_size = round_size or num_devices
    config = _Config(plan, costs, num_devices, round_size, is_async)
    sim = _Simulation(config)
    # Iteration times cycle with the round-robin cursor, so average over one whole
    # cursor period after the warm-up iterations.
    rounds = math.ceil(num_microbatches / round_size)
    advance = rounds * (len(plan.forward) + len(plan.backward)) % num_devices
    period = num_devices // math.gcd(advance, num_devices)
    warm = STEADY_ITERATIONS // 2
    ends = sim.iteration_ends(num_microbatches, warm + period)
    return (ends[-1] - ends[warm - 1]) / period


@dataclass(frozen=True)
class _Config:
    plan: Plan
    costs: CostModel
    num_devices: int
    round_size: int
    is_async: bool


@dataclass
class _Simulation:
    """Builds the op list of successive rounds and iterations."""

    config: _Config
    ops: list[Op] = field(default_factory=list)
    _memory: list[tuple[int, Hashable, Hashable, int]] = field(default_factory=list)
    _done_keys: dict[int, list[Hashable]] = field(default_factory=dict)
    _optimizer_ops: dict[int, list[tuple[range, Hashable]]] = field(default_factory=dict)
    _compute_keys: dict[int, list[Hashable]] = field(default_factory=dict)
    _loss_key: Hashable | None = None
    _rounds: int = 0

    def add_iterations(self, num_microbatches: int, iterations: int, first_device: int) -> None:
        sizes = round_sizes(num_microbatches, self.config.round_size)
        cursor = first_device
        for iteration in range(iterations):
            for index, size in enumerate(sizes):
                schedule = lower(self.config.plan, self.config.num_devices, cursor)
                self._add_round(schedule, iteration, size, index == 0, index == len(sizes) - 1)
                cursor = schedule.next_device

    def iteration_ends(self, num_microbatches: int, iterations: int) -> list[float]:
        self.add_iterations(num_microbatches, iterations, 0)
        timings = engine.run(self.ops)
        return [max(timings[key].end for key in self._compute_keys[it]) for it in range(iterations)]

    def exposed_comm(self, timings: dict[Hashable, engine.Timing]) -> float:
        return sum(timings[op.key].exposed_transfer for op in self.ops if op.stream == COMPUTE)

    def memory_intervals(self, timings: dict[Hashable, engine.Timing]) -> list:
        return [
            (device, timings[start].start, timings[end].end, size)
            for device, start, end, size in self._memory
        ]

    def _add_round(
        self, schedule: Schedule, iteration: int, size: int, first: bool, last: bool
    ) -> None:
        round_id = self._rounds
        self._rounds += 1
        gate = self._round_gate(iteration, first)
        for job in schedule.jobs:
            upload = self._add_upload(job, round_id, iteration, gate)
            self._add_compute(job, round_id, iteration, size, upload, gate)
            done = self._add_download(job, round_id, size, iteration, last)
            self._done_keys.setdefault(job.device, []).append(done)
        self._loss_key = (round_id, _fused_index(schedule), size - 1, "x")

    def _round_gate(self, iteration: int, first: bool) -> tuple[Dep, ...]:
        """What the host waits for before it dispatches this round."""
        gate = [Dep(self._loss_key)] if self._loss_key is not None else []
        if first and not self.config.is_async and iteration > 0:
            gate += [Dep(key) for _, key in self._optimizer_ops.get(iteration - 1, [])]
        return tuple(gate)

    def _add_upload(
        self, job: Job, round_id: int, iteration: int, gate: tuple[Dep, ...]
    ) -> Hashable:
        costs = self.config.costs
        key = (round_id, job.index, "upload")
        deps = list(gate)
        done = self._done_keys.get(job.device, [])
        if len(done) >= 2:  # at most two stages resident: wait for the one two jobs back
            deps.append(Dep(done[-2]))
        # Async: this iteration runs on weights one step stale, i.e. updated two steps back.
        stale_step = iteration - 2 if self.config.is_async else iteration - 1
        for layers, opt_key in self._optimizer_ops.get(stale_step, []):
            if set(layers) & set(job.layers):
                deps.append(Dep(opt_key))
        size = costs.layers.stage_param_bytes(job.layers)
        self._add(
            key,
            job.device,
            H2D,
            "upload",
            f"upload {job}",
            costs.upload_time(size),
            deps,
        )
        return key

    def _add_compute(
        self,
        job: Job,
        round_id: int,
        iteration: int,
        size: int,
        upload: Hashable,
        gate: tuple[Dep, ...],
    ) -> None:
        costs = self.config.costs
        layers = costs.layers
        weights_ready = Dep(upload, transfer=True)
        for mb in range(size):
            incoming = (
                (
                    Dep(
                        (round_id, job.input_from, mb, self._output_op(job.input_from)),
                        costs.comm,
                    ),
                )
                if job.input_from is not None
                else gate
            )
            name = f"{job} mb{mb} r{round_id}"
            if job.kind is JobKind.FORWARD:
                key = (round_id, job.index, mb, "f")
                duration = layers.stage_forward(job.layers)
                self._add(
                    key,
                    job.device,
                    COMPUTE,
                    "forward",
                    name,
                    duration,
                    [weights_ready, *incoming],
                )
                working = max(layers.activation_bytes[i] for i in job.layers)
                self._memory.append((job.device, key, key, working))
            elif job.kind is JobKind.FUSED:
                key = (round_id, job.index, mb, "x")
                duration = layers.stage_forward(job.layers) + layers.stage_backward(job.layers)
                self._add(
                    key,
                    job.device,
                    COMPUTE,
                    "fused",
                    name,
                    duration,
                    [weights_ready, *incoming],
                )
                self._memory.append(
                    (job.device, key, key, layers.stage_activation_bytes(job.layers))
                )
            else:
                saved = Dep((round_id, job.saved_input_from, mb, "f"), costs.comm)
                recompute = (round_id, job.index, mb, "r")
                key = (round_id, job.index, mb, "b")
                self._add(
                    recompute,
                    job.device,
                    COMPUTE,
                    "recompute",
                    name,
                    layers.stage_recompute(job.layers),
                    [weights_ready, saved],
                )
                self._add(
                    key,
                    job.device,
                    COMPUTE,
                    "backward",
                    name,
                    layers.stage_backward(job.layers),
                    incoming,
                )
                self._memory.append(
                    (
                        job.device,
                        recompute,
                        key,
                        layers.stage_activation_bytes(job.layers),
                    )
                )
                self._compute_keys.setdefault(iteration, []).append(recompute)
            self._compute_keys.setdefault(iteration, []).append(key)

    def _add_download(
        self, job: Job, round_id: int, size: int, iteration: int, last: bool
    ) -> Hashable:
        """Gradient download after a backward job; returns the key that frees the job's memory."""
        costs = self.config.costs
        weights = costs.layers.stage_param_bytes(job.layers)
        last_compute = (round_id, job.index, size - 1, _OUTPUT_OP[job.kind])
        upload = (round_id, job.index, "upload")
        if job.kind is JobKind.FORWARD:
            self._memory.append((job.device, upload, last_compute, weights))
            return last_compute
        key = (round_id, job.index, "download")
        grads = int(weights * costs.grad_bytes_ratio)
        duration = costs.download_time(grads)
        self._add(
            key,
            job.device,
            D2H,
            "download",
            f"grads {job}",
            duration,
            [Dep(last_compute)],
        )
        self._memory.append((job.device, upload, key, weights))
        first_compute = (
            round_id,
            job.index,
            0,
            "x" if job.kind is JobKind.FUSED else "r",
        )
        self._memory.append((job.device, first_compute, key, grads))
        if last:
            self._add_optimizer(job, iteration, key)
        return key

    def _add_optimizer(self, job: Job, iteration: int, download: Hashable) -> None:
        """The host optimizer updates a stage's layers once its last gradients are home."""
        costs = self.config.costs
        layers = costs.layers
        total_bytes = sum(layers.param_bytes)
        share = (
            layers.stage_param_bytes(job.layers) / total_bytes
            if total_bytes
            else len(job.layers) / layers.num_layers
        )
        key = (iteration, job.index, "optimizer")
        duration = costs.optimizer_time * share
        label = f"step {iteration} layers {job.layers.start}:{job.layers.stop}"
        self._add(key, HOST, OPTIMIZER, "optimizer", label, duration, [Dep(download)])
        self._optimizer_ops.setdefault(iteration, []).append((job.layers, key))

    def _output_op(self, job_index: int) -> str:
        """The per-microbatch op whose end is job ``job_index``'s output."""
        num_forward = len(self.config.plan.forward)
        if job_index < num_forward:
            return "f"
        return "x" if job_index == num_forward else "b"

    def _add(self, key, device, stream, kind, label, duration, deps) -> None:
        self.ops.append(Op(key, device, stream, kind, label, duration, tuple(deps)))


def _fused_index(schedule: Schedule) -> int:
    return next(j.index for j in schedule.jobs if j.kind is JobKind.FUSED)
