"""The op vocabulary: the streams every device has and the kinds of op a job's program
(:mod:`roundpipe.core.program`) holds, each kind on one stream, with what it roughly
does. The runtime's one handler table (``runtime/issuer.py``) issues every kind; the
simulator replays them (docs/design.md#op-programs).
"""

from __future__ import annotations

import enum


class StreamName(enum.Enum):
    """The four streams every device has (a device's ``streams`` are keyed by them)."""

    COMPUTE = "compute"
    WEIGHT_UPLOAD = "weight_upload"
    ACT_UPLOAD = "act_upload"
    DOWNLOAD = "download"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> StreamName:
        raise ValueError(f"unknown stream {value!r}: the streams are {_names(cls)}")


class OpKind(enum.Enum):
    """What a device op does. Each kind runs on one stream (``stream``) and says roughly
    what it does (``roughly``); the runtime's ``OP_HANDLERS`` table issues each kind,
    the simulator replays it (docs/design.md#op-programs)."""

    stream: StreamName
    roughly: str

    def __new__(cls, value: str, stream: StreamName, roughly: str) -> OpKind:
        kind = object.__new__(cls)
        kind._value_ = value
        kind.stream = stream
        kind.roughly = roughly
        return kind

    # fmt: off
    UPLOAD_WEIGHTS = ("upload_weights", StreamName.WEIGHT_UPLOAD,
                      "params[chunk] = copy(host params[chunk])  # one chunk of the stage's")
    UPLOAD_BUFFERS = ("upload_buffers", StreamName.WEIGHT_UPLOAD,
                      "buffers = copy(host buffers)")
    UPLOAD_INPUT = ("upload_input", StreamName.ACT_UPLOAD,
                    "x = copy(mailbox[key])  # a stage input, or a recompute's saved input")
    UPLOAD_LABEL = ("upload_label", StreamName.ACT_UPLOAD,
                    "label = copy(labels[microbatch])")
    UPLOAD_GRAD = ("upload_grad", StreamName.ACT_UPLOAD,
                   "grad = copy(mailbox[key])  # the gradient of the stage's output")
    FORWARD = ("forward", StreamName.COMPUTE,
               "output, saved inputs = layers(x)  # no graph kept")
    FUSED = ("fused", StreamName.COMPUTE,
             "loss = loss_fn(layers(x), label); loss.backward()")
    RECOMPUTE = ("recompute", StreamName.COMPUTE,
                 "graph = layers(saved x)  # with the forward's RNG state (key)")
    BACKWARD = ("backward", StreamName.COMPUTE,
                "input grad = backward(graph, grad)  # parameter grads accumulate")
    DOWNLOAD = ("download", StreamName.DOWNLOAD,
                "mailbox[k] = copy(result[k]) for k in keys  # values of the op in inputs")
    TAKE_BUFFERS = ("take_buffers", StreamName.COMPUTE,
                    "taken = buffers  # as the last compute left them")
    WRITE_BACK = ("write_back", StreamName.DOWNLOAD,
                  "host buffers = copy(taken)")
    TAKE_GRADS = ("take_grads", StreamName.COMPUTE,
                  "taken = {param: param.grad}")
    DOWNLOAD_GRADS = ("download_grads", StreamName.DOWNLOAD,
                      "host grads += copy(taken)")
    RELEASE = ("release", StreamName.COMPUTE,
               "free params, buffers  # the stage's weights leave the device")
    # fmt: on

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> OpKind:
        raise ValueError(f"unknown op kind {value!r}: the op kinds are {_names(cls)}")


def _names(vocabulary: type[enum.Enum]) -> str:
    return ", ".join(member.value for member in vocabulary)


UPLOADS = frozenset({OpKind.UPLOAD_INPUT, OpKind.UPLOAD_LABEL, OpKind.UPLOAD_GRAD})
COMPUTES = frozenset({OpKind.FORWARD, OpKind.FUSED, OpKind.RECOMPUTE, OpKind.BACKWARD})
