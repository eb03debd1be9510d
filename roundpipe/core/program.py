"""A stage job lowered to device ops: the one program the runtime interprets and the
simulator replays.

``schedule.lower`` says which device runs which job; :func:`job_program` says what the
job does there, op by op: its stream, microbatch and layers, the handoffs it reads and
produces, the earlier ops it waits for. Pure, printable data, the same for every
consumer (docs/design.md#op-programs).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

from .keys import Activation, HandoffKey, InputGrad, Loss, Output, RngState, key_repr
from .schedule import Job, JobKind, Schedule

WEIGHT_UPLOAD = "weight_upload"
ACT_UPLOAD = "act_upload"
COMPUTE = "compute"
DOWNLOAD = "download"
STREAMS = (COMPUTE, WEIGHT_UPLOAD, ACT_UPLOAD, DOWNLOAD)
"""Every device has these four streams."""

UPLOAD_WEIGHTS = "upload_weights"
"""One chunk of the stage's parameters."""
UPLOAD_BUFFERS = "upload_buffers"
UPLOAD_INPUT = "upload_input"
"""A stage input (or a recompute's saved input), read from the mailbox under ``key``."""
UPLOAD_LABEL = "upload_label"
UPLOAD_GRAD = "upload_grad"
"""The gradient of the stage's output, read from the mailbox under ``key``."""
FORWARD = "forward"
FUSED = "fused"
RECOMPUTE = "recompute"
BACKWARD = "backward"
DOWNLOAD_VALUE = "download"
"""Values of the op in ``inputs``, copied in one op and each handed to other jobs under
its key in ``keys``."""
TAKE_BUFFERS = "take_buffers"
WRITE_BACK = "write_back"
TAKE_GRADS = "take_grads"
DOWNLOAD_GRADS = "download_grads"
RELEASE = "release"

UPLOADS = frozenset({UPLOAD_INPUT, UPLOAD_LABEL, UPLOAD_GRAD})
COMPUTES = frozenset({FORWARD, FUSED, RECOMPUTE, BACKWARD})


@dataclass(frozen=True)
class DeviceOp:
    index: int
    kind: str
    stream: str
    microbatch: int | None = None
    layers: range = range(0)
    key: HandoffKey | None = None
    """Uploads: the handoff read. Recompute: the RNG state read."""
    keys: tuple[HandoffKey, ...] = ()
    """Downloads: the handoffs produced, in copy order."""
    posts: tuple[HandoffKey, ...] = ()
    """Handoffs a compute op hands over itself, ordered by its own event (RNG states;
    the output slot of a fused stage that returns no outputs)."""
    inputs: tuple[int, ...] = ()
    """Earlier ops of the job whose results this op reads (and so waits for)."""
    host_wait: int | None = None
    """An earlier op the host waits for (on the device) before issuing this one."""
    chunk: int | None = None

    def __str__(self) -> str:
        parts = [f"#{self.index}", f"{self.stream:13}", self.kind]
        if self.chunk is not None:
            parts.append(f"chunk {self.chunk}")
        if self.microbatch is not None:
            parts.append(f"mb{self.microbatch}")
        if len(self.layers):
            parts.append(f"L{self.layers.start}-{self.layers.stop - 1}")
        if self.key is not None:
            parts.append(key_repr(self.key))
        if self.keys:
            parts.append(",".join(key_repr(k) for k in self.keys))
        if self.posts:
            parts.append("posts " + ",".join(key_repr(k) for k in self.posts))
        if self.inputs:
            parts.append("after " + ",".join(f"#{i}" for i in self.inputs))
        if self.host_wait is not None:
            parts.append(f"host waits #{self.host_wait}")
        return " ".join(parts)


@dataclass(frozen=True)
class CallShape:
    """What a call's programs depend on besides the job."""

    num_microbatches: int
    recompute_grain: str
    recompute_inputs: frozenset[int]
    """Layers whose input a backward job recomputes from (saved by the forward)."""
    preserve_rng_state: bool
    return_outputs: bool

    def forward_saves(self, job: Job) -> list[int]:
        """Layers strictly inside a forward job whose input is kept for recompute."""
        return [i for i in job.layers if i != job.layers.start and i in self.recompute_inputs]

    def rng_layers(self, job: Job) -> list[int]:
        if not self.preserve_rng_state:
            return []
        return [i for i in job.layers if i in self.recompute_inputs]


def recompute_inputs(
    schedule: Schedule, recompute_grain: str, forward_only: bool, deferred: bool
) -> frozenset[int]:
    """The layers whose input a backward job recomputes from."""
    if forward_only:
        return frozenset()
    if recompute_grain == "layer":
        end = schedule.plan.num_layers if deferred else schedule.plan.fused_range().start
        return frozenset(range(end))
    return frozenset(j.layers.start for j in schedule.jobs if j.kind is JobKind.BACKWARD)


@dataclass(frozen=True)
class JobProgram:
    job: Job
    ops: tuple[DeviceOp, ...]

    def on(self, stream: str) -> tuple[DeviceOp, ...]:
        return tuple(op for op in self.ops if op.stream == stream)

    @functools.cached_property
    def weight_ops(self) -> tuple[DeviceOp, ...]:
        return self.on(WEIGHT_UPLOAD)

    @functools.cached_property
    def downloads(self) -> dict[int, tuple[HandoffKey, ...]]:
        """Per op, the keys under which values of its result are downloaded."""
        keys: dict[int, tuple[HandoffKey, ...]] = {}
        for op in self.ops:
            if op.kind == DOWNLOAD_VALUE:
                keys[op.inputs[0]] = (*keys.get(op.inputs[0], ()), *op.keys)
        return keys

    @functools.cached_property
    def reads(self) -> tuple[HandoffKey, ...]:
        """The handoffs this job reads from other jobs (or the caller), in issue order."""
        return tuple(op.key for op in self.ops if op.key is not None)

    @functools.cached_property
    def produces(self) -> tuple[HandoffKey, ...]:
        """The handoffs this job hands to other jobs (or the caller), in issue order."""
        return tuple(key for op in self.ops for key in (*op.posts, *op.keys))

    @functools.cached_property
    def event_ops(self) -> frozenset[int]:
        """Ops after which an event is recorded: another stream or the host waits for
        them, or they hand values over themselves."""
        needed = {op.host_wait for op in self.ops if op.host_wait is not None}
        for op in self.ops:
            needed.update(i for i in op.inputs if self.ops[i].stream != op.stream)
            if op.posts:
                needed.add(op.index)
        return frozenset(needed)

    def __str__(self) -> str:
        return "\n".join([f"{self.job}:", *(f"  {op}" for op in self.ops)])


@functools.lru_cache(maxsize=1024)
def job_program(
    job: Job, shape: CallShape, weight_chunks: int, has_buffers: bool, writes_back: bool
) -> JobProgram:
    """The device ops of ``job`` in issue order (see the module docstring): its weights
    in ``weight_chunks`` chunks (plus buffers), its microbatches, and at the end the
    write-back of its buffers (if ``writes_back``), its gradients and the release.
    Programs are immutable, so equal arguments share one (calls repeat their jobs)."""
    builder = _Builder(job, shape)
    builder.weights(weight_chunks, has_buffers)
    for m in range(shape.num_microbatches):
        if job.kind is JobKind.FORWARD:
            builder.forward(m)
        elif job.kind is JobKind.FUSED:
            builder.fused(m)
        elif shape.recompute_grain == "layer":
            builder.backward(m, [range(i, i + 1) for i in reversed(job.layers)])
        else:
            builder.backward(m, [job.layers])
    builder.finish(writes_back)
    return JobProgram(job, tuple(builder.ops))


class _Builder:
    def __init__(self, job: Job, shape: CallShape) -> None:
        self.job = job
        self.shape = shape
        self.ops: list[DeviceOp] = []
        self.weights_ready: int | None = None
        self.last_compute: dict[int, int] = {}  # microbatch -> its last compute op

    def add(self, kind: str, stream: str, **fields) -> int:
        index = len(self.ops)
        self.ops.append(DeviceOp(index, kind, stream, **fields))
        if stream == COMPUTE and fields.get("microbatch") is not None:
            self.last_compute[fields["microbatch"]] = index
        return index

    def compute(self, kind: str, m: int, layers: range, inputs: tuple[int, ...], **fields) -> int:
        if self.weights_ready is not None:  # the first compute op waits for the weights
            inputs = (self.weights_ready, *inputs)
            self.weights_ready = None
        return self.add(kind, COMPUTE, microbatch=m, layers=layers, inputs=inputs, **fields)

    def upload(self, kind: str, m: int, key: HandoffKey | None = None) -> int:
        waits = self.last_compute.get(m - 2)
        return self.add(kind, ACT_UPLOAD, microbatch=m, key=key, host_wait=waits)

    def download(self, source: int, m: int, *keys: HandoffKey) -> None:
        self.add(DOWNLOAD_VALUE, DOWNLOAD, microbatch=m, keys=keys, inputs=(source,))

    def weights(self, chunks: int, has_buffers: bool) -> None:
        for chunk in range(chunks):
            self.weights_ready = self.add(UPLOAD_WEIGHTS, WEIGHT_UPLOAD, chunk=chunk)
        if has_buffers:
            self.weights_ready = self.add(UPLOAD_BUFFERS, WEIGHT_UPLOAD)

    def forward(self, m: int) -> None:
        job, shape = self.job, self.shape
        value = self.upload(UPLOAD_INPUT, m, Activation(job.layers.start, m))
        posts = tuple(RngState(i, m) for i in shape.rng_layers(job))
        computed = self.compute(FORWARD, m, job.layers, (value,), posts=posts)
        # The output first: the next stage waits for it. The inputs saved for recompute
        # are read only by backward jobs, much later: one op copies them all.
        self.download(computed, m, Activation(job.layers.stop, m))
        saves = shape.forward_saves(job)
        if saves:
            self.download(computed, m, *(Activation(i, m) for i in saves))

    def fused(self, m: int) -> None:
        job, shape = self.job, self.shape
        value = self.upload(UPLOAD_INPUT, m, Activation(job.layers.start, m))
        label = self.upload(UPLOAD_LABEL, m)
        posts = () if shape.return_outputs else (Output(m),)
        computed = self.compute(FUSED, m, job.layers, (value, label), posts=posts)
        self.download(computed, m, Loss(m))
        if shape.return_outputs:
            self.download(computed, m, Output(m))
        if job.layers.start > 0:
            self.download(computed, m, InputGrad(job.layers.start, m))

    def backward(self, m: int, pieces: list[range]) -> None:
        """Recompute then backward, piece by piece from the top; the recompute needs only
        the saved input, so it is issued before the incoming gradient is fetched."""
        job, shape = self.job, self.shape
        grad: int | None = None
        for layers in pieces:
            start = layers.start
            saved = self.upload(UPLOAD_INPUT, m, Activation(start, m))
            rng = RngState(start, m) if shape.preserve_rng_state else None
            graph = self.compute(RECOMPUTE, m, layers, (saved,), key=rng)
            if grad is None:
                grad = self.upload(UPLOAD_GRAD, m, InputGrad(job.layers.stop, m))
            grad = self.compute(BACKWARD, m, layers, (graph, grad))
        if job.layers.start > 0:
            self.download(grad, m, InputGrad(job.layers.start, m))

    def finish(self, writes_back: bool) -> None:
        job = self.job
        if writes_back:
            taken = self.add(TAKE_BUFFERS, COMPUTE)
            self.add(WRITE_BACK, DOWNLOAD, inputs=(taken,))
        if job.kind is not JobKind.FORWARD:
            taken = self.add(TAKE_GRADS, COMPUTE)
            self.add(DOWNLOAD_GRADS, DOWNLOAD, inputs=(taken,))
        self.add(RELEASE, COMPUTE)


def plan_chunks(
    numels: list[int], element_sizes: list[int], limit: int | None
) -> list[list[tuple[int, int, int]]]:
    """Cut tensors of ``numels`` elements into upload chunks of at most ``limit`` bytes.

    Returns chunks of ``(tensor index, first element, end element)`` pieces: small
    tensors are grouped, a tensor larger than ``limit`` is split into flat slices.
    ``limit=None`` gives one chunk holding everything.
    """
    sizes = list(zip(numels, element_sizes, strict=True))
    if limit is None:
        return [[(i, 0, count) for i, (count, _) in enumerate(sizes)]] if sizes else []
    chunks: list[list[tuple[int, int, int]]] = []
    room = 0
    for index, (count, element) in enumerate(sizes):
        start = 0
        while True:
            if room < element or not chunks:
                chunks.append([])
                room = limit
            take = min(count - start, max(room // element, 1))
            chunks[-1].append((index, start, start + take))
            room -= take * element
            start += take
            if start >= count:
                break
    return chunks


def handoffs(job: Job, shape: CallShape) -> JobProgram:
    """``job``'s program without its weight ops: what it reads and produces does not
    depend on how its weights travel (for a job failed or cancelled before its
    weights were planned)."""
    return job_program(job, shape, 0, False, False)


def readers(schedule: Schedule, shape: CallShape) -> Counter[HandoffKey]:
    """How many jobs of ``schedule`` read each handoff (a host copy is freed after its
    last reader)."""
    return Counter(key for job in schedule.jobs for key in handoffs(job, shape).reads)
