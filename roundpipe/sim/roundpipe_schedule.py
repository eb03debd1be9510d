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

import gc
from collections.abc import Hashable
from contextlib import contextmanager
from dataclasses import dataclass, field

from .. import program as P
from ..keys import Activation, HandoffKey, Loss
from ..plan import Plan
from ..program import CallShape, DeviceOp, JobProgram, job_program, plan_chunks, recompute_inputs
from ..schedule import Job, JobKind, Schedule, lower
from ..timeline import HOST, Timeline
from . import engine
from .bounds import PlanBounds
from .costs import CostModel
from .engine import ACT_H2D, COMPUTE, D2H, H2D, OPTIMIZER, Dep, Op
from .result import SimResult, bubbles, busy_time, compute_makespan, peak_memory

WARMUP_ITERATIONS = 3
MEASURED_ITERATIONS = 4
"""The steady state is the mean of the iterations after the warm-up ones. The cost
model treats devices alike, so a cursor that moved on only relabels the devices and
iterations soon repeat, alone or in short cycles (two and four iterations are seen);
a test checks the estimate against long runs. A host optimizer slower than the
devices makes a backlog that grows for many iterations before it binds, so the
asynchronous steady state is at least the optimizer's time per step."""


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
    with _gc_paused():
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
    config = _Config(plan, costs, num_devices, round_size, is_async, record=False)
    sim = _Simulation(config)
    warm, measured = WARMUP_ITERATIONS, MEASURED_ITERATIONS
    with _gc_paused():
        ends = sim.iteration_ends(num_microbatches, warm + measured)
    mean = (ends[-1] - ends[warm - 1]) / measured
    bounds = PlanBounds(
        costs, num_devices, num_microbatches, round_size=round_size, is_async=is_async
    )
    return max(mean, bounds.of(plan))


@contextmanager
def _gc_paused():
    """A simulation allocates many small tuples that all stay alive until it ends, so
    the cyclic collector would only rescan them (it took half the time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class _Config:
    plan: Plan
    costs: CostModel
    num_devices: int
    round_size: int
    is_async: bool
    record: bool = True
    """Label ops and record memory (for timelines); scoring needs neither."""


class _Template:
    """A job program with each op's duration and its waits on earlier ops of the job
    (op index, whether the wait is on a transfer)."""

    __slots__ = ("program", "durations", "deps")

    def __init__(self, program: JobProgram, durations: list[float]) -> None:
        self.program = program
        self.durations = durations
        ops = program.ops
        self.deps = [
            tuple((i, ops[i].stream != P.COMPUTE) for i in op.inputs)
            + (((op.host_wait, False),) if op.host_wait is not None else ())
            for op in ops
        ]


@dataclass
class _Simulation:
    """Builds the op list of successive rounds and iterations from the jobs' programs."""

    config: _Config
    ops: list[Op] = field(default_factory=list)
    _memory: list[tuple[int, Hashable, Hashable, int]] = field(default_factory=list)
    _done_keys: dict[int, list[Hashable]] = field(default_factory=dict)
    _optimizer_ops: dict[int, list[tuple[range, Hashable]]] = field(default_factory=dict)
    _compute_ops: dict[int, list[int]] = field(default_factory=dict)
    _templates: dict[tuple, _Template] = field(default_factory=dict)
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
        start = engine.replay(self.ops).start
        ops = self.ops
        return [
            max(start[i] + ops[i].duration for i in self._compute_ops[it])
            for it in range(iterations)
        ]

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
            template = self._template(job, shape)
            self._add_program(template, job, round_id, iteration, gate, producers, last)
        self._loss_key = producers[Loss(size - 1)]

    def _template(self, job: Job, shape: CallShape) -> _Template:
        """The job's program with durations, built once per stage and round shape (a
        program does not depend on the device or the job's place in the round)."""
        cache_key = (job.kind, job.layers, shape)
        template = self._templates.get(cache_key)
        if template is None:
            chunks = self._chunks(job)
            program = job_program(job, shape, len(chunks), has_buffers=False, writes_back=False)
            template = _Template(program, [self._duration(op, job, chunks) for op in program.ops])
            self._templates[cache_key] = template
        return template

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
        template: _Template,
        job: Job,
        round_id: int,
        iteration: int,
        gate: tuple[Dep, ...],
        producers: dict[HandoffKey, Hashable],
        last: bool,
    ) -> None:
        ops = template.program.ops
        keys = [(round_id, job.index, op.index) for op in ops]
        device, record = job.device, self.config.record
        copy_engine = ("h2d", device)
        compute_ops = self._compute_ops.setdefault(iteration, [])
        for op, duration, local in zip(ops, template.durations, template.deps, strict=True):
            deps = [Dep(keys[i], 0.0, transfer) for i, transfer in local]
            if op.key is not None:
                producer = producers.get(op.key)
                if producer is not None:
                    deps.append(Dep(producer))
            if op.chunk == 0:
                deps += self._weight_deps(job, iteration)
            if not op.inputs:
                deps += gate
            kind, label = self._name(op, job, round_id) if record else (op.kind, "")
            # weights and activations share the device's host-to-device copy engine;
            # activations go first when both wait (the runtime gates weight chunks)
            uploads = op.stream in _H2D_STREAMS
            key = keys[op.index]
            self.ops.append(
                Op(
                    key,
                    device,
                    _STREAMS[op.stream],
                    kind,
                    label,
                    duration,
                    tuple(deps),
                    copy_engine if uploads else None,
                    int(op.stream == P.WEIGHT_UPLOAD),
                )
            )
            if op.kind == P.DOWNLOAD_VALUE:
                producers[op.key] = key
            for handoff in op.posts:
                producers[handoff] = key
            if op.kind in P.COMPUTES:
                compute_ops.append(len(self.ops) - 1)
            elif op.kind == P.DOWNLOAD_GRADS and last:
                self._add_optimizer(job, iteration, key)
        if record:
            self._add_memory(template.program, job, keys)
        self._done_keys.setdefault(device, []).append(keys[-1])

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

    def _add_memory(self, program: JobProgram, job: Job, keys: list[Hashable]) -> None:
        """Weights from their upload to the release; gradients from the first backward
        compute to their download; each compute op's working activations."""
        layers = self.config.costs.layers
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
