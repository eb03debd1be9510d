"""Successive RoundPipe rounds and iterations as one op graph for the engine.

Each job contributes its program (``roundpipe.core.program.job_program``, the one the
runtime executes) with a duration per op; this module adds what links programs
(handoffs, flow control, round dispatch, optimizer steps) and numbers the ops for
:class:`~roundpipe.planning.sim.engine.OpArrays` (docs/design.md#simulator). Labels and
memory intervals are made only when ``record`` is set: scoring a plan needs neither.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from ...core.keys import Activation, HandoffKey, Loss
from ...core.op_kinds import COMPUTES, OpKind, StreamName
from ...core.plan import Plan
from ...core.program import (
    CallShape,
    DeviceOp,
    JobProgram,
    job_program,
    plan_chunks,
    recompute_inputs,
)
from ...core.schedule import Job, JobKind, Schedule, lower, lower_unfused
from ...core.timeline import HOST
from . import engine
from .costs import CostModel
from .engine import ACT_H2D, COMPUTE, D2H, H2D, OPTIMIZER, Dep, Op, OpArrays

BOOKKEEPING = frozenset(
    kind.value for kind in (OpKind.TAKE_BUFFERS, OpKind.TAKE_GRADS, OpKind.RELEASE)
)
"""Span kinds of the zero-time ops that order the program but are left out of timelines."""

_STREAMS = {
    StreamName.WEIGHT_UPLOAD: H2D,
    StreamName.ACT_UPLOAD: ACT_H2D,
    StreamName.COMPUTE: COMPUTE,
    StreamName.DOWNLOAD: D2H,
}
_STREAM_NUMBER = {stream: k for k, stream in enumerate(_STREAMS)}
_H2D_STREAMS = frozenset({StreamName.WEIGHT_UPLOAD, StreamName.ACT_UPLOAD})


def round_sizes(num_microbatches: int, round_size: int) -> list[int]:
    """Microbatches per round: full rounds of ``round_size``, then the remainder."""
    if num_microbatches < 1 or round_size < 1:
        raise ValueError(
            f"need at least one microbatch and a round size of at least one, got "
            f"{num_microbatches} microbatches in rounds of {round_size}"
        )
    full, rest = divmod(num_microbatches, round_size)
    return [round_size] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class Config:
    plan: Plan
    costs: CostModel
    num_devices: int
    round_size: int
    is_async: bool
    record: bool = True
    """Label ops and record memory (for timelines); scoring needs neither."""
    forward_only: bool = False
    """Each round is a call without a loss or autograd, as the runtime runs ``model(x)``
    under ``no_grad`` (a reference model's pass): ``lower_unfused``'s forward jobs, the
    fused stage run as one more forward stage; no backward, recompute or gradients."""

    def lower(self, first_device: int) -> Schedule:
        """One round's jobs from the round-robin cursor ``first_device``."""
        if self.forward_only:
            return lower_unfused(self.plan, self.num_devices, first_device)
        return lower(self.plan, self.num_devices, first_device)


class _Template:
    """A job program with each op's duration, stream number, and waits on earlier ops
    of the job (op index, whether the wait is on a transfer)."""

    __slots__ = ("program", "durations", "deps", "streams", "uploads", "priorities")

    def __init__(self, program: JobProgram, durations: list[float]) -> None:
        self.program = program
        self.durations = durations
        ops = program.ops
        self.deps = [
            tuple((i, ops[i].stream is not StreamName.COMPUTE) for i in op.inputs)
            + (((op.host_wait, False),) if op.host_wait is not None else ())
            for op in ops
        ]
        self.streams = [_STREAM_NUMBER[op.stream] for op in ops]
        # weights and activations share the device's host-to-device copy engine;
        # activations go first when both wait (the runtime gates weight chunks)
        self.uploads = [op.stream in _H2D_STREAMS for op in ops]
        self.priorities = [int(op.stream is StreamName.WEIGHT_UPLOAD) for op in ops]


@dataclass
class Simulation:
    """Builds the op graph of successive rounds and iterations from the jobs' programs."""

    config: Config
    arrays: OpArrays = field(default_factory=OpArrays)
    ops: list[Op] = field(default_factory=list)
    """Labelled ops, in the order of ``arrays`` (``record`` only)."""
    _memory: list[tuple[int, int, int, int]] = field(default_factory=list)
    _done: dict[int, list[int]] = field(default_factory=dict)
    _optimizer_ops: dict[int, list[tuple[range, int]]] = field(default_factory=dict)
    _compute_ops: dict[int, list[int]] = field(default_factory=dict)
    _templates: dict[tuple, _Template] = field(default_factory=dict)
    _last_result: int | None = None
    _rounds: int = 0

    def add_iterations(self, num_microbatches: int, iterations: int, first_device: int) -> None:
        sizes = round_sizes(num_microbatches, self.config.round_size)
        cursor = first_device
        for iteration in range(iterations):
            for index, size in enumerate(sizes):
                schedule = self.config.lower(cursor)
                self._add_round(schedule, iteration, size, index == 0, index == len(sizes) - 1)
                cursor = schedule.next_cursor

    def iteration_ends(self, num_microbatches: int, iterations: int) -> list[float]:
        self.add_iterations(num_microbatches, iterations, 0)
        start = engine.replay_arrays(self.arrays).start
        duration = self.arrays.duration
        return [
            max(start[i] + duration[i] for i in self._compute_ops[it]) for it in range(iterations)
        ]

    def isolated_end(self, num_microbatches: int) -> float:
        """When one iteration from idle is over: the end of its last op (compute,
        download or optimizer step; with a synchronous step nothing follows it)."""
        self.add_iterations(num_microbatches, 1, 0)
        start = engine.replay_arrays(self.arrays).start
        return max(s + d for s, d in zip(start, self.arrays.duration, strict=True))

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
        forward_only = self.config.forward_only
        saved = recompute_inputs(schedule, "stage", forward_only=forward_only, deferred=False)
        shape = CallShape(size, "stage", saved, preserve_rng_state=False, return_outputs=False)
        producers: dict[HandoffKey, int] = {}
        for job in schedule.jobs:
            template = self._template(job, shape)
            self._add_program(template, job, round_id, iteration, gate, producers, last)
        # the host dispatches the next round once this one's last result is home
        last_result = (
            Activation(self.config.plan.num_layers, size - 1) if forward_only else Loss(size - 1)
        )
        self._last_result = producers[last_result]

    def _template(self, job: Job, shape: CallShape) -> _Template:
        """The job's program with durations, built once per stage and round shape (a
        program does not depend on the device or the job's place in the round; its
        durations do on a mixed pool)."""
        device = job.device if self.config.costs.mixed else 0
        cache_key = (job.kind, job.layers, shape, device)
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

    def _round_gate(self, iteration: int, first: bool) -> list[int]:
        """What the host waits for before it dispatches this round."""
        gate = [self._last_result] if self._last_result is not None else []
        if first and not self.config.is_async and iteration > 0:
            gate += [op for _, op in self._optimizer_ops.get(iteration - 1, [])]
        return gate

    def _add_program(
        self,
        template: _Template,
        job: Job,
        round_id: int,
        iteration: int,
        gate: list[int],
        producers: dict[HandoffKey, int],
        last: bool,
    ) -> None:
        ops, arrays, record = template.program.ops, self.arrays, self.config.record
        device = job.device
        queue_base = 4 * device + 1  # queue 0 is the host optimizer's
        compute_ops = self._compute_ops.setdefault(iteration, [])
        index: list[int] = []  # the job's op -> its number in the graph
        for k, op in enumerate(ops):
            deps = [index[i] for i, _ in template.deps[k]]
            extra: list[int] = []
            if op.key is not None:
                producer = producers.get(op.key)
                if producer is not None:
                    extra.append(producer)
            if op.chunk == 0:
                extra += self._weight_deps(job, iteration)
            if not op.inputs:
                extra += gate
            g = len(arrays.queue)
            arrays.queue.append(queue_base + template.streams[k])
            arrays.duration.append(template.durations[k])
            arrays.priority.append(template.priorities[k])
            arrays.resource.append(device if template.uploads[k] else -1)
            arrays.deps.append(deps + extra if extra else deps)
            arrays.lags.append(None)
            index.append(g)
            if record:
                transfers = [t for _, t in template.deps[k]] + [False] * len(extra)
                self._record(op, job, round_id, template, k, g, deps + extra, transfers)
            for handoff in (*op.keys, *op.posts):  # downloads; what compute ops hand over
                producers[handoff] = g
            if op.kind in COMPUTES:
                compute_ops.append(g)
            elif op.kind is OpKind.DOWNLOAD_GRADS and last:
                self._add_optimizer(job, iteration, g)
        if record:
            self._add_memory(template.program, job, index)
        self._done.setdefault(device, []).append(index[-1])

    def _record(self, op, job, round_id, template, k, g, deps, transfers) -> None:
        kind, label = self._name(op, job, round_id)
        self.ops.append(
            Op(
                g,
                job.device,
                _STREAMS[op.stream],
                kind,
                label,
                template.durations[k],
                tuple(Dep(d, 0.0, t) for d, t in zip(deps, transfers, strict=True)),
                ("h2d", job.device) if template.uploads[k] else None,
                template.priorities[k],
            )
        )

    def _weight_deps(self, job: Job, iteration: int) -> list[int]:
        """A stage's weights are allocated once the job two back on the device finished,
        and (asynchronous optimizer) read the weights updated two steps back."""
        deps = []
        done = self._done.get(job.device, [])
        if len(done) >= 2:
            deps.append(done[-2])
        stale_step = iteration - 2 if self.config.is_async else iteration - 1
        first, stop = job.layers.start, job.layers.stop
        for layers, optimizer in self._optimizer_ops.get(stale_step, []):
            if layers.start < stop and first < layers.stop:
                deps.append(optimizer)
        return deps

    def _duration(self, op: DeviceOp, job: Job, chunks: list[int]) -> float:
        costs = self.config.costs
        layers = costs.layers_on(job.device)
        if op.kind is OpKind.UPLOAD_WEIGHTS:
            assert op.chunk is not None
            return costs.upload_time(chunks[op.chunk])
        if op.kind in (OpKind.UPLOAD_INPUT, OpKind.UPLOAD_GRAD):
            from_caller = isinstance(op.key, Activation) and op.key.layer == 0
            return 0.0 if from_caller else costs.comm  # a hop: device -> host -> device
        if op.kind is OpKind.DOWNLOAD_GRADS:
            return costs.download_time(
                layers.stage_param_bytes(job.layers) * costs.grad_bytes_ratio
            )
        compute = {
            OpKind.FORWARD: layers.stage_forward,
            OpKind.RECOMPUTE: layers.stage_recompute,
            OpKind.BACKWARD: layers.stage_backward,
            OpKind.FUSED: lambda r: layers.stage_forward(r) + layers.stage_backward(r),
        }.get(op.kind)
        return compute(op.layers) if compute is not None else 0.0

    def _add_memory(self, program: JobProgram, job: Job, index: list[int]) -> None:
        """Weights from their upload to the release; gradients from the first backward
        compute to their download; each compute op's working activations."""
        layers = self.config.costs.layers
        device = job.device
        weights = layers.stage_param_bytes(job.layers)
        self._memory.append((device, index[0], index[-1], weights))
        computes = [op for op in program.ops if op.kind in COMPUTES]
        for op in computes:
            if op.kind is OpKind.FORWARD:
                working = max(layers.activation_bytes[i] for i in op.layers)
                self._memory.append((device, index[op.index], index[op.index], working))
            elif op.kind is OpKind.FUSED:
                working = layers.stage_activation_bytes(op.layers)
                self._memory.append((device, index[op.index], index[op.index], working))
            elif op.kind is OpKind.BACKWARD:
                graph = (
                    op.inputs[0] if program.ops[op.inputs[0]].kind is OpKind.RECOMPUTE else op.index
                )
                working = layers.stage_activation_bytes(op.layers)
                self._memory.append((device, index[graph], index[op.index], working))
        if job.kind is not JobKind.FORWARD:
            grads = int(weights * self.config.costs.grad_bytes_ratio)
            download = next(op for op in program.ops if op.kind is OpKind.DOWNLOAD_GRADS)
            self._memory.append((device, index[computes[0].index], index[download.index], grads))

    def _name(self, op: DeviceOp, job: Job, round_id: int) -> tuple[str, str]:
        """Span kind and label: compute ops by their kind; weight chunks "upload", the
        gradient download "download", other transfers by their program kind."""
        if op.kind in COMPUTES:
            return op.kind.value, f"{job} mb{op.microbatch} r{round_id}"
        renamed = {OpKind.UPLOAD_WEIGHTS: "upload", OpKind.DOWNLOAD_GRADS: "download"}
        kind = renamed.get(op.kind, op.kind.value)
        where = f" mb{op.microbatch}" if op.microbatch is not None else ""
        return kind, f"{job} {op.kind}{where} r{round_id}"

    def _add_optimizer(self, job: Job, iteration: int, download: int) -> None:
        """The host optimizer updates a stage's layers once its last gradients are home."""
        costs = self.config.costs
        layers = costs.layers
        total_bytes = sum(layers.param_bytes)
        share = (
            layers.stage_param_bytes(job.layers) / total_bytes
            if total_bytes
            else len(job.layers) / layers.num_layers
        )
        duration = costs.optimizer_time * share
        g = self.arrays.add(0, duration, 0, -1, [download])
        if self.config.record:
            label = f"step {iteration} layers {job.layers.start}:{job.layers.stop}"
            self.ops.append(Op(g, HOST, OPTIMIZER, "optimizer", label, duration, (Dep(download),)))
        self._optimizer_ops.setdefault(iteration, []).append((job.layers, g))
