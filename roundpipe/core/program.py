"""A stage job lowered to device ops: the one program the runtime interprets and the
simulator replays.

``schedule.lower`` says which device runs which job; :func:`job_program` says what the
job does there, op by op: its kind (:mod:`.op_kinds`), microbatch and layers, the
handoffs it reads and produces, the earlier ops it waits for. Pure data, the same for
every consumer, that prints and parses back (``JobProgram.from_str``;
docs/design.md#op-programs).
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass
from typing import TypedDict

from typing_extensions import Unpack

from .keys import Activation, HandoffKey, InputGrad, Loss, Output, RngState, key_repr, parse_keys
from .op_kinds import OpKind, StreamName
from .schedule import Job, JobKind, Schedule


class OpFields(TypedDict, total=False):
    """The fields of a :class:`DeviceOp` besides its index and kind (checked by name
    and type where a program is built)."""

    microbatch: int | None
    layers: range
    key: HandoffKey | None
    keys: tuple[HandoffKey, ...]
    posts: tuple[HandoffKey, ...]
    inputs: tuple[int, ...]
    host_wait: int | None
    chunk: int | None


@dataclass(frozen=True)
class DeviceOp:
    """One op of a job's program. Prints as ``#3 download      download mb0 Loss(0)
    after #2`` and parses back (:meth:`from_str`)."""

    index: int
    kind: OpKind
    """A kind or its name (``"forward"``); an unknown name is refused."""
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

    def __post_init__(self) -> None:
        # a lookup by value; mypy reads it as a call of the members' three-field __new__
        object.__setattr__(self, "kind", OpKind(self.kind))  # type: ignore[call-arg, arg-type]

    @property
    def stream(self) -> StreamName:
        return self.kind.stream

    def __str__(self) -> str:
        parts = [f"#{self.index}", f"{self.stream.value:13}", self.kind.value]
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

    @classmethod
    def from_str(cls, text: str) -> DeviceOp:
        """The op that prints as ``text`` (as ``str(op)`` does)."""
        match = _OP_LINE.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"cannot parse the op {text!r}: expected {_OP_FORM}")
        kind = OpKind(match["kind"])  # type: ignore[call-arg]  # a lookup by value, as above
        stream = StreamName(match["stream"])
        if stream is not kind.stream:
            raise ValueError(f"op {text!r}: {kind} runs on {kind.stream}, not {stream}")
        handoffs = tuple(parse_keys(match["handoffs"] or ""))
        if len(handoffs) > 1 and kind is not OpKind.DOWNLOAD:
            raise ValueError(f"op {text!r}: only a download produces several handoffs")
        first, last = match["first"], match["last"]
        return cls(
            int(match["index"]),
            kind,
            microbatch=_int(match["microbatch"]),
            layers=range(int(first), int(last) + 1) if first is not None else range(0),
            key=handoffs[0] if handoffs and kind is not OpKind.DOWNLOAD else None,
            keys=handoffs if kind is OpKind.DOWNLOAD else (),
            posts=tuple(parse_keys(match["posts"] or "")),
            inputs=tuple(int(i) for i in re.findall(r"#(\d+)", match["inputs"] or "")),
            host_wait=_int(match["host_wait"]),
            chunk=_int(match["chunk"]),
        )


_KEYS = r"\w+\(\d+(?:,\d+)*\)(?:,\w+\(\d+(?:,\d+)*\))*"
_OP_LINE = re.compile(
    r"#(?P<index>\d+) (?P<stream>\w+) +(?P<kind>\w+)"
    r"(?: chunk (?P<chunk>\d+))?(?: mb(?P<microbatch>\d+))?"
    r"(?: L(?P<first>\d+)-(?P<last>\d+))?"
    rf"(?: (?P<handoffs>{_KEYS}))?(?: posts (?P<posts>{_KEYS}))?"
    r"(?: after (?P<inputs>#\d+(?:,#\d+)*))?(?: host waits #(?P<host_wait>\d+))?"
)
_OP_FORM = (
    "'#<index> <stream> <kind> [chunk <n>] [mb<m>] [L<first>-<last>] [<keys>]"
    " [posts <keys>] [after #<op>,...] [host waits #<op>]'"
)


def _int(text: str | None) -> int | None:
    return int(text) if text is not None else None


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

    def on(self, stream: StreamName) -> tuple[DeviceOp, ...]:
        return tuple(op for op in self.ops if op.stream is stream)

    @functools.cached_property
    def weight_ops(self) -> tuple[DeviceOp, ...]:
        return self.on(StreamName.WEIGHT_UPLOAD)

    @functools.cached_property
    def downloads(self) -> dict[int, tuple[HandoffKey, ...]]:
        """Per op, the keys under which values of its result are downloaded."""
        keys: dict[int, tuple[HandoffKey, ...]] = {}
        for op in self.ops:
            if op.kind is OpKind.DOWNLOAD:
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

    @classmethod
    def from_str(cls, text: str, job: Job) -> JobProgram:
        """``job``'s program that prints as ``text`` (as ``str(program)`` does)."""
        header, *lines = text.strip().splitlines()
        if header != f"{job}:":
            raise ValueError(f"the program {header!r} is not the program of job {job}")
        ops = tuple(DeviceOp.from_str(line) for line in lines)
        for position, op in enumerate(ops):
            if op.index != position:
                raise ValueError(f"{job}: op #{op.index} stands at position {position}")
        return cls(job, ops)


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

    def add(self, kind: OpKind, **fields: Unpack[OpFields]) -> int:
        index = len(self.ops)
        self.ops.append(DeviceOp(index, kind, **fields))
        m = fields.get("microbatch")
        if kind.stream is StreamName.COMPUTE and m is not None:
            self.last_compute[m] = index
        return index

    def compute(
        self,
        kind: OpKind,
        m: int,
        layers: range,
        inputs: tuple[int, ...],
        posts: tuple[HandoffKey, ...] = (),
        key: HandoffKey | None = None,
    ) -> int:
        if self.weights_ready is not None:  # the first compute op waits for the weights
            inputs = (self.weights_ready, *inputs)
            self.weights_ready = None
        return self.add(kind, microbatch=m, layers=layers, inputs=inputs, posts=posts, key=key)

    def upload(self, kind: OpKind, m: int, key: HandoffKey | None = None) -> int:
        waits = self.last_compute.get(m - 2)
        return self.add(kind, microbatch=m, key=key, host_wait=waits)

    def download(self, source: int, m: int, *keys: HandoffKey) -> None:
        self.add(OpKind.DOWNLOAD, microbatch=m, keys=keys, inputs=(source,))

    def weights(self, chunks: int, has_buffers: bool) -> None:
        for chunk in range(chunks):
            self.weights_ready = self.add(OpKind.UPLOAD_WEIGHTS, chunk=chunk)
        if has_buffers:
            self.weights_ready = self.add(OpKind.UPLOAD_BUFFERS)

    def forward(self, m: int) -> None:
        job, shape = self.job, self.shape
        value = self.upload(OpKind.UPLOAD_INPUT, m, Activation(job.layers.start, m))
        posts = tuple(RngState(i, m) for i in shape.rng_layers(job))
        computed = self.compute(OpKind.FORWARD, m, job.layers, (value,), posts=posts)
        # The output first: the next stage waits for it. The inputs saved for recompute
        # are read only by backward jobs, much later: one op copies them all.
        self.download(computed, m, Activation(job.layers.stop, m))
        saves = shape.forward_saves(job)
        if saves:
            self.download(computed, m, *(Activation(i, m) for i in saves))

    def fused(self, m: int) -> None:
        job, shape = self.job, self.shape
        value = self.upload(OpKind.UPLOAD_INPUT, m, Activation(job.layers.start, m))
        label = self.upload(OpKind.UPLOAD_LABEL, m)
        posts = () if shape.return_outputs else (Output(m),)
        computed = self.compute(OpKind.FUSED, m, job.layers, (value, label), posts=posts)
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
            saved = self.upload(OpKind.UPLOAD_INPUT, m, Activation(start, m))
            rng = RngState(start, m) if shape.preserve_rng_state else None
            graph = self.compute(OpKind.RECOMPUTE, m, layers, (saved,), key=rng)
            if grad is None:
                grad = self.upload(OpKind.UPLOAD_GRAD, m, InputGrad(job.layers.stop, m))
            grad = self.compute(OpKind.BACKWARD, m, layers, (graph, grad))
        if job.layers.start > 0:
            assert grad is not None
            self.download(grad, m, InputGrad(job.layers.start, m))

    def finish(self, writes_back: bool) -> None:
        job = self.job
        if writes_back:
            taken = self.add(OpKind.TAKE_BUFFERS)
            self.add(OpKind.WRITE_BACK, inputs=(taken,))
        if job.kind is not JobKind.FORWARD:
            taken = self.add(OpKind.TAKE_GRADS)
            self.add(OpKind.DOWNLOAD_GRADS, inputs=(taken,))
        self.add(OpKind.RELEASE)


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
