"""What one pipelined call is: its schedule, microbatches, and who hands what to whom.

A :class:`Call` is frozen: what it runs, on which weights, with which loss, and the
caller's autocast settings; its mailbox of typed handoff keys, its latch and its job
claims are how its jobs and its caller meet (docs/design.md#handoffs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.config import RoundPipeRunConfig
from ..core.keys import Activation, HandoffKey, InputGrad
from ..core.program import CallShape, JobProgram, handoffs, readers, recompute_inputs
from ..core.schedule import Job, JobKind, Schedule
from ..devices.base import Slot
from .sync import Handoff, Latch, Mailbox, wait_event
from .versions import VersionState

_BACKWARD = -1
"""The claim of a deferred call's backward (job claims are schedule indices, >= 0)."""


@dataclass(frozen=True)
class AutocastState:
    """The caller's autocast settings, re-entered on the threads that run layers."""

    device_type: str
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def capture(cls, device_type: str) -> AutocastState:
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type)
        return cls(device_type, enabled, dtype)

    def scope(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


@dataclass(frozen=True)
class CallRequest:
    """One call as its caller asks for it: what runs (``schedule`` and ``config``), on
    which microbatches (``inputs``: ``(args, kwargs)`` each, ``labels``: one each or
    None), with which loss, and the caller's autocast and the call's seed."""

    schedule: Schedule
    config: RoundPipeRunConfig
    inputs: list[tuple[tuple, dict]]
    labels: list[Any] | None
    loss_fn: Callable[..., torch.Tensor] | None
    return_outputs: bool
    autocast: AutocastState
    rng_seed: int
    loss_weights: tuple[float, ...] | None = None
    """What each microbatch's ``loss_fn`` value is multiplied by (``scale_grads``)."""


@dataclass(frozen=True, eq=False)
class Call:
    """One ``forward_backward`` (or ``model(x)``) call: what it runs, on what, reading
    which weights. Frozen; where the call stands is the session ledger's business
    (:class:`~.ledger.CallState`). The mailbox, latch and claims are how its jobs and
    its caller meet (each safe across threads)."""

    schedule: Schedule
    config: RoundPipeRunConfig
    """How it runs: recompute grain and RNG, weight chunks and prefetch depth, sequence
    tiling (its microbatch count is ``num_microbatches``)."""
    num_microbatches: int
    weights_version: int
    weights_buffer: int
    """Which upload buffer holds ``weights_version`` (see :mod:`.versions`)."""
    autocast: AutocastState
    loss_fn: Callable[..., torch.Tensor] | None
    labels: list[Any] | None
    return_outputs: bool
    seq: int
    """Position of this call among its model's calls (orders buffer write-backs)."""
    steps_before: int
    """Optimizer steps queued before this call; its gradients wait until they ran."""
    rewrites_before: int
    """The session's count of rewrites of the user's tensors when the call started."""
    layer_changes_before: int
    """The session's count of changes to the user's modules when the call started."""
    forward_only: bool = False
    rng_seed: int = 0
    """The seed its layers' random numbers derive from (:mod:`.seeds`)."""
    loss_weights: tuple[float, ...] | None = None
    """What each microbatch's ``loss_fn`` value is multiplied by before its backward
    (``scale_grads``: its share of the rows); the call's loss is the sum of the
    products. None: by one."""
    mailbox: Mailbox = field(default_factory=Mailbox)
    latch: Latch = field(init=False)
    shape: CallShape = field(init=False)
    _claims: set[int] = field(init=False, repr=False)
    """Job indices (and ``_BACKWARD``) someone started (:meth:`claim`)."""
    _claim_lock: threading.Lock = field(init=False, repr=False)

    @classmethod
    def start(
        cls,
        request: CallRequest,
        versions: VersionState,
        *,
        seq: int,
        rewrites_before: int,
        layer_changes_before: int,
    ) -> Call:
        """The call ``request`` asks for, reading the weights ``versions`` says new calls
        read (``seq`` and the counts: the session's, :class:`~.ledger.Ledger`); its
        inputs are posted for the first jobs."""
        call = cls(
            schedule=request.schedule,
            config=request.config,
            num_microbatches=len(request.inputs),
            weights_version=versions.read,
            weights_buffer=versions.home_of(versions.read),
            autocast=request.autocast,
            loss_fn=request.loss_fn,
            labels=request.labels,
            return_outputs=request.return_outputs,
            seq=seq,
            steps_before=versions.newest,
            rewrites_before=rewrites_before,
            layer_changes_before=layer_changes_before,
            forward_only=request.loss_fn is None and not request.schedule.backward_jobs,
            rng_seed=request.rng_seed,
            loss_weights=request.loss_weights,
        )
        for m, (args, kwargs) in enumerate(request.inputs):
            call.mailbox.post(Activation(0, m), Handoff(Slot((tuple(args), dict(kwargs))), None))
        return call

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__
        setattr_(self, "latch", Latch(j.index for j in self.first_jobs))
        grain = self.config.recompute_grain
        inputs = recompute_inputs(self.schedule, grain, self.forward_only, self.deferred)
        shape = CallShape(
            self.num_microbatches,
            grain,
            inputs,
            self.config.preserve_rng_state,
            self.return_outputs,
        )
        setattr_(self, "shape", shape)
        for key, count in readers(self.schedule, shape).items():
            self.mailbox.expect(key, count)
        setattr_(self, "_claims", set())
        setattr_(self, "_claim_lock", threading.Lock())

    def read(self, key: HandoffKey) -> Any:
        """On the caller's thread: the value handed off under ``key``, once complete."""
        handoff = self.mailbox.get(key)
        if handoff.event is not None:
            wait_event(handoff.event)
        return handoff.slot.value

    @property
    def failed(self) -> bool:
        return self.latch.error is not None

    def claim(self, job: Job) -> bool:
        """Whether the caller is the one to run ``job`` (a job runs at most once)."""
        return self._claim(job.index)

    def claim_backward(self) -> bool:
        """Whether the caller is the one to run a deferred call's backward (at most once)."""
        return self._claim(_BACKWARD)

    @property
    def backward_claimed(self) -> bool:
        with self._claim_lock:
            return _BACKWARD in self._claims

    def _claim(self, what: int) -> bool:
        with self._claim_lock:
            if what in self._claims:
                return False
            self._claims.add(what)
            return True

    def cancel_unclaimed(self, fail_job: Callable[[Job], None], error: BaseException) -> None:
        """Fail every job nobody has started (``fail_job(job)``) and the caller's own
        handoffs, so nothing waits for work never issued."""
        for job in self.schedule.jobs:
            if self.claim(job):
                fail_job(job)
        for m in range(self.num_microbatches):
            self.mailbox.fail(Activation(0, m), error)
            self.mailbox.fail(InputGrad(self.schedule.plan.num_layers, m), error)

    @property
    def deferred(self) -> bool:
        """Backward jobs wait for a later ``.backward()`` (no fused stage, no loss)."""
        return not self.forward_only and not any(
            j.kind is JobKind.FUSED for j in self.schedule.jobs
        )

    @property
    def first_jobs(self) -> tuple[Job, ...]:
        """The jobs dispatched when the call starts."""
        return self.schedule.forward_jobs if self.deferred else self.schedule.jobs

    def handoffs(self, job: Job) -> JobProgram:
        """``job``'s program as far as what it reads and produces (no weight ops)."""
        return handoffs(job, self.shape)

    def fail_outputs(self, job: Job, error: BaseException) -> None:
        """Make every reader of what ``job`` produces raise ``error``."""
        for key in self.handoffs(job).produces:
            self.mailbox.fail(key, error)
