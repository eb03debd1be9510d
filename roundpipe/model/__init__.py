"""``RoundPipe``: wrap an ``nn.Sequential`` and train it round-robin over a device pool.

This module is the public API. The caller's thread only splits inputs, hands stage
jobs to the device workers and waits for what it must return (the loss, outputs);
the bookkeeping of calls and steps in flight, failures and thread lifetimes lives
in :mod:`roundpipe.runtime.session`, weight versions in
:mod:`roundpipe.runtime.versions`. A RoundPipe model is driven from one thread at a
time; a second thread driving it at once gets a clear error.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import cluster
from ..cluster import CommOptions
from ..core.config import RoundPipeRunConfig, checked_run_config
from ..core.keys import Loss, Output
from ..core.plan import Plan
from ..core.schedule import Schedule, lower
from ..devices import DevicePool, EmulatedOptions, make_pool
from ..planning.planner import AutoPlanner
from ..runtime import optimizer_guard
from ..runtime.call import AutocastState, Call
from ..runtime.inputs import own_and_split
from ..runtime.layers import check_layer_list, sequential_layers
from ..runtime.lifetime import finalize_unclosed
from ..runtime.microbatch import merge_outputs, microbatch_rows, weights_by_rows
from ..runtime.params import ParameterStore, parameter_names
from ..runtime.profiler import LayerProfiler
from ..runtime.seeds import CallSeeds
from ..runtime.session import Session
from ..runtime.sync import wait_future
from .checkpoint import Checkpoints
from .module_call import ModuleCall
from .observe import Observation
from .param_views import ParameterViews

PIN_MODES = ("auto", "alloc", "register", "off")


class RoundPipe(ModuleCall, Checkpoints, ParameterViews, Observation, nn.Module):
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
        _names_from: nn.Module | None = None,
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
        layers = sequential_layers(model)
        self.model = model
        self.training = model.training  # the mode it was wrapped in (eval after from_pretrained)
        self.run_config = model_run_config or RoundPipeRunConfig()
        self.pool = make_pool(devices, emulated_options)
        self._layers = layers
        self.profiler = LayerProfiler.for_modules([layer.module for layer in layers])
        self.grad_scaler = grad_scaler
        owns_pool = not isinstance(devices, DevicePool)
        pin = functools.partial(self.pool.pin, mode=pin_model)
        store = ParameterStore(layers, parameter_names(_names_from or model), optim_dtype, pin)
        try:
            self._node = cluster.connect(
                store, self.pool, layers, process_group, grad_reduction, comm_options, grad_scaler
            )
        except BaseException:
            if owns_pool:
                self.pool.close()
            raise
        self._session = Session(
            self.pool, owns_pool, store, layers, pin_model, grad_scaler, self.profiler, self._node
        )
        # Stops the threads of a model collected without close(); holds no reference to it.
        self._finalizer = weakref.finalize(self, finalize_unclosed, self._session)
        self._finalizer.atexit = False  # the session's own exit hook drains first
        optimizer_guard.watch(self._session.store)
        capacities = [device.memory_capacity() for device in self.pool]
        self.planner = AutoPlanner(
            self.profiler.cost_model, None if None in capacities else capacities
        )
        self._cursor = 0
        self._optimizer_view = 0
        self._seeds = CallSeeds(torch.initial_seed())  # docs/design.md#random-numbers

    # -- introspection ----------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def plan(self) -> Plan:
        """The plan calls use unless their run config pins another.

        Unless ``execute_plan`` pins one, this is the automatic plan: the partitioner's
        choice for the measured per-layer times (estimates before any) and the last
        ``step``'s mode, chosen again when measurements move materially or modes change.
        """
        return self._plan_for(self.run_config, count_call=False)

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
        with self._session.enter("forward_backward") as session:
            self._begin(session)
            session.wait_for_gradient_room()
            num = config.microbatches_for(len(self.pool))
            inputs, labels, owned = self._own_inputs(config, args, kwargs, label, num)
            weights = self._loss_weights(config, microbatch_rows(inputs))
            schedule = lower(self._plan_for(config), len(self.pool), self._cursor)
            call = self._start_call(
                session, schedule, inputs, labels, config, loss_fn, return_outputs, owned, weights
            )
            error = None
            try:
                losses = [call.read(Loss(m)) for m in range(num)]
                outputs = [call.read(Output(m)) for m in range(num)] if return_outputs else None
                # Each already weighted (Call.loss_weights): the loss of the gradients.
                loss = torch.stack([v.reshape(()) for v in losses]).sum()  # loss_fn's dtype
            except Exception as exc:
                error = call.latch.wait() or exc  # the first job that failed
            if self._node is not None:
                loss, error = self._node.global_loss(None if error else loss, error)
            if error is not None:
                session.fail(error)
            session.returned(call)
        if not return_outputs:
            return loss
        return loss, (config.merge_output or merge_outputs)(outputs)

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
        with self._session.enter("step") as session:
            self._begin(session)
            task = session.queue_step(step_fn, is_async)
            self.planner.saw_step(is_async)  # later calls are planned for this mode
            if is_async:
                return
            error = wait_future(task.done)
            if error is not None:
                session.fail(error, step_error=True)
            session.settle()  # a call of the step failed: the step was skipped; say why

    def train(self, mode: bool = True) -> RoundPipe:
        """As ``nn.Module.train`` (and ``eval()``): sets the wrapped model's modules'
        mode, so dropout is active in train mode only. Work in flight finishes in the
        mode it started in: a change of mode first waits for it (a backward's recompute
        must draw the masks its forward drew)."""
        if not isinstance(mode, bool):
            raise ValueError(f"training mode must be True or False, got {mode!r}")
        if not self._session.closed and any(m.training != mode for m in self.modules()):
            self.synchronize()
        return super().train(mode)

    def synchronize(self) -> None:
        """Wait for all queued work. Then the model's weights and ``.grad`` are current,
        and the next call uses the newest weights."""
        with self._session.enter("synchronize") as session:
            session.check_open()
            session.synchronize()

    # -- parameters ----------------------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped model's state dict (same keys), after waiting for queued work."""
        if not self._session.closed:
            self.synchronize()
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load into the wrapped model; the masters follow and the next call uses it."""
        with self._session.enter("load_state_dict") as session:
            self.synchronize()
            if assign:
                raise ValueError(
                    "load_state_dict(assign=True) would replace the parameter tensors RoundPipe "
                    "tracks; load without assign (the values are copied in)"
                )
            result = self.model.load_state_dict(state_dict, strict=strict)
            session.synchronize()  # adopts what was written
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
        session = self._session
        if session.closed:
            return
        with session.enter("close"):
            error = session.close()
            self._finalizer.detach()
            optimizer_guard.unwatch(session.store)
        if error is not None:
            raise error from error.__cause__

    def __enter__(self) -> RoundPipe:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            self.close()
        except Exception:
            if exc_type is None:
                raise  # otherwise the exception already propagating is the one to see

    # -- internals -----------------------------------------------------------------------

    def _begin(self, session: Session) -> None:
        """Before new work: a usable session, failures reported, the user's changes since
        the last call honoured (writes into tensors adopted, changed modules re-copied)
        or refused."""
        session.check_open()
        session.store.check_trainable()
        check_layer_list(self.model, self._layers)
        session.settle()
        changed = [layer for layer in self._layers if layer.changed()]
        if changed or any(entry.externally_modified() for entry in session.store.entries.values()):
            session.synchronize()  # adopts what the user wrote; nothing runs the old shells
        if changed:
            session.layers_changed()
            for layer in changed:
                layer.refresh()
        session.store.ensure_masters()

    def _loss_weights(self, config: RoundPipeRunConfig, rows: list[int]) -> tuple | None:
        """What each microbatch's loss is multiplied by (``Call.loss_weights``): under
        ``scale_grads`` its share of the rows the loss is the mean over (on several
        nodes, of the global batch's: :meth:`~roundpipe.cluster.NodeSync.check_call`)."""
        total = sum(rows)
        if self._node is not None:  # collective: every rank of a call takes part
            total = self._node.check_call(len(rows), total)
        return weights_by_rows(rows, total) if config.scale_grads else None

    def _plan_for(self, config: RoundPipeRunConfig, count_call: bool = True) -> Plan:
        if isinstance(config.execute_plan, Plan):
            return config.execute_plan.validate(self.num_layers)
        choose = self.planner.plan if count_call else self.planner.current
        devices = len(self.pool)
        return choose(devices, config.microbatches_for(devices), config.weight_chunk_bytes)

    def _own_inputs(self, config, args: tuple, kwargs: dict, label: Any, num: int):
        """Per-microbatch copies of the inputs and labels, and the buffers they use."""
        return own_and_split(self._session.inputs, config, args, kwargs, label, num)

    def _start_call(
        self,
        session: Session,
        schedule: Schedule,
        inputs: list,
        labels,
        config,
        loss_fn,
        return_outputs: bool,
        owned: list,
        loss_weights: tuple[float, ...] | None = None,
    ) -> Call:
        call = Call.start(
            schedule,
            config,
            inputs,
            labels,
            session.ledger.versions,
            seq=session.ledger.next_seq,
            rewrites_before=session.ledger.rewrites,
            layer_changes_before=session.ledger.layer_changes,
            autocast=AutocastState.capture(self.pool.devices[0].torch_device.type),
            loss_fn=loss_fn,
            return_outputs=return_outputs,
            rng_seed=self._seeds.next_call(),
            loss_weights=loss_weights,
        )
        self._cursor = schedule.next_device
        session.issue(call, self._loss_scale() if loss_fn is not None else None, owned)
        return call

    def _loss_scale(self) -> float | None:
        """The GradScaler's current scale, which this call's losses are multiplied by."""
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            return None
        # scale() creates the scaler's state on first use; its step() insists on it. On
        # the host, where the masters and their gradients live: reading it is then no
        # device synchronisation, once per call.
        self.grad_scaler.scale(torch.ones(()))
        return float(self.grad_scaler.get_scale())
