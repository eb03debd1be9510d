"""Steps in backward: a master's post-accumulate-grad hooks run once its gradient is in.

PyTorch's way of stepping each parameter during the backward (no full set of gradients
ever held) is a per-parameter optimizer run by ``register_post_accumulate_grad_hook``.
Registered on the masters (``pipe.optim_parameters()``), those hooks run here: on a
completer thread, once every stage of a call using the master has added its gradient,
once per call, as PyTorch runs them once per backward (docs/design.md#steps-in-backward).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from ..core.schedule import Job, JobKind
from .call import Call
from .layers import LayerBinding
from .params import ParameterStore


def post_accumulate_hooks(master: nn.Parameter) -> tuple[Callable[[nn.Parameter], None], ...]:
    """The hooks ``master.register_post_accumulate_grad_hook`` registered (none: ())."""
    hooks = getattr(master, "_post_accumulate_grad_hooks", None)
    return tuple(hooks.values()) if hooks else ()


_WHAT = "with post-accumulate-grad hooks on the masters (steps in backward)"


@dataclass
class _Arrivals:
    """Per master of one call: the stages still to add a gradient, and whether any did."""

    remaining: dict[int, int]
    present: set[int]
    stepped: int = 0
    running: int = 0
    """Hooks found due and not yet returned (one that raised stays counted)."""


class BackwardSteps:
    """Counts each call's gradient contributions per master and runs the hooks."""

    def __init__(self, store: ParameterStore, layers: list[LayerBinding]) -> None:
        self._store = store
        self._layers = layers
        self._calls: dict[Call, _Arrivals] = {}
        self._lock = threading.Lock()
        self._hooks_running = threading.Lock()
        """One hook at a time: two optimizer steps at once on two completer threads
        crashed the interpreter (a segfault in torch.optim.Adam's step, CPU)."""

    def active(self) -> bool:
        """Whether some master has a post-accumulate-grad hook (then steps run in the
        backward, and every training call is followed by a synchronous publish)."""
        return any(post_accumulate_hooks(master) for _, master in self._store.masters())

    def check(self, several_nodes: bool, grad_scaler) -> bool:
        """Whether a training call steps in its backward (:meth:`active`); refuses what
        cannot: several nodes or a GradScaler (the gradients are reduced across nodes,
        and checked for infs, at a step). Two ``model(x)`` outputs before a backward need
        nothing here: the first backward steps, and the other's is refused as after any
        step (``Ledger.check_backward``)."""
        if not self.active():
            return False
        if several_nodes or (grad_scaler is not None and grad_scaler.is_enabled()):
            raise RuntimeError(
                f"{_WHAT}, several nodes and a GradScaler are not supported: the gradients "
                "are reduced across nodes, and checked for infs, at a step"
            )
        return True

    def refuse_async(self) -> None:
        """Steps in backward write the weights in place: later steps are synchronous."""
        if self.active():
            raise ValueError(
                f"{_WHAT} the weights are updated in place during the backward, so steps "
                "are synchronous: pipe.step(step_fn, is_async=False)"
            )

    def begin(self, call: Call) -> None:
        """Before ``call``'s backward jobs are dispatched: expect one gradient per master
        from every backward stage whose layers use it."""
        remaining: dict[int, int] = {}
        for job in call.schedule.jobs:
            for uid in self._uids(job):
                remaining[uid] = remaining.get(uid, 0) + 1
        if remaining:
            with self._lock:
                self._calls[call] = _Arrivals(remaining, set())

    def arrived(self, call: Call, job: Job, present: Iterable[int]) -> None:
        """On a completer thread: ``job``'s gradients (of the masters ``present``) were
        added; run the hooks of the masters whose last stage this was. The call's count
        is dropped once its last hook ran; a hook that raises leaves it for
        :meth:`forget`, which tells how many stepped."""
        with self._lock:
            arrivals = self._calls.get(call)
            if arrivals is None:
                return
            arrivals.present.update(present)
            complete = []
            for uid in self._uids(job):
                arrivals.remaining[uid] -= 1
                if arrivals.remaining[uid] == 0:
                    del arrivals.remaining[uid]
                    if uid in arrivals.present:
                        complete.append(uid)
            arrivals.running += len(complete)
        for uid in complete:  # outside the count's lock: a hook runs an optimizer step
            master = self._store.entries[uid].master
            assert master is not None, "a post-accumulate hook of a master that is not here"
            with self._hooks_running:
                for hook in post_accumulate_hooks(master):
                    hook(master)
            with self._lock:
                arrivals.stepped += 1
                arrivals.running -= 1
        with self._lock:
            if not arrivals.remaining and not arrivals.running:
                self._calls.pop(call, None)

    def forget(self, call: Call) -> int:
        """``call`` failed (its other jobs have finished): drop its count; returns how
        many masters stepped in its backward before it failed."""
        with self._lock:
            arrivals = self._calls.pop(call, None)
        return 0 if arrivals is None else arrivals.stepped

    def _uids(self, job: Job) -> list[int]:
        """The trainable masters ``job`` downloads a gradient for (one per job)."""
        if job.kind not in (JobKind.BACKWARD, JobKind.FUSED):
            return []
        uids = dict.fromkeys(uid for index in job.layers for uid in self._layers[index].param_uids)
        entries = self._store.entries
        return [uid for uid in uids if entries[uid].trainable and entries[uid].master is not None]
