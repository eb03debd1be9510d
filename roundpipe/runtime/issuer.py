"""Issuing a job's device ops other than weight uploads (:mod:`roundpipe.core.program`).

A :class:`JobIssuer` issues them, in program order, on the worker's issue thread, as
the one table of handlers says (:data:`.op_table.OP_HANDLERS`), without waiting on the
device except for the program's host waits, taking each upload's device memory when
issued, as CUDA's caching allocator does (docs/design.md#issuing-a-job).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ..core.keys import Activation, InputGrad, RngState, key_label
from ..core.op_kinds import OpKind, StreamName
from ..core.program import DeviceOp, JobProgram
from ..core.schedule import JobKind
from ..devices.base import Event, OpInfo, Slot, Stream
from ..errors import failure_site
from .call import Call
from .context import JobContext, WorkerContext
from .prefetch import StageWeights
from .profiler import TransferTiming
from .stage_compute import StageCompute
from .sync import Handoff
from .transfer import Shapes, Upload, download_tree, tree_bytes


class JobIssuer:
    """Issues one job's non-weight ops. Lives only while the job is being issued."""

    def __init__(self, ctx: JobContext, program: JobProgram, weights: StageWeights) -> None:
        self.ctx = ctx
        self.device = ctx.device
        self.call = ctx.call
        self.job = ctx.job
        self.program = program
        self.name = ctx.name
        self.mailbox = ctx.call.mailbox
        self.weights = weights.tensors  # (params by uid, buffers by uid) on the device
        self.compute = StageCompute(ctx, self.weights)
        self.results: dict[int, Slot] = {}
        self.posted: dict[int, dict] = {}  # op -> the slots of the values it posts itself
        self.shapes: dict = {}  # key -> the slot of a downloaded value's shapes
        self.events: dict[int, Event] = {}
        self.needs_event = program.event_ops
        # (stream, other stream) -> the last op of the other stream it waited for
        self.waited: dict[tuple[StreamName, StreamName], int] = {}
        self.transfers: list[TransferTiming] = list(weights.transfers)
        """The job's timed transfers, for the profiler once the job has finished."""
        if program.weight_ops:
            self.events[program.weight_ops[-1].index] = weights.ready

    def issue_op(
        self, op: DeviceOp, handler: Callable[[JobIssuer, DeviceOp, Stream], None]
    ) -> None:
        """Issue ``op`` with ``handler`` on its stream, behind the ops it reads."""
        if op.host_wait is not None:
            self.events[op.host_wait].wait(None)  # the memory bound, counted when issued
        stream = self.device.streams[op.stream]
        for index in op.inputs:
            source = self.program.ops[index].stream
            if source != op.stream and self.waited.get((op.stream, source), -1) < index:
                stream.wait(self.events[index])
                self.waited[(op.stream, source)] = index
        self.results[op.index] = Slot()
        handler(self, op, stream)
        if op.index in self.needs_event:
            self.events[op.index] = stream.record()
        for key, slot in self.posted.pop(op.index, {}).items():
            self.mailbox.post(key, Handoff(slot, self.events[op.index]))

    def info(self, op: DeviceOp, kind: str, label: str, layers: range = range(0)) -> OpInfo:
        return OpInfo(kind, label, layers=tuple(layers), job=self.job.index, op=op.index)

    # -- uploads -------------------------------------------------------------------------

    def upload_input(self, op: DeviceOp, stream: Stream) -> None:
        layer = _key(op).layer
        requires_grad = self.job.kind is JobKind.FUSED or (
            self.job.kind is JobKind.BACKWARD and layer > 0
        )
        self.upload_handoff(op, stream, f"act {layer}", requires_grad)

    def upload_grad(self, op: DeviceOp, stream: Stream) -> None:
        self.upload_handoff(op, stream, f"grad {_key(op).layer}", requires_grad=False)

    def upload_handoff(self, op: DeviceOp, stream: Stream, what: str, requires_grad: bool) -> None:
        handoff = self.mailbox.get(_key(op))
        if handoff.event is None:  # already in host memory
            self.submit_upload(op, stream, what, handoff.slot.value, requires_grad)
            return
        # Its device memory is taken now, so its size must be known: wait until the
        # producer computed it (CUDA: until it was issued), or, for a value posted
        # without its shapes, until the download was launched and the host copy exists.
        # The copy itself waits for the download on the device.
        shapes = handoff.meta
        if isinstance(shapes, Shapes):
            tree, source = shapes.tree(), handoff.slot
        else:
            handoff.event.wait_launched()
            tree, source = handoff.slot.value, None
        stream.wait(handoff.event)
        self.submit_upload(op, stream, what, tree, requires_grad, source)

    def upload_label(self, op: DeviceOp, stream: Stream) -> None:
        labels = self.call.labels
        host = labels[_microbatch(op)] if labels is not None else None
        self.submit_upload(op, stream, "label", host, False)

    def submit_upload(
        self,
        op: DeviceOp,
        stream: Stream,
        what: str,
        tree: Any,
        requires_grad: bool,
        source: Slot | None = None,
    ) -> None:
        """Take the device memory of ``tree`` now, on the issuing thread, and issue its
        copy (from ``source`` if ``tree`` holds only shapes); from pageable host memory
        issuing it blocks until the copy was staged."""
        slot = self.results[op.index]
        site = failure_site(f"{self.name}: upload of {what}, microbatch {op.microbatch}")
        with site:
            upload = Upload(self.device, stream, tree, requires_grad, source)

        def run() -> None:
            with site:
                slot.value = upload.run()

        info = OpInfo(
            "upload",
            f"{what} mb{op.microbatch}",
            upload.nbytes,
            job=self.job.index,
            op=op.index,
            pageable=upload.pageable(),
        )
        stream.submit(run, info)

    # -- compute -------------------------------------------------------------------------

    def run_compute(self, op: DeviceOp, stream: Stream, body: Callable[[], Any]) -> None:
        """Submit a compute op whose result (``body()``) goes to the op's result slot;
        the values it posts itself get slots of their own."""
        result, device = self.results[op.index], self.device
        info = self.info(op, op.kind.value, f"{self.name} mb{op.microbatch}", op.layers)
        where = f"{self.name}, {op.kind} of microbatch {op.microbatch}"
        if len(op.layers) == 1:
            where += f" ({self.ctx.worker.layers[op.layers.start]})"
        posted = self.posted[op.index] = {key: Slot() for key in op.posts}
        keys = [  # downloaded values that later jobs upload
            key
            for key in self.program.downloads.get(op.index, ())
            if isinstance(key, (Activation, InputGrad))
        ]
        launched = threading.Event()
        shapes = {key: Shapes(launched) for key in keys}
        self.shapes.update(shapes)

        def run() -> None:
            try:
                with failure_site(where), device.compute_scope(info):
                    value = body()
                for key, slot in posted.items():
                    slot.value = value.pop(key, None)
                for key, announced in shapes.items():
                    announced.announce(value.get(key))
                result.value = value
            finally:
                if launched is not None:
                    launched.set()

        stream.submit(run, info)

    def input_of(self, op: DeviceOp, *kinds: OpKind) -> tuple[DeviceOp, Slot]:
        for index in op.inputs:
            if self.program.ops[index].kind in kinds:
                return self.program.ops[index], self.results[index]
        raise AssertionError(f"op #{op.index} reads no {kinds}")

    def forward(self, op: DeviceOp, stream: Stream) -> None:
        _, value = self.input_of(op, OpKind.UPLOAD_INPUT)
        stop = self.job.layers.stop
        saves = frozenset(  # the inputs kept for recompute, besides the output
            key.layer
            for key in self.program.downloads.get(op.index, ())
            if isinstance(key, Activation) and key.layer != stop
        )
        rng = frozenset(key.layer for key in op.posts if isinstance(key, RngState))
        m = _microbatch(op)
        self.run_compute(op, stream, lambda: self.compute.forward(m, value, saves, rng))

    def fused(self, op: DeviceOp, stream: Stream) -> None:
        _, value = self.input_of(op, OpKind.UPLOAD_INPUT)
        _, label = self.input_of(op, OpKind.UPLOAD_LABEL)
        self.run_compute(op, stream, lambda: self.compute.fused(_microbatch(op), value, label))

    def recompute(self, op: DeviceOp, stream: Stream) -> None:
        _, value = self.input_of(op, OpKind.UPLOAD_INPUT)
        rng = None
        if op.key is not None:
            handoff = self.mailbox.get(op.key)
            stream.wait(_event(handoff))
            rng = handoff.slot
        m = _microbatch(op)
        self.run_compute(op, stream, lambda: self.compute.recompute(m, op.layers, value, rng))

    def backward(self, op: DeviceOp, stream: Stream) -> None:
        _, graph = self.input_of(op, OpKind.RECOMPUTE)
        source, grad = self.input_of(op, OpKind.UPLOAD_GRAD, OpKind.BACKWARD)

        def incoming():
            if source.kind is OpKind.UPLOAD_GRAD:
                return grad.take()
            return grad.value.pop(InputGrad(source.layers.start, _microbatch(op)))

        m = _microbatch(op)
        self.run_compute(op, stream, lambda: self.compute.backward(m, op.layers, graph, incoming))

    # -- downloads and the end of the job -------------------------------------------------

    def download_timing(self, boundary: bool = False, layer: int | None = None) -> TransferTiming:
        """A timing for a download op about to be issued, handed to the profiler later
        (``layer``: for a stage-boundary activation, the layer whose input it is)."""
        timing = TransferTiming(self.device, "d2h", boundary, layer)
        self.transfers.append(timing)
        return timing

    def timed_download(self, timing: TransferTiming, stream: Stream, tree: Any) -> Any:
        """Inside a download op: ``download_tree``, timed."""
        timing.nbytes = tree_bytes(tree)
        with timing.measure():
            return download_tree(self.device, stream, tree)

    def download_value(self, op: DeviceOp, stream: Stream) -> None:
        """One op copies each value of ``op.keys`` home, each timed on its own."""
        source, m = self.results[op.inputs[0]], op.microbatch
        whats = [key_label(key) for key in op.keys]
        # Only forward jobs download activations: their output or saved stage inputs.
        timings = [
            self.download_timing(True, key.layer)
            if isinstance(key, Activation)
            else self.download_timing()
            for key in op.keys
        ]
        hosts = [Slot() for _ in op.keys]

        def download() -> None:
            for key, what, timing, host in zip(op.keys, whats, timings, hosts, strict=True):
                with failure_site(f"{self.name}: download of {what}, microbatch {m}"):
                    host.value = self.timed_download(timing, stream, source.value.pop(key))

        stream.submit(download, self.info(op, "download", f"{', '.join(whats)} mb{m}"))
        done = stream.record()
        for key, host in zip(op.keys, hosts, strict=True):
            shapes = self.shapes.pop(key, None)
            if shapes is not None:  # readers take device memory once it was computed
                shapes.done = self.events[op.inputs[0]]
            self.mailbox.post(key, Handoff(host, done, shapes))

    def take_buffers(self, op: DeviceOp, stream: Stream) -> None:
        slot = self.results[op.index]

        def take_them() -> None:
            slot.value = dict(self.weights.value[1])

        stream.submit(take_them, self.info(op, "bookkeeping", self.name))

    def take_grads(self, op: DeviceOp, stream: Stream) -> None:
        slot, store = self.results[op.index], self.ctx.worker.store

        def take_them() -> None:
            params = self.weights.value[0]
            grads: dict = {
                uid: t.grad
                for uid, t in params.items()
                if store.trainable(uid) and t.grad is not None
            }
            grads.update(self.compute.tied_grads(store.trainable))  # (uid, layer) keys
            slot.value = grads

        stream.submit(take_them, self.info(op, "bookkeeping", self.name))

    def download_whole(self, op: DeviceOp, stream: Stream, what: str) -> Handoff:
        source, host, timing = self.results[op.inputs[0]], Slot(), self.download_timing()

        def download() -> None:
            with failure_site(f"{self.name}: download of {what}"):
                host.value = self.timed_download(timing, stream, source.take())

        stream.submit(download, self.info(op, "download", what))
        return Handoff(host, stream.record())

    def write_back(self, op: DeviceOp, stream: Stream) -> None:
        worker, call, job = self.ctx.worker, self.call, self.job
        layers = [worker.layers[i] for i in job.layers]
        hosts = {uid: t for layer in layers for uid, t in layer.host_buffers().items()}
        downloaded = self.download_whole(op, stream, "buffers")

        def write_and_open_gates() -> None:
            try:
                with torch.no_grad():
                    for uid, tensor in downloaded.slot.value.items():
                        hosts[uid].copy_(tensor)
            finally:
                worker.open_buffer_gates(call, job)

        def failed(error: BaseException) -> None:
            worker.open_buffer_gates(call, job)
            call.latch.fail(job.index, error)

        worker.after([_event(downloaded)], write_and_open_gates, failed)

    def download_grads(self, op: DeviceOp, stream: Stream) -> None:
        worker, call, job, scale = self.ctx.worker, self.call, self.job, self.ctx.loss_scale
        room = worker.gradient_room
        room.acquire()  # the previous job's gradients reached the masters (or failed)
        try:
            downloaded = self.download_whole(op, stream, "param grads")

            def accumulate() -> None:
                # The optimizer may still be consuming the previous step's gradients.
                worker.versions.published.wait_for(call.steps_before)
                uids = _accumulate(worker, call, downloaded.slot.take(), scale)
                worker.reports.gradients_in(call, job, uids)
                room.release()  # after the download blocks were given back

            def failed(error: BaseException) -> None:
                room.release()  # accumulate raised before releasing, or never ran
                call.latch.fail(job.index, error)

            worker.after([_event(downloaded)], accumulate, failed)
        except BaseException:
            room.release()
            raise

    def release(self, op: DeviceOp, stream: Stream) -> None:
        def release() -> None:
            self.weights.value = None
            self.compute.release()

        stream.submit(release, self.info(op, "release", self.name))


def _accumulate(
    worker: WorkerContext, call: Call, grads: dict, scale: float | None
) -> frozenset[int]:
    """Add a job's downloaded gradients into the masters (they die on return), a shared
    weight's one use at a time (keyed ``(uid, layer)``, last layer first); returns the
    masters that got one."""
    if grads:
        worker.reports.accumulated(call)
    uids = [key[0] if isinstance(key, tuple) else key for key in grads]
    for uid, grad in zip(uids, grads.values(), strict=True):
        worker.store.accumulate_grad(uid, grad, scale)
    return frozenset(uids)


def _microbatch(op: DeviceOp) -> int:
    """The microbatch of an op of a stage (every op but the weight uploads has one)."""
    assert op.microbatch is not None, f"op #{op.index} has no microbatch"
    return op.microbatch


def _key(op: DeviceOp) -> Activation | InputGrad:
    """The handoff an activation or gradient upload reads."""
    assert isinstance(op.key, (Activation, InputGrad)), f"op #{op.index} reads no handoff"
    return op.key


def _event(handoff: Handoff) -> Event:
    """The event of a handoff made on a device (not one complete in host memory)."""
    assert handoff.event is not None, "a handoff complete in host memory has no event"
    return handoff.event
