"""``RoundPipe``: wrap an ``nn.Sequential`` and train it round-robin over a device pool.

This module is the public API: each method checks and translates its arguments and
makes one call of the model's :class:`~roundpipe.runtime.calls.Runtime`, which runs
it end to end (docs/design.md#following-a-call). A RoundPipe model is driven from one
thread at a time; a second thread driving it at once gets a clear error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from .. import cluster
from ..cluster import CommOptions, NodeSync
from ..core.config import RoundPipeRunConfig, checked_run_config
from ..core.plan import Plan
from ..devices import DevicePool, EmulatedOptions, make_pool
from ..runtime.calls import PIN_MODES, Runtime
from .checkpoint import Checkpoints
from .observe import Observation
from .param_views import ParameterViews


class RoundPipe(Checkpoints, ParameterViews, Observation, nn.Module):
    """Train ``model`` (each entry of an ``nn.Sequential`` is one layer) on a device pool.

    >>> model = RoundPipe(nn.Sequential(...), devices="emulated:4")
    >>> opt = torch.optim.Adam(model.optim_parameters())
    >>> loss = model.forward_backward((x,), label=y, loss_fn=nn.functional.cross_entropy)
    >>> model.step(lambda: (opt.step(), opt.zero_grad()))

    Across nodes (one process per node, ``torch.distributed`` initialised, e.g. by
    ``torchrun``): ``process_group`` (default: the world group when initialised) turns
    on data parallelism over its ranks; every rank wraps the same model and calls
    with its share of the global batch. Each node keeps the masters, gradients and
    optimizer state of its share of the parameters (``optim_parameters()``), gradients
    are summed across nodes (averaged with ``grad_reduction="mean"``), and
    ``comm_options`` (:class:`~roundpipe.cluster.CommOptions`) sets the timeout and
    bucket size. See :mod:`roundpipe.cluster`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        devices: str | DevicePool | None = None,
        optim_dtype: torch.dtype | None = None,
        model_run_config: RoundPipeRunConfig | None = None,
        pin_model: str = "auto",
        emulated_options: EmulatedOptions | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        process_group: Any = None,
        grad_reduction: str = "sum",
        comm_options: CommOptions | None = None,
        names_from: nn.Module | None = None,
    ) -> None:
        super().__init__()
        model_run_config = checked_run_config(model_run_config, "model_run_config")
        if pin_model not in PIN_MODES:
            raise ValueError(f"pin_model must be one of {PIN_MODES}, got {pin_model!r}")
        if optim_dtype is not None and not (
            isinstance(optim_dtype, torch.dtype) and optim_dtype.is_floating_point
        ):
            raise TypeError(
                f"optim_dtype must be a floating point torch.dtype (e.g. torch.float32) or "
                f"None, got {optim_dtype!r}"
            )
        self.runtime = Runtime(
            model,
            functools.partial(make_pool, devices, emulated_options),
            owns_pool=not isinstance(devices, DevicePool),
            optim_dtype=optim_dtype,
            pin_model=pin_model,
            grad_scaler=grad_scaler,
            names_from=names_from or model,
            connect=functools.partial(
                cluster.connect,
                process_group=process_group,
                grad_reduction=grad_reduction,
                options=comm_options,
                grad_scaler=grad_scaler,
            ),
        )
        """The call owner (:mod:`roundpipe.runtime.calls`): for subclasses, not a stable API."""
        self.model = model
        self.training = model.training  # the mode it was wrapped in (eval after from_pretrained)
        self.run_config = model_run_config or RoundPipeRunConfig()
        self.pool = self.runtime.pool
        self.profiler = self.runtime.profiler
        self.planner = self.runtime.planner
        self.grad_scaler = grad_scaler
        self._optimizer_view = 0

    # -- introspection ----------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.runtime.layers)

    @property
    def node(self) -> NodeSync | None:
        """On several nodes, this node's side of the model (its ``rank``, ``world`` and
        ``comm``); None on one node."""
        return cast("NodeSync | None", self.runtime.node)

    @property
    def plan(self) -> Plan:
        """The plan calls use unless their run config pins another.

        Unless ``execute_plan`` pins one, this is the automatic plan: the partitioner's
        choice for the measured per-layer times (estimates before any) and the last
        ``step``'s mode, chosen again when measurements move materially or modes change.
        """
        return self.runtime.plan_for(self.run_config, count_call=False)

    def extra_repr(self) -> str:
        return f"devices={self.pool!r}, plan={self.plan}"

    # -- training ---------------------------------------------------------------------

    def forward_backward(
        self,
        input_args: tuple = (),
        input_kwargs: dict | None = None,
        label: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig | None = None,
    ):
        """Forward, loss and backward of every microbatch, pipelined.

        Returns the batch's loss (and the merged outputs if ``return_outputs``) as soon
        as it is known; the remaining backward stages keep running and the gradients of
        that loss accumulate into the master copies. The loss is the mean of the
        microbatches' ``loss_fn`` values weighted by their rows (microbatch ``i`` of
        ``r_i`` of the batch's ``R`` rows weighs ``r_i / R``), so a ``loss_fn``
        returning a microbatch's mean gives the whole batch's mean whatever the device
        or microbatch count; ``RoundPipeRunConfig(scale_grads=False)`` makes it their
        sum. The inputs and label are copied at call start: reuse them at once if you like.

        On several nodes (``process_group``), every rank calls it with its share of the
        global batch and the same number of microbatches, and it returns the loss of
        the global batch, which the gradients the next ``step`` applies are the
        gradients of: the mean over all its rows (each rank's microbatches weighted by
        their share of them), whatever ``grad_reduction``; with ``scale_grads=False``
        the sum over the ranks (their mean with ``grad_reduction="mean"``).
        """
        if loss_fn is None:
            raise TypeError("forward_backward needs a loss_fn(outputs, label) -> scalar tensor")
        config = checked_run_config(run_config, "run_config") or self.run_config
        args = tuple(input_args) if isinstance(input_args, (tuple, list)) else (input_args,)
        kwargs = dict(input_kwargs or {})
        loss, outputs = self.runtime.forward_backward(
            args, kwargs, label, loss_fn, return_outputs, config
        )
        return (loss, outputs) if return_outputs else loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on the pool, pipelined.

        Under ``torch.no_grad()`` (or with no trainable parameter) this is inference.
        With autograd enabled the output can be back-propagated later: ``.backward()``
        on (a function of) it runs the backward stages, recomputing from saved stage
        inputs, and accumulates the parameter gradients like ``forward_backward``.
        Prefer ``forward_backward``: it fuses the last stage and overlaps calls.
        """
        return self.runtime.forward(args, kwargs, self.run_config)

    def step(self, step_fn: Callable[[], object], is_async: bool = True) -> None:
        """Queue the optimizer update ``step_fn`` on the host optimizer thread.

        ``step_fn`` runs on the master parameters (build the optimizer over
        :meth:`optim_parameters`) once every gradient since the previous step is in.
        With ``is_async`` it returns at once and the next calls train with weights
        exactly one step stale; with ``is_async=False`` it waits and is exact. If
        ``step_fn`` fails, the masters stay as it left them and the gradients are kept.
        """
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
        self.runtime.step(step_fn, is_async)

    def train(self, mode: bool = True) -> RoundPipe:
        """As ``nn.Module.train`` (and ``eval()``): sets the wrapped model's modules'
        mode, so dropout is active in train mode only. Work in flight finishes in the
        mode it started in: a change of mode first waits for it (a backward's recompute
        must draw the masks its forward drew)."""
        if not isinstance(mode, bool):
            raise ValueError(f"training mode must be True or False, got {mode!r}")
        if not self.runtime.closed and any(m.training != mode for m in self.modules()):
            self.synchronize()
        return super().train(mode)

    def synchronize(self) -> None:
        """Wait for all queued work. Then the model's weights and ``.grad`` are current,
        and the next call uses the newest weights."""
        self.runtime.synchronize()

    # -- parameters ----------------------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped model's state dict (same keys), after waiting for queued work."""
        if not self.runtime.closed:
            self.synchronize()
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load into the wrapped model; the masters follow and the next call uses it."""
        with self.runtime.drained("load_state_dict"):
            if assign:
                raise ValueError(
                    "load_state_dict(assign=True) would replace the parameter tensors RoundPipe "
                    "tracks; load without assign (the values are copied in)"
                )
            result = self.model.load_state_dict(state_dict, strict=strict)
            self.runtime.adopt_written()
        return result

    def _apply(self, fn, recurse: bool = True):
        # .to(), .cuda(), .half() ... would move or recast the host-resident training
        # state behind the runtime's back; devices get their copies through uploads.
        raise RuntimeError(
            "a RoundPipe model keeps its weights in host memory and uploads them itself; "
            "do not move or cast it with .to()/.cuda()/.half(). Prepare the wrapped model "
            "(dtype) before wrapping it, and choose devices with devices=..."
        )

    def __reduce_ex__(self, protocol: Any):
        raise TypeError(
            "a RoundPipe model cannot be pickled or deep-copied (it owns threads and "
            "device state); save pipe.state_dict() (and your optimizer's state_dict()) "
            "and wrap a model loaded from it in a new RoundPipe"
        )

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for queued work, stop every thread this model started, and raise the
        error of any background work that failed and was not reported yet.

        Interrupted (Ctrl-C), it can be called again."""
        self.runtime.close()

    def __enter__(self) -> RoundPipe:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            self.close()
        except Exception:
            if exc_type is None:
                raise  # otherwise the exception already propagating is the one to see
