"""The one table of op handlers: which worker thread issues each op kind, and how.

The prefetch thread issues a program's weight ops (:func:`upload_stage_weights`,
handlers in :mod:`.prefetch`), so a stage's weights travel while the device still
computes the stage before; the issue thread issues the rest (:func:`issue_job`,
handlers in :mod:`.issuer`) (docs/design.md#issuing-a-job).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from ..core.op_kinds import OpKind, StreamName
from ..core.program import JobProgram
from .context import JobContext
from .issuer import JobIssuer
from .prefetch import StageWeights, WeightUpload


class IssuingThread(enum.Enum):
    """The worker thread that issues an op (docs/design.md#issuing-a-job)."""

    PREFETCH = "prefetch"
    ISSUE = "issue"


@dataclass(frozen=True)
class OpHandler:
    thread: IssuingThread
    issue: Callable[..., None]
    """``issue(interpreter, op, stream)``: a :class:`~.prefetch.WeightUpload` on the
    prefetch thread, a :class:`JobIssuer` on the issue thread."""


_PREFETCH, _ISSUE = IssuingThread.PREFETCH, IssuingThread.ISSUE
OP_HANDLERS: dict[OpKind, OpHandler] = {
    OpKind.UPLOAD_WEIGHTS: OpHandler(_PREFETCH, WeightUpload.upload_weights),
    OpKind.UPLOAD_BUFFERS: OpHandler(_PREFETCH, WeightUpload.upload_buffers),
    OpKind.UPLOAD_INPUT: OpHandler(_ISSUE, JobIssuer.upload_input),
    OpKind.UPLOAD_LABEL: OpHandler(_ISSUE, JobIssuer.upload_label),
    OpKind.UPLOAD_GRAD: OpHandler(_ISSUE, JobIssuer.upload_grad),
    OpKind.FORWARD: OpHandler(_ISSUE, JobIssuer.forward),
    OpKind.FUSED: OpHandler(_ISSUE, JobIssuer.fused),
    OpKind.RECOMPUTE: OpHandler(_ISSUE, JobIssuer.recompute),
    OpKind.BACKWARD: OpHandler(_ISSUE, JobIssuer.backward),
    OpKind.DOWNLOAD: OpHandler(_ISSUE, JobIssuer.download_value),
    OpKind.TAKE_BUFFERS: OpHandler(_ISSUE, JobIssuer.take_buffers),
    OpKind.WRITE_BACK: OpHandler(_ISSUE, JobIssuer.write_back),
    OpKind.TAKE_GRADS: OpHandler(_ISSUE, JobIssuer.take_grads),
    OpKind.DOWNLOAD_GRADS: OpHandler(_ISSUE, JobIssuer.download_grads),
    OpKind.RELEASE: OpHandler(_ISSUE, JobIssuer.release),
}
"""Which thread issues each op kind, and how: every kind, checked on import. The weight
uploads go on the prefetch thread, so a stage's weights travel while the device still
computes the stage before (the kinds of the weight-upload stream, exactly)."""

_prefetched = {kind for kind, handler in OP_HANDLERS.items() if handler.thread is _PREFETCH}
if OP_HANDLERS.keys() != set(OpKind) or _prefetched != {
    kind for kind in OpKind if kind.stream is StreamName.WEIGHT_UPLOAD
}:
    raise RuntimeError("OP_HANDLERS must handle every OpKind, its weight uploads prefetched")


def handler_for(kind: OpKind) -> OpHandler:
    """The handler of ``kind``; an unknown kind is refused by name."""
    handler = OP_HANDLERS.get(kind)
    if handler is None:
        known = ", ".join(k.value for k in OP_HANDLERS)
        raise ValueError(f"no handler for op kind {kind!r}: the runtime issues {known}")
    return handler


def upload_stage_weights(ctx: JobContext) -> tuple[JobProgram, StageWeights]:
    """On the prefetch thread: lower the job to its program, allocate its weights on the
    device now and issue the program's weight ops."""
    upload = WeightUpload(ctx)
    for op in upload.program.ops:
        handler = handler_for(op.kind)
        if handler.thread is IssuingThread.PREFETCH:
            handler.issue(upload, op, upload.device.streams[op.stream])
    return upload.program, upload.stage_weights()


def issue_job(issuer: JobIssuer) -> None:
    """On the issue thread: issue every op of the job that is not a weight upload."""
    for op in issuer.program.ops:
        handler = handler_for(op.kind)
        if handler.thread is IssuingThread.ISSUE:
            issuer.issue_op(op, handler.issue)
