"""The lifetime of a model's threads when nobody closes it (DESIGN.md §8).

An ``atexit`` hook, registered when the first session is built, drains and stops
every open session before the interpreter tears down (so daemon threads are never
caught inside torch code, which aborts the process); a ``weakref.finalize`` on each
``RoundPipe`` stops the threads of one that was garbage-collected unclosed.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import warnings
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .session import Session

_sessions: weakref.WeakSet[Session] | None = None


def live_sessions() -> weakref.WeakSet[Session]:
    """Open sessions, drained and stopped at interpreter exit (registered on first use)."""
    global _sessions
    if _sessions is None:
        _sessions = weakref.WeakSet()
        atexit.register(_stop_all_at_exit)
    return _sessions


EXIT_DRAIN_LIMIT_S = 120.0
"""At interpreter exit, how long to wait for open models' work before giving up."""


def _stop_all_at_exit() -> None:
    sessions = list(_sessions or ())
    if not sessions:
        return
    stopper = threading.Thread(
        target=lambda: [shutdown(s) for s in sessions], name="roundpipe-exit", daemon=True
    )
    try:
        stopper.start()
    except RuntimeError:  # Python 3.12+: no new threads at interpreter exit
        for session in sessions:
            shutdown(session)
        return
    stopper.join(EXIT_DRAIN_LIMIT_S)
    if stopper.is_alive():
        print(
            f"roundpipe: work in flight did not finish within {EXIT_DRAIN_LIMIT_S:.0f} s of "
            "exit; leaving it unfinished",
            file=sys.stderr,
        )


def shutdown(session: Session) -> None:
    """Drain and stop a session nobody closed, swallowing its errors (exit or GC)."""
    if session.closed:
        return
    with contextlib.suppress(BaseException):  # nobody is left to report to
        session.recover(None)
        session.make_current()
    session.stop_threads()


def finalize_unclosed(session: Session) -> None:
    """Called when a model is garbage-collected: stop its threads, with a warning."""
    if session.closed:
        return
    warnings.warn(
        "a RoundPipe model was garbage-collected without close(); its threads were "
        "stopped now (use `with RoundPipe(...) as model:` or call model.close())",
        ResourceWarning,
        stacklevel=2,
    )
    # Draining may take a while: never on whichever thread the garbage collector ran.
    stopper = threading.Thread(target=shutdown, args=(session,), name="roundpipe-finalizer")
    try:
        stopper.start()
    except RuntimeError:  # at interpreter exit, no new threads
        shutdown(session)
