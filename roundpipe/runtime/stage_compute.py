"""The bodies of a job's compute ops: forward, fused, recompute and backward.

Each function here runs *inside* a compute op on the device (never on the issuing
thread) and returns the op's result: a dict of handoff key → value for ops whose
values other ops download or read, or the recompute's ``(inputs, outputs)`` graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.keys import Activation, InputGrad, Loss, Output, RngState
from ..core.row_losses import per_row_losses
from ..core.tiling import sequence_tiling
from ..devices.base import OpInfo, Slot, Timer
from ..errors import failure_site
from .context import JobContext
from .seeds import layer_seed, microbatch_seed
from .transfer import grads_of_inputs, inplace_safe, pair_outputs_with_grads


class StageCompute:
    """Runs a job's layers on its device; records layer timings for the profiler."""

    def __init__(self, ctx: JobContext, weights: Slot) -> None:
        self.ctx = ctx
        self.device = ctx.device
        self.call = ctx.call
        self.job = ctx.job
        self.name = ctx.name
        self.layers = ctx.worker.layers
        self.weights = weights
        """(parameters by uid, buffers by uid) on the device."""
        self.timings: list[tuple[str, tuple[int, ...], Timer]] = []
        self.tied: dict[tuple[int, int], torch.Tensor] = {}
        """Per (layer, uid) of a weight several layers use: the layer's own leaf."""

    def forward(self, m: int, value: Slot, saves: frozenset[int], rng: frozenset[int]) -> dict:
        """Run the job's layers; hands over the output, the inputs of the layers in
        ``saves`` (kept for recompute) and, for the layers in ``rng``, the seed their
        recompute draws from (the microbatch's: docs/design.md#random-numbers)."""
        job, call = self.job, self.call
        out: dict = {}
        x = value.take()
        seed = microbatch_seed(call.rng_seed, m)
        with torch.no_grad(), call.autocast.scope():
            for i in job.layers:
                if i in rng:
                    out[RngState(i, m)] = seed
                if i in saves:  # a copy if the layer may modify its input in place
                    out[Activation(i, m)] = self.safe_input(i, x, clone_all=True)
                x = self.run_layer(i, x, m, "forward", seed)
        out[Activation(job.layers.stop, m)] = x
        return out

    def fused(self, m: int, value: Slot, label: Slot) -> dict:
        job, call = self.job, self.call
        inputs, target = value.take(), label.take()
        with torch.enable_grad():
            with call.autocast.scope():
                x = self.safe_input(job.layers.start, inputs)
                seed = microbatch_seed(call.rng_seed, m)
                for i in job.layers:
                    x = self.run_layer(i, x, m, "forward", seed)
                loss_fn = call.loss_fn
                assert loss_fn is not None, "a fused stage of a call without a loss_fn"
                with failure_site(f"loss_fn in {self.name}, microbatch {m}"):
                    loss = loss_fn(x[0][0], target)
                    _check_loss(loss)
                if call.loss_weights is not None:  # its share of the call's loss
                    loss = loss * call.loss_weights[m]
            scale = self.ctx.loss_scale
            scaled = loss if scale is None else loss * scale
            with failure_site(f"{self.name}, backward of microbatch {m}"):
                self.timed("backward", job.layers, scaled.backward)
        out = {Loss(m): loss.detach(), Output(m): x[0][0] if call.return_outputs else None}
        if job.layers.start > 0:
            out[InputGrad(job.layers.start, m)] = grads_of_inputs(inputs)
        return out

    def recompute(self, m: int, layers: range, value: Slot, rng: Slot | None) -> tuple:
        """Run ``layers`` again with autograd; with ``rng`` (the forward's seed) they draw
        the forward's random numbers, without it new ones."""
        call = self.call
        inputs = value.take()
        seed = microbatch_seed(call.rng_seed, m, redraw=True) if rng is None else rng.value
        with torch.enable_grad(), call.autocast.scope():
            x = self.safe_input(layers.start, inputs)
            for i in layers:
                x = self.run_layer(i, x, m, "recompute", seed)
        return inputs, x

    def backward(self, m: int, layers: range, graph: Slot, incoming: Callable[[], Any]) -> dict:
        inputs, outputs = graph.take()
        tensors, grads = pair_outputs_with_grads(outputs, incoming())
        if tensors:
            self.timed("backward", layers, lambda: torch.autograd.backward(tensors, grads))
        grad = grads_of_inputs(inputs) if layers.start > 0 else None
        return {InputGrad(layers.start, m): grad}

    def safe_input(self, index: int, value, clone_all: bool = False):
        """``value`` as layer ``index`` may receive it: copied (``inplace_safe``) unless
        the layer's module says it never modifies its input in place
        (``modifies_inputs = False``: docs/design.md#jobs-by-kind)."""
        if getattr(self.layers[index].module, "modifies_inputs", True) is False:
            return value
        return inplace_safe(value, clone_all)

    def timed(self, kind: str, layers: range, fn: Callable[..., object], *args, **kwargs):
        """Run ``fn(*args, **kwargs)``, model its kernel time, record its duration.

        The arguments are passed, not captured in a closure: a kept error's traceback
        keeps the functions of its frames alive (docs/design.md#errors)."""
        timer = self.device.timer()
        timer.start()
        result = fn(*args, **kwargs)
        self.device.model_kernel_time(OpInfo(kind, layers=tuple(layers)))
        timer.stop()
        self.timings.append((kind, tuple(layers), timer))
        return result

    def run_layer(self, index: int, value, m: int, kind: str, seed: int):
        """Run layer ``index`` drawing from ``layer_seed(seed, index)`` (``seed``: its
        microbatch's)."""
        layer = self.layers[index]
        params, buffers = self.weights.value
        if layer.tied_uids:
            params = {**params, **self.own_leaves(index, params)}
        shell = layer.shell(self.device)
        layer.bind(shell, params, buffers, check_on_device=self.device.is_on_device)
        args, kwargs = value
        try:
            with (
                failure_site(f"{layer} in {self.name}, microbatch {m}"),
                self.device.random_scope(layer_seed(seed, index), shell),
                sequence_tiling(self.call.config.seq_chunk_tokens),
                per_row_losses(self.call.config.row_losses),
            ):
                output = self.timed(kind, range(index, index + 1), shell, *args, **kwargs)
                return ((output,), {})
        finally:
            layer.unbind(shell)

    def own_leaves(self, index: int, params: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Layer ``index``'s leaves of the weights it shares with other layers: the same
        device memory, a gradient of their own (made once per job, so its microbatches
        accumulate into it). Each use's gradient then reaches the master on its own,
        whether the uses run in one stage or several: the sum does not depend on the
        plan (docs/design.md#gradients)."""
        leaves = {}
        for uid in self.layers[index].tied_uids:
            leaf = self.tied.get((index, uid))
            if leaf is None:
                weight = params[uid]
                leaf = self.tied[(index, uid)] = weight.detach().requires_grad_(
                    weight.requires_grad
                )
            leaves[uid] = leaf
        return leaves

    def tied_grads(self, trainable: Callable[[int], bool]) -> dict[tuple[int, int], torch.Tensor]:
        """The gradients of the shared weights' leaves, by (uid, layer), last layer first."""
        return {
            (uid, index): leaf.grad
            for (index, uid), leaf in sorted(self.tied.items(), reverse=True)
            if trainable(uid) and leaf.grad is not None
        }

    def release(self) -> None:
        self.tied = {}


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
