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

from .. import program as P
from ..keys import Activation, HandoffKey, Loss
from ..plan import Plan
from ..program import CallShape, DeviceOp, JobProgram, job_program, plan_chunks, recompute_inputs
from ..schedule import Job, JobKind, Schedule, lower
from ..timeline import HOST, Timeline
from . import engine
from .costs import CostModel
from .engine import ACT_H2D, COMPUTE, D2H, H2D, OPTIMIZER, Dep, Op
from .result import SimResult, bubbles, busy_time, compute_makespan, peak_memory

STEADY_ITERATIONS = 4
"""Iterations simulated to measure the steady state (the first ones are warm-up)."""


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
    spans = [s for s in engine.spans(single.ops, timings) if s.kind not in _BOOKKEEPING]
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
    """Builds the op list of successive rounds and iterations from the jobs' programs."""

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
        saved = recompute_inputs(schedule, "stage", forward_only=False, deferred=False)
        shape = CallShape(size, "stage", saved, preserve_rng_state=False, return_outputs=False)
        producers: dict[HandoffKey, Hashable] = {}
        for job in schedule.jobs:
            chunks = self._chunks(job)
            program = job_program(job, shape, len(chunks), has_buffers=False, writes_back=False)
            self._add_program(program, chunks, round_id, iteration, gate, producers, last)
        self._loss_key = producers[Loss(size - 1)]

    def _chunks(self, job: Job) -> list[int]:
        """Bytes of each weight chunk of ``job`` (at least one chunk, maybe empty)."""
        sizes = [self.config.costs.layers.param_bytes[i] for i in job.layers]
        chunks = plan_chunks(sizes, [1] * len(sizes), self.config.costs.weight_chunk_bytes)
        return [sum(end - first for _, first, end in chunk) for chunk in chunks] or [0]

    def _round_gate(self, iteration: int, first: bool) -> tuple[Dep, ...]:
        """What the host waits for before it dispatches this round."""
        gate = [Dep(self._loss_key)] if self._loss_key is not None else []
        if first and not self.config.is_async and iteration > 0:
            gate += [Dep(key) for _, key in self._optimizer_ops.get(iteration - 1, [])]
        return tuple(gate)

    def _add_program(
        self,
        program: JobProgram,
        chunks: list[int],
        round_id: int,
        iteration: int,
        gate: tuple[Dep, ...],
        producers: dict[HandoffKey, Hashable],
        last: bool,
    ) -> None:
        job, ops = program.job, program.ops
        keys = [(round_id, job.index, op.index) for op in ops]
        for op in ops:
            deps = [Dep(keys[i], transfer=ops[i].stream != P.COMPUTE) for i in op.inputs]
            if op.host_wait is not None:
                deps.append(Dep(keys[op.host_wait]))
            if op.key is not None and op.key in producers:
                deps.append(Dep(producers[op.key]))
            if op.kind == P.UPLOAD_WEIGHTS and op.chunk == 0:
                deps += self._weight_deps(job, iteration)
            if not op.inputs:
                deps += gate
            kind, label = self._name(op, job, round_id)
            # weights and activations share the device's host-to-device copy engine;
            # activations go first when both wait (the runtime gates weight chunks)
            engine_ = ("h2d", job.device) if op.stream in _H2D_STREAMS else None
            self.ops.append(
                Op(
                    keys[op.index],
                    job.device,
                    _STREAMS[op.stream],
                    kind,
                    label,
                    self._duration(op, job, chunks),
                    tuple(deps),
                    resource=engine_,
                    priority=int(op.stream == P.WEIGHT_UPLOAD),
                )
            )
            if op.kind == P.DOWNLOAD_VALUE:
                producers[op.key] = keys[op.index]
            for key in op.posts:
                producers[key] = keys[op.index]
            if op.kind in P.COMPUTES:
                self._compute_keys.setdefault(iteration, []).append(keys[op.index])
            if op.kind == P.DOWNLOAD_GRADS and last:
                self._add_optimizer(job, iteration, keys[op.index])
        self._add_memory(program, keys)
        self._done_keys.setdefault(job.device, []).append(keys[-1])

    def _weight_deps(self, job: Job, iteration: int) -> list[Dep]:
        """A stage's weights are allocated once the job two back on the device finished,
        and (asynchronous optimizer) read the weights updated two steps back."""
        deps = []
        done = self._done_keys.get(job.device, [])
        if len(done) >= 2:
            deps.append(Dep(done[-2]))
        stale_step = iteration - 2 if self.config.is_async else iteration - 1
        for layers, opt_key in self._optimizer_ops.get(stale_step, []):
            if set(layers) & set(job.layers):
                deps.append(Dep(opt_key))
        return deps

    def _duration(self, op: DeviceOp, job: Job, chunks: list[int]) -> float:
        costs = self.config.costs
        layers = costs.layers
        if op.kind == P.UPLOAD_WEIGHTS:
            return costs.upload_time(chunks[op.chunk])
        if op.kind in (P.UPLOAD_INPUT, P.UPLOAD_GRAD):
            from_caller = isinstance(op.key, Activation) and op.key.layer == 0
            return 0.0 if from_caller else costs.comm  # a hop: device -> host -> device
        if op.kind == P.DOWNLOAD_GRADS:
            return costs.download_time(
                layers.stage_param_bytes(job.layers) * costs.grad_bytes_ratio
            )
        compute = {
            P.FORWARD: layers.stage_forward,
            P.RECOMPUTE: layers.stage_recompute,
            P.BACKWARD: layers.stage_backward,
            P.FUSED: lambda r: layers.stage_forward(r) + layers.stage_backward(r),
        }.get(op.kind)
        return compute(op.layers) if compute is not None else 0.0

    def _add_memory(self, program: JobProgram, keys: list[Hashable]) -> None:
        """Weights from their upload to the release; gradients from the first backward
        compute to their download; each compute op's working activations."""
        job, layers = program.job, self.config.costs.layers
        weights = layers.stage_param_bytes(job.layers)
        self._memory.append((job.device, keys[0], keys[-1], weights))
        computes = [op for op in program.ops if op.kind in P.COMPUTES]
        for op in computes:
            if op.kind == P.FORWARD:
                working = max(layers.activation_bytes[i] for i in op.layers)
                self._memory.append((job.device, keys[op.index], keys[op.index], working))
            elif op.kind == P.FUSED:
                working = layers.stage_activation_bytes(op.layers)
                self._memory.append((job.device, keys[op.index], keys[op.index], working))
            elif op.kind == P.BACKWARD:
                graph = op.inputs[0] if program.ops[op.inputs[0]].kind == P.RECOMPUTE else op.index
                working = layers.stage_activation_bytes(op.layers)
                self._memory.append((job.device, keys[graph], keys[op.index], working))
        if job.kind is not JobKind.FORWARD:
            grads = int(weights * self.config.costs.grad_bytes_ratio)
            download = next(op for op in program.ops if op.kind == P.DOWNLOAD_GRADS)
            self._memory.append((job.device, keys[computes[0].index], keys[download.index], grads))

    def _name(self, op: DeviceOp, job: Job, round_id: int) -> tuple[str, str]:
        """Span kind and label: compute ops by their kind; weight chunks "upload", the
        gradient download "download", other transfers by their program kind."""
        if op.kind in P.COMPUTES:
            return op.kind, f"{job} mb{op.microbatch} r{round_id}"
        kind = {P.UPLOAD_WEIGHTS: "upload", P.DOWNLOAD_GRADS: "download"}.get(op.kind, op.kind)
        where = f" mb{op.microbatch}" if op.microbatch is not None else ""
        return kind, f"{job} {op.kind}{where} r{round_id}"

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

    def _add(self, key, device, stream, kind, label, duration, deps) -> None:
        self.ops.append(Op(key, device, stream, kind, label, duration, tuple(deps)))


_BOOKKEEPING = frozenset({P.TAKE_BUFFERS, P.TAKE_GRADS, P.RELEASE})
"""Zero-time ops that order the program but are left out of timelines."""

_H2D_STREAMS = frozenset({P.WEIGHT_UPLOAD, P.ACT_UPLOAD})

_STREAMS = {
    P.WEIGHT_UPLOAD: H2D,
    P.ACT_UPLOAD: ACT_H2D,
    P.COMPUTE: COMPUTE,
    P.DOWNLOAD: D2H,
}
