"""Ctrl-C only where the runtime can take it: deferred SIGINT on the driving thread.

While the main thread is inside a public method the SIGINT handler only notes a Ctrl-C;
the note becomes ``KeyboardInterrupt`` at interrupt points (host waits, which poll every
:data:`POLL_S`, and the method's exit), so an interrupt never tears the runtime's own
bookkeeping and a long wait still answers it (docs/design.md#threads-and-interrupts).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

POLL_S = 0.05
"""How often a deferring wait looks for a noted Ctrl-C."""


class _Deferral:
    """How deeply the main thread defers SIGINT, whether a Ctrl-C was noted meanwhile,
    and the handler to give it to."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        self.previous: Callable[[int, Any], Any] = signal.default_int_handler


_state = _Deferral()


def _note(signum: int, frame) -> None:
    _state.pending = True


def defer() -> bool:
    """Start deferring SIGINT (nestable); whether this call installed the handler."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if _state.depth:
        _state.depth += 1
        return True
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        return False
    _state.previous = previous
    _state.pending = False  # a note left by an interrupt that was already raised
    signal.signal(signal.SIGINT, _note)
    _state.depth = 1
    return True


def undefer() -> Callable[[], None] | None:
    """Stop deferring (if this was the outermost :func:`defer`); returns the handler to
    call for a Ctrl-C that arrived meanwhile, or None."""
    _state.depth -= 1
    if _state.depth > 0:
        return None
    previous = _state.previous
    # Restore first: signal.signal() runs a handler for a signal already pending, so a
    # Ctrl-C arriving now is noted before ``pending`` is read, never lost.
    signal.signal(signal.SIGINT, previous)
    pending, _state.pending = _state.pending, False
    if not pending:
        return None
    return lambda: previous(signal.SIGINT, None)


def deferring() -> bool:
    """Whether the calling thread defers SIGINT now (so its waits must poll)."""
    return _state.depth > 0 and threading.current_thread() is threading.main_thread()


def interrupt_point() -> None:
    """Deliver a Ctrl-C noted while deferring (the handler usually raises KeyboardInterrupt)."""
    if _state.pending and deferring():
        _state.pending = False
        _state.previous(signal.SIGINT, None)
