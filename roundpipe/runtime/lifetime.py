"""The lifetime of a model's threads when nobody closes it.

An ``atexit`` hook, registered when the first session is built, drains and stops
every open session before the interpreter tears down (so daemon threads are never
caught inside torch code, which aborts the process); a ``weakref.finalize`` on each
``RoundPipe`` stops the threads of one that was garbage-collected unclosed. Either
way the session's own :meth:`~.session.Session.shutdown` does the work
(docs/design.md#threads-and-interrupts).
"""

from __future__ import annotations

import atexit
import sys
import threading
import warnings
import weakref
from typing import Protocol


class Session(Protocol):
    """What this module needs of a :class:`~.session.Session`."""

    closed: bool

    def shutdown(self) -> None:
        """Drain and stop, swallowing every error."""


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

    def stop_all() -> None:
        for session in sessions:
            session.shutdown()

    stopper = threading.Thread(target=stop_all, name="roundpipe-exit", daemon=True)
    try:
        stopper.start()
    except RuntimeError:  # Python 3.12+: no new threads at interpreter exit
        for session in sessions:
            session.shutdown()
        return
    stopper.join(EXIT_DRAIN_LIMIT_S)
    if stopper.is_alive():
        print(
            f"roundpipe: work in flight did not finish within {EXIT_DRAIN_LIMIT_S:.0f} s of "
            "exit; leaving it unfinished",
            file=sys.stderr,
        )


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
    stopper = threading.Thread(target=session.shutdown, name="roundpipe-finalizer")
    try:
        stopper.start()
    except RuntimeError:  # at interpreter exit, no new threads
        session.shutdown()
