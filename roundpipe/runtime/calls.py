"""The call owner: a model's runtime built from plain values, and every call run through it.

:class:`Runtime` is what a :class:`~roundpipe.RoundPipe` holds: the parameter store,
the session (threads and ledger), the planner and the call seeds. Every public method
of the model is argument translation plus one method here, which runs it end to end
in the order the session's rules need: enter (one driving thread, Ctrl-C deferred),
begin (the user's changes since the last call honoured), the call as one frozen
:class:`~.call.CallRequest`, and the failure rules on the way out
(docs/design.md#following-a-call).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import nn

from ..core.config import RoundPipeRunConfig
from ..core.keys import Activation, InputGrad, Loss, Output
from ..core.plan import Plan
from ..core.schedule import Schedule, lower, lower_unfused
from ..devices.base import DevicePool, Slot
from ..planning.planner import AutoPlanner
from . import optimizer_guard
from .call import AutocastState, Call, CallRequest
from .deferred import attach_backward
from .inputs import HostBufferPool, own_and_split
from .layers import LayerBinding, check_layer_list, sequential_layers
from .lifetime import finalize_unclosed
from .microbatch import merge_outputs, microbatch_rows, weights_by_rows
from .mixed_pool import check_recompute_classes, layers_drawing_random
from .optimizer import NodeSteps
from .params import ParameterStore, parameter_names
from .profiler import LayerProfiler
from .seeds import CallSeeds
from .session import Session
from .sync import Handoff, wait_future

PIN_MODES = ("auto", "alloc", "register", "off")


class Node(NodeSteps, Protocol):
    """What calls need of a node on several nodes (:class:`roundpipe.cluster.NodeSync`)."""

    def check_call(self, num_microbatches: int, rows: int) -> float: ...

    def global_loss(
        self, local: torch.Tensor | None, error: BaseException | None
    ) -> tuple[torch.Tensor, BaseException | None]: ...


Connect = Callable[[ParameterStore, DevicePool, list[LayerBinding]], Node | None]
"""Joins the other nodes for the parameters a store holds (None: one node)."""


class Runtime:
    """One model's runtime: its host state, threads and calls."""

    def __init__(
        self,
        model: nn.Module,
        make_pool: Callable[[], DevicePool],
        *,
        owns_pool: bool,
        optim_dtype: torch.dtype | None,
        pin_model: str,
        grad_scaler: torch.amp.GradScaler | None,
        names_from: nn.Module,
        connect: Connect,
    ) -> None:
        """The runtime of ``model`` (an ``nn.Sequential``) on the pool ``make_pool()``
        makes once the model was found fit (closed with the runtime if ``owns_pool``); its
        masters take the parameter names of ``names_from``; ``connect`` joins the other
        nodes, if any."""
        self.model = model
        self.layers = sequential_layers(model)
        self.pool = pool = make_pool()
        try:
            self.grad_scaler = grad_scaler
            self.profiler = LayerProfiler.for_modules(
                [layer.module for layer in self.layers], pool.device_classes()
            )
            pin = functools.partial(pool.pin, mode=pin_model)
            names = parameter_names(names_from)
            self.store = ParameterStore(self.layers, names, optim_dtype, pin)
            self.node = connect(self.store, pool, self.layers)
        except BaseException:
            if owns_pool:
                pool.close()
            raise
        input_pin = functools.partial(pool.pin, mode="off" if pin_model == "off" else "alloc")
        self.inputs = HostBufferPool(input_pin)
        self.session = Session(
            pool,
            owns_pool,
            self.store,
            self.layers,
            pin_model,
            grad_scaler,
            self.profiler,
            self.inputs,
            self.node,
        )
        # Stops the threads of a model collected without close(); holds no reference to it.
        self._finalizer = weakref.finalize(self, finalize_unclosed, self.session)
        self._finalizer.atexit = False  # the session's own exit hook drains first
        optimizer_guard.watch(self.store)
        capacities = [device.memory_capacity() for device in pool]
        known = [c for c in capacities if c is not None]
        self.planner = AutoPlanner(
            self.profiler.cost_model, known if len(known) == len(capacities) else None
        )
        self.seeds = CallSeeds(torch.initial_seed())  # docs/design.md#random-numbers
        self._cursor = 0

    @property
    def closed(self) -> bool:
        return self.session.closed

    def plan_for(self, config: RoundPipeRunConfig, count_call: bool = True) -> Plan:
        """The plan a call with ``config`` runs: the pinned one, else the planner's."""
        if isinstance(config.execute_plan, Plan):
            return config.execute_plan.validate(len(self.layers))
        choose = self.planner.plan if count_call else self.planner.current
        devices = len(self.pool)
        return choose(devices, config.microbatches_for(devices), config.weight_chunk_bytes)

    # -- calls ---------------------------------------------------------------------------

    def forward_backward(
        self,
        args: tuple,
        kwargs: dict,
        label: Any,
        loss_fn: Callable,
        return_outputs: bool,
        config: RoundPipeRunConfig,
    ) -> tuple[torch.Tensor, Any]:
        """A fused training call: the batch's loss and, if ``return_outputs``, its merged
        outputs (else None), as soon as they are known."""
        session = self.session
        with session.enter("forward_backward"):
            self._begin()
            session.wait_for_gradient_room()
            num = config.microbatches_for(len(self.pool))
            inputs, labels, owned = own_and_split(self.inputs, config, args, kwargs, label, num)
            weights = self._loss_weights(config, microbatch_rows(inputs))
            schedule = lower(self.plan_for(config), len(self.pool), self._cursor)
            self._check_recomputes(schedule, config)
            request = self._request(schedule, config, inputs, labels, loss_fn, return_outputs)
            call = self._start(replace(request, loss_weights=weights), owned)
            error = None
            try:
                losses = [call.read(Loss(m)) for m in range(num)]
                outputs = [call.read(Output(m)) for m in range(num)] if return_outputs else None
                # Each already weighted (CallRequest.loss_weights): the loss of the gradients.
                loss = torch.stack([v.reshape(()) for v in losses]).sum()  # loss_fn's dtype
            except Exception as exc:
                error = call.latch.wait() or exc  # the first job that failed
            if self.node is not None:
                loss, error = self.node.global_loss(None if error else loss, error)
            if error is not None:
                session.fail(error)
            session.returned(call)
        if outputs is None:
            return loss, None
        return loss, (config.merge_output or merge_outputs)(outputs)

    def forward(self, args: tuple, kwargs: dict, config: RoundPipeRunConfig) -> Any:
        """``model(...)``: the merged outputs; with autograd enabled (and a trainable
        parameter) wired to a later ``.backward()`` that runs the backward stages."""
        training = torch.is_grad_enabled() and any(p.requires_grad for p in self.model.parameters())
        if training and config.merge_output is not None:
            raise NotImplementedError(
                "model(...) with autograd enabled needs the default output merging; "
                "use forward_backward(...) with a custom merge_output"
            )
        session = self.session
        with session.enter("forward"):
            self._begin(trains=training)
            num = config.microbatches_for(len(self.pool))
            inputs, _, owned = own_and_split(self.inputs, config, args, kwargs, None, num)
            plan = self.plan_for(config)
            schedule = lower_unfused(plan, len(self.pool), self._cursor, with_backward=training)
            if training:
                self._check_recomputes(schedule, config)
            request = self._request(schedule, config, inputs, None, None, False)
            # A training call's inputs are re-read by its later backward: not recycled.
            call = self._start(request, [] if training else owned)
            try:
                outputs = [call.read(Activation(len(self.layers), m))[0][0] for m in range(num)]
            except Exception as exc:
                session.fail(call.latch.wait() or exc)
            session.returned(call)
        merged = (config.merge_output or merge_outputs)(outputs)
        if not training:
            return merged
        return attach_backward(merged, outputs, functools.partial(self._backward, call))

    def _backward(self, call: Call, grads_per_microbatch: list[list]) -> None:
        """A ``model(x)`` output's ``.backward()``: post the output gradients, run the
        call's backward jobs and wait for them."""
        session = self.session
        with session.enter("backward"):
            session.check_backward(call, self.layers)
            self._begin()
            loss_scale = self._loss_scale()  # the user scaled the loss just before
            for m, grads in enumerate(grads_per_microbatch):
                call.mailbox.post(InputGrad(len(self.layers), m), Handoff(Slot(grads), None))
            session.issue_backward(call, loss_scale)
            error = call.latch.wait()
            if error is not None:
                session.fail(error)
            session.returned(call)

    def _request(
        self, schedule, config, inputs: list, labels: list | None, loss_fn, return_outputs: bool
    ) -> CallRequest:
        return CallRequest(
            schedule=schedule,
            config=config,
            inputs=inputs,
            labels=labels,
            loss_fn=loss_fn,
            return_outputs=return_outputs,
            autocast=AutocastState.capture(self.pool.devices[0].torch_device.type),
            rng_seed=self.seeds.next_call(),
        )

    def _start(self, request: CallRequest, owned: list) -> Call:
        loss_scale = self._loss_scale() if request.loss_fn is not None else None
        self._cursor = request.schedule.next_cursor
        return self.session.start(request, loss_scale, owned)

    def _check_recomputes(self, schedule: Schedule, config: RoundPipeRunConfig) -> None:
        """On a mixed pool, refuse a call that would recompute a layer drawing random
        numbers on another kind of card than its forward ran on (unless its recompute
        draws anew by request, ``preserve_rng_state=False``; docs/design.md#mixed-pools)."""
        if self.pool.mixed and config.preserve_rng_state:
            drawing = layers_drawing_random([layer.module for layer in self.layers])
            check_recompute_classes(schedule, self.pool.device_classes(), drawing)

    def _begin(self, trains: bool = True) -> None:
        """Before new work: a usable session, failures reported, the user's changes since
        the last call honoured (writes into tensors adopted, changed modules re-copied)
        or refused. A call that ``trains`` nothing (a forward without autograd) accepts
        parameters frozen for its duration, as peft's ``disable_adapter()`` freezes the
        adapters it turns off."""
        session = self.session
        session.check_open()
        if trains:
            self.store.check_trainable()
        check_layer_list(self.model, self.layers)
        session.settle()
        changed = [layer for layer in self.layers if layer.changed()]
        if changed or self.store.externally_modified():
            session.synchronize()  # adopts what the user wrote; nothing runs the old shells
        if changed:
            session.layers_changed()
            for layer in changed:
                layer.refresh()
        self.store.ensure_masters()

    def _loss_weights(self, config: RoundPipeRunConfig, rows: list[int]) -> tuple | None:
        """What each microbatch's loss is multiplied by (``CallRequest.loss_weights``):
        under ``scale_grads`` its share of the rows the loss is the mean over (on several
        nodes, of the global batch's: :meth:`~roundpipe.cluster.NodeSync.check_call`)."""
        total: float = sum(rows)
        if self.node is not None:  # collective: every rank of a call takes part
            total = self.node.check_call(len(rows), int(total))
        return weights_by_rows(rows, total) if config.scale_grads else None

    def _loss_scale(self) -> float | None:
        """The GradScaler's current scale, which this call's losses are multiplied by."""
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            return None
        # scale() creates the scaler's state on first use; its step() insists on it. On
        # the host, where the masters and their gradients live: reading it is then no
        # device synchronisation, once per call.
        self.grad_scaler.scale(torch.ones(()))
        return float(self.grad_scaler.get_scale())

    # -- steps and the masters -----------------------------------------------------------

    def step(self, step_fn: Callable[[], object], is_async: bool) -> None:
        """Queue ``step_fn`` on the optimizer thread; unless ``is_async``, wait for it."""
        session = self.session
        with session.enter("step"):
            self._begin()
            task = session.queue_step(step_fn, is_async)
            self.planner.saw_step(is_async)  # later calls are planned for this mode
            if is_async:
                return
            error = wait_future(task.done)
            if error is not None:
                session.fail(error, step_error=True)
            session.settle()  # a call of the step failed: the step was skipped; say why

    def in_step_fn(self) -> bool:
        """Whether this thread is the optimizer thread, inside a ``step_fn``."""
        return self.session.in_step_fn()

    def masters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.store.masters()

    def zero_grad(self, set_to_none: bool) -> None:
        """Discard the gradients the next step would apply (inside ``step_fn``: at once;
        else once the calls in flight delivered theirs)."""
        if self.in_step_fn():
            self.store.discard_grads(set_to_none)
            return
        session = self.session
        with session.enter("zero_grad"):
            session.check_open()
            error = session.recover(None)
            self.store.discard_grads(set_to_none)
            self.model.zero_grad(set_to_none)  # the copies synchronize() showed
            session.fail_if(error)

    # -- drained ---------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for all queued work; the user's tensors then show the newest weights."""
        with self.drained("synchronize"):
            pass

    @contextlib.contextmanager
    def drained(self, what: str) -> Iterator[None]:
        """For ``what``, a public method: this thread drives, nothing is in flight and
        the user's tensors show the newest weights for the length of the block."""
        session = self.session
        with session.enter(what):
            session.check_open()
            session.synchronize()
            yield

    def adopt_written(self, masters: dict[str, torch.Tensor] | None = None) -> None:
        """Inside :meth:`drained`: what was written into the model's tensors becomes the
        weights (the masters take it, then the full precision of ``masters``)."""
        self.session.synchronize()
        if masters is not None:
            self.store.restore_masters(masters)
            self.session.make_current()  # .grad shows the restored gradients

    def close(self) -> None:
        """Drain, stop every thread, raise the first unreported failure (interrupted:
        call again)."""
        session = self.session
        if session.closed:
            return
        with session.enter("close"):
            error = session.close()
            self._finalizer.detach()
            optimizer_guard.unwatch(self.store)
        if error is not None:
            raise error from error.__cause__
