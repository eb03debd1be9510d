"""Issuing one stage job's stream ops once its weights are on their way (see
:mod:`.prefetch`): per-microbatch activation upload, compute and download, each
ordered by events, then buffer write-back, gradient download and release.

A :class:`JobIssuer` lives only while its job is being issued on a worker's issue
thread; it never waits on the device. Work the host must do after device work
(accumulating gradients, writing back buffers) is handed to the worker's completer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..devices import Event, OpInfo, Slot, Timer
from ..errors import failure_site
from ..schedule import Job, JobKind
from .call import Call
from .keys import Activation, InputGrad, Loss, Output, RngState
from .prefetch import StageWeights
from .sync import Handoff
from .transfer import (
    download_tree,
    grads_of_inputs,
    inplace_safe,
    pair_outputs_with_grads,
    upload_tree,
)

if TYPE_CHECKING:
    from .worker import DeviceWorker


def job_name(job: Job) -> str:
    kind = {JobKind.FORWARD: "forward", JobKind.FUSED: "fused", JobKind.BACKWARD: "backward"}
    return f"{kind[job.kind]} stage {job.stage} (layers {job.layers.start}-{job.layers.stop - 1})"


class JobIssuer:
    """Issues one job's stream ops. Lives only while the job is being issued."""

    def __init__(self, worker: DeviceWorker, call: Call, job: Job, weights: StageWeights) -> None:
        self.worker = worker
        self.device = worker.device
        self.call = call
        self.job = job
        self.name = job_name(job)
        self.mailbox = call.mailbox
        self.stage_weights = weights
        self.weights = weights.tensors  # (params by uid, buffers by uid) on the device
        self.timings: list[tuple[str, tuple[int, ...], Timer]] = []

    # -- the three job kinds ----------------------------------------------------------

    def issue(self) -> None:
        self.device.compute.wait(self.stage_weights.ready)
        if self.job.kind is JobKind.FORWARD:
            for m in range(self.call.num_microbatches):
                self.forward_microbatch(m)
            self.write_back_buffers()
        elif self.job.kind is JobKind.FUSED:
            for m in range(self.call.num_microbatches):
                self.fused_microbatch(m)
            self.write_back_buffers()
            self.download_param_grads()
        else:
            for m in range(self.call.num_microbatches):
                if self.call.recompute_grain == "layer":
                    self.backward_microbatch_by_layer(m)
                else:
                    self.backward_microbatch(m)
            self.download_param_grads()
        self.device.compute.submit(self.release, OpInfo("release", self.name))

    def forward_microbatch(self, m: int) -> None:
        job, call = self.job, self.call
        value = self.upload_input(Activation(job.layers.start, m), requires_grad=False)
        saves = {i: Slot() for i in call.forward_saves(job)}
        output = Slot()
        rng = {i: Slot() for i in call.rng_layers(job)}

        def forward() -> None:
            x = value.value
            value.value = None
            with torch.no_grad(), call.autocast.scope():
                for i in job.layers:
                    if i in rng:
                        rng[i].value = self.device.get_rng_state()
                    if i in saves:
                        # a copy: a later layer may modify its input in place
                        saves[i].value = inplace_safe(x, clone_all=True)
                    x = self.run_layer(i, x, m, "forward")
            output.value = x

        self.compute(forward, "forward", m)
        computed = self.mark_compute()
        for i, slot in rng.items():
            self.mailbox.post(RngState(i, m), Handoff(slot, computed))
        for i, slot in [*saves.items(), (job.layers.stop, output)]:
            self.mailbox.post(Activation(i, m), self.download(slot, computed, f"act {i}", m))

    def fused_microbatch(self, m: int) -> None:
        job, call = self.job, self.call
        value = self.upload_input(Activation(job.layers.start, m), requires_grad=True, label=m)
        loss_slot, out_slot, grad_slot = Slot(), Slot(), Slot()

        def fused() -> None:
            (args, kwargs), label = value.value
            value.value = None
            inputs = (args, kwargs)
            with torch.enable_grad():
                with call.autocast.scope():
                    x = inplace_safe(inputs)
                    for i in job.layers:
                        x = self.run_layer(i, x, m, "forward")
                    with failure_site(f"loss_fn in {self.name}, microbatch {m}"):
                        loss = call.loss_fn(x[0][0], label)
                        _check_loss(loss)
                scaled = loss if call.loss_scale is None else loss * call.loss_scale
                with failure_site(f"{self.name}, backward of microbatch {m}"):
                    self.timed("backward", job.layers, scaled.backward)
            loss_slot.value = loss.detach()
            if call.return_outputs:
                out_slot.value = x[0][0]
            if job.layers.start > 0:
                grad_slot.value = grads_of_inputs(inputs)

        self.compute(fused, "fused", m)
        computed = self.mark_compute()
        self.mailbox.post(Loss(m), self.download(loss_slot, computed, "loss", m))
        if call.return_outputs:
            self.mailbox.post(Output(m), self.download(out_slot, computed, "output", m))
        else:
            self.mailbox.post(Output(m), Handoff(Slot(), None))
        if job.layers.start > 0:
            key = InputGrad(job.layers.start, m)
            self.mailbox.post(key, self.download(grad_slot, computed, "grad", m))

    def backward_microbatch(self, m: int) -> None:
        self.backward_layers(self.job.layers, m, lambda: self.fetch_grad(self.job.layers.stop, m))

    def backward_microbatch_by_layer(self, m: int) -> None:
        def grad():
            return self.fetch_grad(self.job.layers.stop, m)

        for i in reversed(self.job.layers):
            grad = self.backward_layers(range(i, i + 1), m, grad, post=i == self.job.layers.start)

    def backward_layers(self, layers: range, m: int, grad, post: bool = True) -> Slot:
        """Recompute ``layers`` for microbatch ``m``, then run their backward.

        The recompute needs only the saved input, so it is issued before waiting for
        the incoming gradient (``grad``: a slot on the device, or a function that
        fetches it from the mailbox).
        """
        call = self.call
        start = layers.start
        value = self.upload_input(Activation(start, m), requires_grad=start > 0)
        rng = None
        if call.preserve_rng_state:
            rng = self.mailbox.get(RngState(start, m))
            self.device.compute.wait(rng.event)
        graph = Slot()

        def recompute() -> None:
            inputs = value.value
            value.value = None
            with torch.enable_grad(), call.autocast.scope():
                current = self.device.get_rng_state() if rng is not None else None
                if rng is not None:
                    self.device.set_rng_state(rng.slot.value)
                try:
                    x = inplace_safe(inputs)
                    for i in layers:
                        x = self.run_layer(i, x, m, "recompute")
                finally:
                    if current is not None:
                        self.device.set_rng_state(current)
            graph.value = (inputs, x)

        self.compute(recompute, "recompute", m, layers)
        if callable(grad):
            grad = grad()
        input_grads = Slot()

        def backward() -> None:
            inputs, outputs = graph.value
            graph.value = None
            incoming = grad.value
            grad.value = None
            tensors, grads = pair_outputs_with_grads(outputs, incoming)
            if tensors:
                self.timed("backward", layers, lambda: torch.autograd.backward(tensors, grads))
            input_grads.value = grads_of_inputs(inputs) if start > 0 else None

        self.compute(backward, "backward", m, layers)
        if post and start > 0:
            computed = self.mark_compute()
            self.mailbox.post(InputGrad(start, m), self.download(input_grads, computed, "grad", m))
        return input_grads

    def fetch_grad(self, layer: int, m: int) -> Slot:
        handoff = self.mailbox.get(InputGrad(layer, m))
        return self.upload(handoff, f"grad {layer}", m, requires_grad=False)

    # -- weights -------------------------------------------------------------------------

    def write_back_buffers(self) -> None:
        layers = [self.worker.layers[i] for i in self.job.layers]
        gated = [layer.index for layer in layers if layer.index in self.worker.buffer_gates]
        if not gated:
            return
        hosts = {uid: t for layer in layers for uid, t in layer.host_buffers().items()}
        on_device = Slot()

        def take() -> None:
            on_device.value = dict(self.weights.value[1])

        self.device.compute.submit(take, OpInfo("bookkeeping", self.name))
        downloaded = self.download(on_device, self.mark_compute(), "buffers", None)

        def write() -> None:
            with torch.no_grad():
                for uid, tensor in downloaded.slot.value.items():
                    hosts[uid].copy_(tensor)

        def write_and_open_gates() -> None:
            try:
                write()
            finally:
                self.worker.open_buffer_gates(self.call, self.job)

        def failed(error: BaseException) -> None:
            self.worker.open_buffer_gates(self.call, self.job)
            self.call.latch.fail(self.job.index, error)

        self.worker.after([downloaded.event], write_and_open_gates, on_error=failed)

    def download_param_grads(self) -> None:
        store = self.worker.store
        grads = Slot()

        def take() -> None:
            params = self.weights.value[0]
            grads.value = {
                uid: t.grad
                for uid, t in params.items()
                if store.trainable(uid) and t.grad is not None
            }

        self.device.compute.submit(take, OpInfo("bookkeeping", self.name))
        downloaded = self.download(grads, self.mark_compute(), "param grads", None)

        def accumulate() -> None:
            # The optimizer may still be consuming the previous step's gradients.
            self.worker.versions.published.wait_for(self.call.steps_before)
            grads = downloaded.slot.value
            if grads:
                self.call.accumulated = True
            for uid, grad in grads.items():
                store.accumulate_grad(uid, grad, self.call.loss_scale)

        call = self.call
        self.worker.after(
            [downloaded.event],
            accumulate,
            on_error=lambda error: call.latch.fail(self.job.index, error),
        )

    def release(self) -> None:
        self.weights.value = None

    # -- activations -------------------------------------------------------------------

    def upload_input(self, key: Activation, requires_grad: bool, label: int | None = None) -> Slot:
        handoff = self.mailbox.get(key)
        slot = self.upload(handoff, f"act {key.layer}", key.microbatch, requires_grad)
        if label is None:
            return slot
        labelled = Slot()
        host_label = self.call.labels[label] if self.call.labels is not None else None
        device, stream = self.device, self.device.act_upload

        def attach() -> None:
            labelled.value = (slot.value, upload_tree(device, stream, host_label, False))
            slot.value = None

        stream.submit(attach, OpInfo("upload", "label"))
        self.device.compute.wait(stream.record())
        return labelled

    def upload(self, handoff: Handoff, what: str, m: int, requires_grad: bool) -> Slot:
        device, stream = self.device, self.device.act_upload
        if handoff.event is not None:
            stream.wait(handoff.event)
        marks = self.worker.compute_marks
        if len(marks) == 2:
            # At most one microbatch uploaded ahead of compute, counted when issued (the
            # upload's memory is taken then): wait on the host for the compute two back.
            marks[0].wait(None)
        slot = Slot()

        def upload() -> None:
            with failure_site(f"{self.name}: upload of {what}, microbatch {m}"):
                slot.value = upload_tree(device, stream, handoff.slot.value, requires_grad)

        stream.submit(upload, OpInfo("upload", f"{what} mb{m}"))
        self.device.compute.wait(stream.record())
        return slot

    def download(self, slot: Slot, after: Event, what: str, m: int | None) -> Handoff:
        device, stream = self.device, self.device.download
        stream.wait(after)
        host = Slot()

        def download() -> None:
            with failure_site(f"{self.name}: download of {what}, microbatch {m}"):
                host.value = download_tree(device, stream, slot.value)
                slot.value = None

        stream.submit(download, OpInfo("download", f"{what} mb{m}"))
        return Handoff(host, stream.record())

    # -- compute -------------------------------------------------------------------------

    def compute(self, fn: Callable[[], None], kind: str, m: int, layers: range | None = None):
        layers = layers if layers is not None else self.job.layers
        info = OpInfo(kind, f"{self.name} mb{m}", layers=tuple(layers), job=self.job.index)
        device = self.device

        where = f"{self.name}, {kind} of microbatch {m}"
        if len(layers) == 1:
            where += f" ({self.worker.layers[layers.start]})"

        def op() -> None:
            with failure_site(where), device.compute_scope(info):
                fn()

        device.compute.submit(op, info)

    def mark_compute(self) -> Event:
        event = self.device.compute.record()
        self.worker.compute_marks.append(event)
        return event

    def timed(self, kind: str, layers: range, fn: Callable[[], object]):
        """Inside a compute op: run ``fn``, model its kernel time, record its duration."""
        timer = self.device.timer()
        timer.start()
        result = fn()
        self.device.model_kernel_time(OpInfo(kind, layers=tuple(layers)))
        timer.stop()
        self.timings.append((kind, tuple(layers), timer))
        return result

    def run_layer(self, index: int, value, m: int, kind: str):
        layer = self.worker.layers[index]
        params, buffers = self.weights.value
        shell = layer.shell(self.device.index)
        layer.bind(shell, params, buffers, check_on_device=self.device.is_on_device)
        args, kwargs = value
        try:
            with failure_site(f"{layer} in {self.name}, microbatch {m}"):
                output = self.timed(kind, range(index, index + 1), lambda: shell(*args, **kwargs))
                return ((output,), {})
        finally:
            layer.unbind(shell)


def _check_loss(loss) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    if not loss.requires_grad:
        raise RuntimeError(
            "loss_fn returned a tensor that does not require grad (was it detached, or "
            "computed under torch.no_grad()?); with no trainable parameter in the model "
            "there is nothing to train: use model(x) under torch.no_grad() for inference"
        )
