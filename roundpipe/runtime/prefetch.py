"""Uploading a stage's weights ahead of its compute (docs/design.md#weight-prefetch).

Runs on a device worker's *prefetch* thread, so a stage's upload is issued while the
device still computes the stage before it. The weights' device memory is taken here,
when issued, and their chunks are gated behind pending activation uploads, because on
a GPU copy engines serve copies in issue order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..core.program import DeviceOp, job_program, plan_chunks
from ..core.schedule import JobKind
from ..devices.base import Event, OpInfo, Slot, Stream
from ..errors import failure_site
from .context import JobContext
from .profiler import TransferTiming


@dataclass
class StageWeights:
    """A stage's weights on a device, once ``ready`` has completed."""

    tensors: Slot
    """(parameters by uid, buffers by uid) on the device; emptied by the job's release."""
    ready: Event
    """Recorded on the weight-upload stream after the last copy."""
    transfers: list[TransferTiming] = field(default_factory=list)
    """The chunk uploads, timed for the profiler (read once the job has finished)."""


class WeightUpload:
    """One job's weights on their way to a device: allocated when built, on the prefetch
    thread; its handlers issue the program's weight ops (``op_table.OP_HANDLERS``)."""

    def __init__(self, ctx: JobContext) -> None:
        """Lower the job to its program and allocate its weights on the device now."""
        worker, call, job, name = ctx.worker, ctx.call, ctx.job, ctx.name
        device, store, versions = worker.device, worker.store, worker.versions
        stream = device.weight_upload
        versions.published.wait_for(call.weights_version)
        layers = [worker.layers[i] for i in job.layers]
        if job.kind is not JobKind.BACKWARD:
            for layer in layers:
                gate = worker.buffer_gates.get(layer.index)
                if gate is not None:
                    gate.wait_for(call.seq)  # an earlier call's write-back of this buffer
        uids = list(dict.fromkeys(uid for layer in layers for uid in layer.param_uids))
        buffers = {uid: t for layer in layers for uid, t in layer.host_buffers().items()}
        sources = [versions.source(uid, call.weights_buffer) for uid in uids]
        training = job.kind is not JobKind.FORWARD
        self.where = f"{name}: weight upload on device {device!r}"
        with failure_site(self.where):
            # taken here, on the issuing thread, as CUDA's caching allocator takes it
            params = {uid: device.allocate(t, stream) for uid, t in zip(uids, sources, strict=True)}
            on_device = {uid: device.allocate(host, stream) for uid, host in buffers.items()}
        for uid, tensor in params.items():
            tensor.requires_grad_(training and store.trainable(uid))
        for tensor in [*params.values(), *on_device.values()]:
            device.keep_alive(tensor, device.compute)

        self.numels = [t.numel() for t in sources]
        self.pieces = plan_chunks(
            self.numels, [t.element_size() for t in sources], call.config.weight_chunk_bytes
        )
        self.program = job_program(
            job, call.shape, len(self.pieces), bool(buffers), worker.writes_back(job)
        )
        self.ctx, self.device, self.name = ctx, device, name
        self.uids, self.sources, self.params = uids, sources, params
        self.buffers, self.on_device = buffers, on_device
        self.copied: Event | None = None  # the last chunk's copy
        self.transfers: list[TransferTiming] = []

    def upload_weights(self, op: DeviceOp, stream: Stream) -> None:
        """One chunk of the parameters, gated behind the pending activation uploads."""
        assert op.chunk is not None, f"weight upload #{op.index} names no chunk"
        device, sources, chunk = self.device, self.sources, self.pieces[op.chunk]
        if self.ctx.call.config.gate_weight_chunks:
            if self.copied is not None:
                self.copied.wait(None)  # on the host: the chunk before has been copied
            stream.wait(device.act_upload.record())
        nbytes = sum((end - first) * sources[i].element_size() for i, first, end in chunk)
        pageable = not all(device.is_pinned(sources[i]) for i, _, _ in chunk)
        info = OpInfo(
            "upload",
            f"weights {self.name}",
            nbytes,
            job=self.ctx.job.index,
            op=op.index,
            pageable=pageable,
        )
        timing = TransferTiming(device, "h2d")
        timing.nbytes = nbytes
        self.transfers.append(timing)
        stream.submit(functools.partial(self.copy_chunk, chunk, timing, stream), info)
        self.copied = stream.record()

    def copy_chunk(self, chunk, timing: TransferTiming, stream: Stream) -> None:
        """Inside the op: the chunk's tensors are copied as one transfer, timed as one."""
        with failure_site(self.where), torch.no_grad():
            dsts, srcs = [], []
            for index, first, end in chunk:
                dst, src = self.params[self.uids[index]], self.sources[index]
                if first or end != self.numels[index]:  # a tensor cut across chunks
                    dst, src = dst.view(-1)[first:end], src.reshape(-1)[first:end]
                dsts.append(dst)
                srcs.append(src)
            with timing.measure():
                self.device.copy_in_all(dsts, srcs, stream)

    def upload_buffers(self, op: DeviceOp, stream: Stream) -> None:
        device, name = self.device, self.name

        def upload_buffers() -> None:
            with failure_site(f"{name}: buffer upload on device {device!r}"), torch.no_grad():
                for uid, host in self.buffers.items():
                    device.copy_in(self.on_device[uid], host, stream)

        info = OpInfo("upload", f"buffers {name}", job=self.ctx.job.index, op=op.index)
        stream.submit(upload_buffers, info)

    def stage_weights(self) -> StageWeights:
        """Once the weight ops were issued: the weights, ready when their copies are."""
        ready = self.device.weight_upload.record()
        return StageWeights(Slot((self.params, self.on_device)), ready, self.transfers)
