"""The caller's record of a model's calls and steps: one immutable value, replaced whole.

The :class:`~.session.Session` is its only writer, through a :class:`LedgerCell`;
everything else reads a snapshot (docs/design.md#calls-and-sessions).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import NoReturn, TypedDict

from typing_extensions import Unpack

from .call import Call
from .versions import HOME, VersionState

ISSUING = "issuing"
"""Recorded in flight; its jobs are being handed to the workers."""
RUNNING = "running"
"""Every job was handed out; the caller waits for its result."""
RETURNED = "returned"
"""The caller got the call's result."""
INTERRUPTED = "interrupted"
"""An interrupt reached the caller after the call was issued: it counts as failed."""


@dataclass(frozen=True)
class CallState:
    """Where one call stands, as far as the failure rules care."""

    phase: str = ISSUING
    accumulated: bool = False
    """Some gradient of the call reached the masters (on several nodes: the local ones)."""
    discarded: bool = False
    """The call failed after accumulating, and the gradients were discarded."""
    owned_buffers: tuple = ()
    """Host copies of the caller's inputs and labels, given back when the call is forgotten."""

    @property
    def returned(self) -> bool:
        return self.phase == RETURNED


@dataclass(eq=False)
class StepTask:
    """One queued ``step``: publishes weights ``version`` into upload ``buffer``."""

    step_fn: Callable[[], object]
    calls: tuple[Call, ...]
    version: int
    buffer: int
    done: Future = field(default_factory=Future)
    """Resolves to the step's own error (``step_fn`` or publishing), or None."""
    submitted: bool = False
    _claimed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def claim(self) -> bool:
        """Whether the caller is the one to run this step (queued twice, it runs once)."""
        with self._lock:
            claimed, self._claimed = self._claimed, True
            return not claimed


class CallStateChange(TypedDict, total=False):
    """Fields of a :class:`CallState` to change (checked by name and type)."""

    phase: str
    accumulated: bool
    discarded: bool
    owned_buffers: tuple


@dataclass(frozen=True)
class Ledger:
    in_flight: tuple[Call, ...] = ()
    since_step: tuple[Call, ...] = ()
    """Calls whose gradients the next step applies (finished good ones are dropped)."""
    steps: tuple[StepTask, ...] = ()
    versions: VersionState = VersionState()
    next_seq: int = 0
    rewrites: int = 0
    """How often the user's tensors were rewritten with nothing in flight (adoption,
    ``make_current``): a deferred backward must recompute with what its forward read."""
    layer_changes: int = 0
    """How often the user's modules changed (new shells): likewise."""
    states: Mapping[Call, CallState] = field(default_factory=dict)
    """Per call in flight (never mutated: a change makes a new mapping)."""

    def state(self, call: Call) -> CallState:
        return self.states.get(call, _FORGOTTEN)

    def with_state(self, call: Call, **changes: Unpack[CallStateChange]) -> Ledger:
        states = dict(self.states)
        states[call] = replace(states.get(call, CallState()), **changes)
        return replace(self, states=states)

    def check_backward(self, call: Call, weights_written: bool, modules_changed: bool) -> None:
        """Refuse a deferred call's backward that PyTorch would refuse too: a second one
        through the same output, or one after the weights (a step, a rewrite of the
        user's tensors, ``weights_written`` by the user) or modules (``modules_changed``)
        its forward ran were changed."""
        if call.backward_claimed:
            raise_second_backward()
        rewritten = call.weights_buffer == HOME and self.rewrites != call.rewrites_before
        if self.versions.newest != call.steps_before or rewritten or weights_written:
            raise RuntimeError(
                "the weights changed (a step, load_state_dict, synchronize() or an in-place "
                "write) between model(x) and .backward() on its output; the backward stages "
                "would recompute with other weights than the forward used. Call .backward() "
                "first"
            )
        if self.layer_changes != call.layer_changes_before or modules_changed:
            raise RuntimeError(
                "the model's modules changed (an attribute, a hook or a submodule) between "
                "model(x) and .backward() on its output; the backward stages would recompute "
                "with other modules than the forward ran. Call .backward() first"
            )

    def pruned(self) -> Ledger:
        """Without the states of calls no longer in flight."""
        return replace(self, states={c: s for c, s in self.states.items() if c in self.in_flight})


_FORGOTTEN = CallState(phase=RETURNED)
"""The state of a call the ledger no longer holds: it returned and was settled."""


class LedgerCell:
    """Holds the ledger. A change is one assignment made under a lock: besides the
    driving thread, threads reporting on calls (through the session) change states.
    The lock lives here, outside the session's code, so no line of that code can be
    interrupted while holding it."""

    def __init__(self) -> None:
        self.value = Ledger()
        self._lock = threading.Lock()

    def change(self, change: Callable[[Ledger], Ledger]) -> None:
        with self._lock:
            self.value = change(self.value)


def raise_second_backward() -> NoReturn:
    raise RuntimeError(
        "backward through the output of this model(x) call ran already; the "
        "pipeline keeps no graph for a second one (retain_graph is not supported)"
    )


class LedgerChange(TypedDict, total=False):
    """Fields of a :class:`Ledger` to change (checked by name and type)."""

    in_flight: tuple[Call, ...]
    since_step: tuple[Call, ...]
    steps: tuple[StepTask, ...]
    versions: VersionState
    next_seq: int
    rewrites: int
    layer_changes: int
    states: Mapping[Call, CallState]
