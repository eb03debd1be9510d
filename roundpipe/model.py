"""``RoundPipe``: wrap an ``nn.Sequential`` and train it round-robin over a device pool.

The caller's thread only splits inputs, hands stage jobs to the device workers and
waits for what it must return (the loss, outputs). Everything else happens on the
worker, completer and optimizer threads; ``synchronize()`` waits for all of it.
A RoundPipe model is driven from one thread at a time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .config import RoundPipeRunConfig
from .devices import DevicePool, EmulatedOptions, Slot, make_pool
from .errors import RoundPipeError
from .microbatch import batch_size, merge_outputs, split_inputs, split_tree, tensor_leaves
from .plan import Plan
from .runtime.call import AutocastState, Call
from .runtime.layers import sequential_layers
from .runtime.optimizer import OptimizerThread
from .runtime.params import ParameterStore
from .runtime.planner import AutoPlanner
from .runtime.profiler import LayerProfiler
from .runtime.sync import Handoff, VersionGate
from .runtime.worker import DeviceWorker
from .schedule import lower, lower_unfused
from .timeline import Span, Timeline

PIN_MODES = ("alloc", "register", "off")


class RoundPipe(nn.Module):
    """Train ``model`` (each child of an ``nn.Sequential`` is one layer) on a device pool.

    >>> model = RoundPipe(nn.Sequential(...), devices="emulated:4")
    >>> opt = torch.optim.Adam(model.optim_parameters())
    >>> loss = model.forward_backward((x,), label=y, loss_fn=nn.functional.cross_entropy)
    >>> model.step(lambda: (opt.step(), opt.zero_grad()))
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        devices: str | DevicePool | None = None,
        optim_dtype: torch.dtype | None = None,
        model_run_config: RoundPipeRunConfig | None = None,
        pin_model: str = "alloc",
        emulated_options: EmulatedOptions | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        super().__init__()
        layers = sequential_layers(model)
        if pin_model not in PIN_MODES:
            raise ValueError(f"pin_model must be one of {PIN_MODES}, got {pin_model!r}")
        self.model = model
        self.run_config = model_run_config or RoundPipeRunConfig()
        self._owns_pool = not isinstance(devices, DevicePool)
        self.pool = make_pool(devices, emulated_options)
        self._layers = layers
        names = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), name)
        self._store = ParameterStore(
            layers, names, optim_dtype, pin=lambda t: self.pool.pin(t, pin_model)
        )
        self._buffer_gates = {layer.index: VersionGate(0) for layer in layers if layer.buffer_uids}
        self.profiler = LayerProfiler(
            [sum(p.numel() for p in layer.module.parameters()) for layer in layers],
            [
                sum(p.numel() * p.element_size() for p in layer.module.parameters())
                for layer in layers
            ],
        )
        self._workers = [
            DeviceWorker(device, layers, self._store, self._buffer_gates, self.profiler)
            for device in self.pool
        ]
        self.grad_scaler = grad_scaler
        self._optimizer = OptimizerThread(self._store, grad_scaler)
        capacities = [device.memory_capacity() for device in self.pool]
        self.planner = AutoPlanner(self.profiler, None if None in capacities else capacities)
        self._cursor = 0
        self._seq = 0
        self._steps = 0
        self._use_version = 0
        self._since_step: list[Call] = []
        self._in_flight: list[Call] = []
        self._pending_steps: list[Future] = []
        self._optimizer_view = 0
        self._closed = False

    # -- introspection ----------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def plan(self) -> Plan:
        """The plan calls use unless their run config pins another.

        Unless ``execute_plan`` pins one, this is the automatic plan: the partitioner's
        choice for the measured per-layer times (size-based estimates before the first
        measurements), chosen again only when the measurements move materially.
        """
        pinned = self.run_config.execute_plan
        if isinstance(pinned, Plan):
            return pinned.validate(self.num_layers)
        return self.planner.current(len(self.pool), self._microbatch_count(self.run_config))

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

        Returns the sum of the microbatch losses (and the merged outputs if
        ``return_outputs``) as soon as the loss is known; the remaining backward
        stages keep running and their gradients accumulate into the master copies.
        """
        if loss_fn is None:
            raise TypeError("forward_backward needs a loss_fn(outputs, label) -> scalar tensor")
        config = run_config or self.run_config
        input_args = tuple(input_args) if isinstance(input_args, (tuple, list)) else (input_args,)
        input_kwargs = dict(input_kwargs or {})
        self._before_call()
        num = self._microbatch_count(config)
        inputs = self._split_inputs(config, input_args, input_kwargs, num)
        labels = self._split_label(config, label, num, input_args, input_kwargs)
        plan = self._plan_for(config)
        call = self._start_call(
            lower(plan, len(self.pool), self._cursor),
            inputs,
            config,
            loss_fn,
            labels,
            return_outputs,
        )
        try:
            losses = [self._read(call, ("loss", m)) for m in range(num)]
            outputs = [self._read(call, ("out", m)) for m in range(num)] if return_outputs else None
        except BaseException as exc:
            self._fail(exc)
        loss = torch.stack([torch.as_tensor(v).reshape(()).float() for v in losses]).sum()
        if not return_outputs:
            return loss
        merge = config.merge_output or merge_outputs
        return loss, merge(outputs)

    def step(self, step_fn: Callable[[], object], is_async: bool = True) -> None:
        """Queue the optimizer update ``step_fn`` on the host optimizer thread.

        ``step_fn`` runs on the master parameters (build the optimizer over
        :meth:`optim_parameters`) once every gradient since the previous step is in.
        With ``is_async`` it returns at once and the next calls train with weights
        exactly one step stale; with ``is_async=False`` it waits and is exact.
        """
        self._check_open()
        self._raise_failures()
        self._store.ensure_masters()
        calls, self._since_step = self._since_step, []
        self._steps += 1
        future = self._optimizer.step(step_fn, calls, self._steps)
        if is_async:
            self._pending_steps.append(future)
            self._use_version = self._steps - 1
            return
        error = future.result()
        if error is not None:
            self._fail(error)
        self._use_version = self._steps

    def synchronize(self) -> None:
        """Wait for all queued work; then the model's weights and ``.grad`` are current."""
        self._wait_idle()
        self._store.make_model_current()

    # -- timelines ------------------------------------------------------------------------

    def start_timeline(self) -> None:
        """Record every executed device op from now on (see :meth:`timeline`)."""
        self._wait_idle()
        self.pool.start_recording()
        self._timeline_origin = time.perf_counter()

    def timeline(self) -> Timeline:
        """Wait for queued work; the ops run since :meth:`start_timeline`, as a Timeline.

        Export it with ``save_chrome_trace(path)`` (Perfetto) or ``save_gantt(path)``.
        """
        self.synchronize()
        origin = getattr(self, "_timeline_origin", 0.0)
        return Timeline(
            [
                Span(
                    device=r.device,
                    stream=r.stream,
                    kind=r.info.kind,
                    label=r.info.label,
                    start=max(r.start - origin, 0.0),
                    end=max(r.end - origin, 0.0),
                )
                for r in self.pool.spans()
            ]
        )

    # -- inference / plain forward -------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on the pool, pipelined.

        Under ``torch.no_grad()`` (or with no trainable parameter) this is inference.
        With autograd enabled the output can be back-propagated later: ``.backward()``
        on (a function of) it runs the backward stages, recomputing from saved stage
        inputs, and accumulates the parameter gradients like ``forward_backward``.
        Prefer ``forward_backward``: it fuses the last stage and overlaps calls.
        """
        config = self.run_config
        training = torch.is_grad_enabled() and any(p.requires_grad for p in self.model.parameters())
        if training and config.merge_output is not None:
            raise NotImplementedError(
                "model(...) with autograd enabled needs the default output merging; "
                "use forward_backward(...) with a custom merge_output"
            )
        self._before_call()
        num = self._microbatch_count(config)
        inputs = self._split_inputs(config, args, kwargs, num)
        schedule = lower_unfused(
            self._plan_for(config), len(self.pool), self._cursor, with_backward=training
        )
        call = self._start_call(
            schedule, inputs, config, None, None, False, forward_only=not training
        )
        try:
            outputs = [self._read(call, ("act", self.num_layers, m))[0][0] for m in range(num)]
        except BaseException as exc:
            self._fail(exc)
        merged = (config.merge_output or merge_outputs)(outputs)
        if not training:
            return merged
        return _attach_backward(merged, outputs, lambda grads: self._backward_call(call, grads))

    def _backward_call(self, call: Call, grads_per_microbatch: list[list]) -> None:
        """Post the output gradients, run the call's backward jobs and wait for them."""
        layers = self.num_layers
        call.loss_scale = self._loss_scale()  # the user scaled the loss just before
        for m, grads in enumerate(grads_per_microbatch):
            call.mailbox.post(("grad", layers, m), Handoff(Slot(grads), None))
        backward_jobs = call.schedule.backward_jobs
        call.latch.add(len(backward_jobs))
        if call not in self._in_flight:
            self._in_flight.append(call)
        for job in backward_jobs:
            self._workers[job.device].submit(call, job)
        error = call.latch.wait()
        if error is not None:
            self._fail(error)

    # -- parameters ----------------------------------------------------------------------

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        """The master (optimizer) parameters; build your optimizer over these."""
        for _, master in self._store.masters():
            yield master

    def optim_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self._store.masters()

    @contextlib.contextmanager
    def optimizer_ctx(self) -> Iterator[None]:
        """Inside, ``parameters()`` / ``named_parameters()`` yield the master parameters."""
        self._optimizer_view += 1
        try:
            yield
        finally:
            self._optimizer_view -= 1

    OptimizerCtx = optimizer_ctx

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        if self._optimizer_view:
            return self.optim_parameters()
        return super().parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        if self._optimizer_view:
            return self.optim_named_parameters()
        return super().named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped model's state dict (same keys), after waiting for queued work."""
        if not self._closed:
            self.synchronize()
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load into the wrapped model; the master copies follow the loaded weights."""
        self.synchronize()
        result = self.model.load_state_dict(state_dict, strict=strict, assign=assign)
        self._store.adopt_external_writes(force=True)
        return result

    def _apply(self, fn, recurse: bool = True):
        # .to(), .cuda(), .half() ... would move or recast the host-resident training
        # state behind the runtime's back; devices get their copies through uploads.
        raise RuntimeError(
            "a RoundPipe model keeps its weights in host memory and uploads them itself; "
            "do not move or cast it with .to()/.cuda()/.half(). Prepare the wrapped model "
            "(dtype) before wrapping it, and choose devices with devices=..."
        )

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for queued work, stop every thread this model started, and raise the
        error of any background work that failed and was not reported yet."""
        if self._closed:
            return
        errors: list[BaseException] = []
        try:
            errors = self._drain()
        finally:
            self._closed = True
            for worker in self._workers:
                worker.stop()
            self._optimizer.stop()
            if self._owns_pool:
                self.pool.close()
        if errors:
            raise errors[0] from errors[0].__cause__

    def __enter__(self) -> RoundPipe:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            self.close()
        except Exception:
            if exc_type is None:
                raise  # otherwise the exception already propagating is the one to see

    # -- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this RoundPipe model was closed")

    def _before_call(self) -> None:
        self._check_open()
        self._raise_failures()
        if any(entry.externally_modified() for entry in self._store.entries.values()):
            self._drain()
            self._store.adopt_external_writes()
        self._store.ensure_masters()

    def _microbatch_count(self, config: RoundPipeRunConfig) -> int:
        return config.num_microbatch or len(self.pool) + 1

    def _plan_for(self, config: RoundPipeRunConfig) -> Plan:
        if isinstance(config.execute_plan, Plan):
            return config.execute_plan.validate(self.num_layers)
        return self.planner.plan(len(self.pool), self._microbatch_count(config))

    def _split_inputs(self, config, args: tuple, kwargs: dict, num: int) -> list:
        _check_on_host((args, kwargs), "the inputs")
        if config.split_input is not None:
            pieces = config.split_input(args, kwargs, num)
            if len(pieces) != num:
                raise ValueError(f"split_input returned {len(pieces)} microbatches, expected {num}")
            return pieces
        size = batch_size((args, kwargs), "the inputs")
        if size is None:
            raise ValueError(
                "the inputs hold no tensor to split into microbatches; pass a tensor batch "
                "or a custom split_input in RoundPipeRunConfig"
            )
        if size < num:
            raise ValueError(
                f"the batch has {size} samples but each call splits it into {num} "
                f"microbatches; pass a batch of at least {num} samples or set "
                f"RoundPipeRunConfig(num_microbatch={size}) (or fewer)"
            )
        return split_inputs(args, kwargs, num)

    def _split_label(self, config, label: Any, num: int, args: tuple, kwargs: dict) -> list:
        if label is None:
            return [None] * num
        _check_on_host(label, "the label")
        if config.split_label is not None:
            pieces = config.split_label(label, num)
            if len(pieces) != num:
                raise ValueError(f"split_label returned {len(pieces)} microbatches, expected {num}")
            return pieces
        size = batch_size(label, "the label")
        if config.split_input is None and size is not None:
            input_size = batch_size((args, kwargs), "the inputs")
            if size != input_size:
                raise ValueError(
                    f"the label's batch size ({size}) does not match the inputs' ({input_size})"
                )
        return split_tree(label, num)

    def _start_call(
        self, schedule, inputs, config, loss_fn, labels, return_outputs, forward_only=False
    ) -> Call:
        call = Call(
            schedule=schedule,
            num_microbatches=len(inputs),
            recompute_grain=config.recompute_grain,
            preserve_rng_state=config.preserve_rng_state,
            weights_version=self._use_version,
            chunk_bytes=config.weight_chunk_bytes,
            prefetch_stages=config.prefetch_stages,
            autocast=AutocastState.capture(self._device_type()),
            loss_fn=loss_fn,
            labels=labels,
            return_outputs=return_outputs,
            seq=self._seq,
            steps_before=self._steps,
            loss_scale=self._loss_scale() if loss_fn is not None else None,
            forward_only=forward_only,
        )
        self._seq += 1
        self._cursor = schedule.next_device
        for m, (args, kwargs) in enumerate(inputs):
            call.mailbox.post(("act", 0, m), Handoff(Slot((tuple(args), dict(kwargs))), None))
        if not forward_only:
            self._since_step.append(call)
        self._in_flight.append(call)
        for job in call.first_jobs:
            self._workers[job.device].submit(call, job)
        return call

    def _loss_scale(self) -> float | None:
        """The GradScaler's current scale, which this call's losses are multiplied by."""
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            return None
        # scale() creates the scaler's state on first use; its step() insists on it.
        self.grad_scaler.scale(torch.ones((), device=self.pool.devices[0].torch_device))
        return float(self.grad_scaler.get_scale())

    def _device_type(self) -> str:
        return self.pool.devices[0].torch_device.type

    @staticmethod
    def _read(call: Call, key: tuple) -> Any:
        handoff = call.mailbox.get(key)
        if handoff.event is not None:
            handoff.event.synchronize()
        return handoff.slot.value

    def _wait_idle(self) -> None:
        """Wait for every call and step in flight; raise the first error among them."""
        self._check_open()
        errors = self._drain()
        if errors:
            self._fail(errors[0])

    def _drain(self) -> list[BaseException]:
        """Wait for every call and step in flight; return their errors."""
        errors = [error for call in self._in_flight if (error := call.latch.wait()) is not None]
        self._in_flight = []
        for future in self._pending_steps:
            if (error := future.result()) is not None:
                errors.append(error)
        self._pending_steps = []
        return errors

    def _raise_failures(self) -> None:
        """Raise an error of earlier, already finished background work, if any."""
        failed = any(c.latch.done and c.latch.error is not None for c in self._in_flight) or any(
            f.done() and f.result() is not None for f in self._pending_steps
        )
        self._in_flight = [c for c in self._in_flight if not c.latch.done or c.latch.error]
        if failed:
            self._fail(None)

    def _fail(self, error: BaseException | None) -> NoReturn:
        """Recover from a failure, then raise it (chained to its original cause)."""
        first = self._recover(error)
        raise first from first.__cause__

    def _recover(self, error: BaseException | None) -> BaseException:
        """After a failure: let everything finish, reset, and return the error to raise."""
        errors = self._drain()
        first = errors[0] if errors else error
        self.pool.clear_errors()
        for worker in self._workers:
            worker.forget_events()
        discarded = self._since_step or any(e is not error for e in errors)
        self._since_step = []
        if discarded:
            self._store.discard_grads()
        if first is None:
            first = RoundPipeError("a pipelined call failed")
        note = (
            " (the gradients accumulated since the last step were discarded)" if discarded else ""
        )
        if note and hasattr(first, "add_note") and not getattr(first, "noted", False):
            first.add_note("roundpipe: the model is usable again" + note)
            first.noted = True  # type: ignore[attr-defined]
        return first


def _check_on_host(tree: Any, what: str) -> None:
    for tensor in tensor_leaves(tree):
        if tensor.device.type != "cpu":
            raise ValueError(
                f"{what} must be in host memory, but a tensor is on {tensor.device}; "
                "RoundPipe keeps inputs on the host and uploads them itself: pass CPU tensors"
            )


class _PipelineBackward(torch.autograd.Function):
    """Connects a pipelined forward's outputs to autograd; its backward runs the pipeline's."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, run_backward, tensors: tuple) -> tuple:
        ctx.run_backward = run_backward
        return tuple(t.detach().clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.run_backward(grads)
        return None, None, None


def _attach_backward(merged: Any, outputs: list[Any], run_backward) -> Any:
    """Return ``merged`` with its floating tensors wired to ``run_backward``.

    ``run_backward`` receives, per microbatch, the gradients aligned with that
    microbatch's output tensors (``None`` for non-floating ones).
    """
    leaves, spec = tree_flatten(merged)
    wired = [i for i, leaf in enumerate(leaves) if _differentiable(leaf)]
    shapes = [
        [leaf.shape for leaf in tree_flatten(out)[0] if isinstance(leaf, torch.Tensor)]
        for out in outputs
    ]

    def split_grads(grads: tuple) -> None:
        per_microbatch: list[list] = [[] for _ in outputs]
        by_leaf = dict(zip(wired, grads, strict=True))
        tensor_position = 0
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                continue
            microbatch_shapes = [shape[tensor_position] for shape in shapes]
            sizes = [shape[0] if len(shape) else 1 for shape in microbatch_shapes]
            pieces = torch.split(by_leaf[i], sizes) if i in by_leaf else [None] * len(outputs)
            for m, piece in enumerate(pieces):
                per_microbatch[m].append(
                    None if piece is None else piece.reshape(microbatch_shapes[m])
                )
            tensor_position += 1
        run_backward(per_microbatch)

    anchor = torch.zeros((), requires_grad=True)
    attached = _PipelineBackward.apply(anchor, split_grads, tuple(leaves[i] for i in wired))
    for i, tensor in zip(wired, attached, strict=True):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)


def _differentiable(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim() > 0
