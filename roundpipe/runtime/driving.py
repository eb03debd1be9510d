"""Who drives a session: the context every public method of a RoundPipe model enters
(:meth:`roundpipe.runtime.session.Session.enter`)."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Protocol

from . import interrupts
from .operation import OPERATION


class Driven(Protocol):
    """What driving needs of a :class:`~.session.Session`."""

    @property
    def next_seq(self) -> int:
        """The sequence number the next call issued gets."""

    def in_step_fn(self) -> bool: ...

    def interrupted_since(self, seq: int) -> None: ...


class Driving:
    """Entered by every public method (re-entrant on the driving thread).

    Ownership is claimed with one atomic ``dict.setdefault`` rather than a lock, so an
    interrupt between entering and leaving can never leave a lock held; a driving
    thread that died without leaving is replaced. Inside, Ctrl-C is deferred to the
    waits and to the exit (:mod:`.interrupts`); one that arrives after the method's
    work was done still raises, and the calls it issued then count as interrupted.
    """

    def __init__(self, session: Driven, driver: dict, what: str) -> None:
        """``driver``: the session's record of the thread inside a public method
        (``"thread"``) and how deeply (``"depth"``)."""
        self.session = session
        self.driver = driver
        self.what = what
        self.deferring = False
        self.first_seq = 0
        self.naming: contextvars.Token | None = None

    def __enter__(self) -> None:
        session = self.session
        if session.in_step_fn():
            raise RuntimeError(
                f"{self.what} was called from inside a step_fn (the optimizer thread), "
                "where it would wait for the step itself; call it after step() instead"
            )
        if threading.current_thread().name.startswith("roundpipe-"):
            raise RuntimeError(
                f"{self.what} was called from a roundpipe thread (inside a layer, loss_fn "
                "or hook that runs as part of a call), where it would wait for its own "
                "work; drive the model from your own thread"
            )
        self.deferring = interrupts.defer()  # first: no Ctrl-C between claim and release
        try:
            self._claim()
        except BaseException:
            self._undefer()
            raise
        self.first_seq = session.next_seq
        if OPERATION.get() is None:
            self.naming = OPERATION.set(self.what)

    def _claim(self) -> None:
        me, driver = threading.current_thread(), self.driver
        owner = driver.setdefault("thread", me)
        if owner is not me and not owner.is_alive():
            driver["thread"] = owner = me
        if owner is not me:
            raise RuntimeError(
                f"{self.what} was called from a second thread while another thread is "
                "driving this RoundPipe model; drive a model from one thread at a time"
            )
        driver["depth"] = driver.get("depth", 0) + 1

    def _undefer(self) -> Callable[[], None] | None:
        return interrupts.undefer() if self.deferring else None

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self.naming is not None:
            OPERATION.reset(self.naming)
        driver = self.driver
        driver["depth"] -= 1
        if driver["depth"] <= 0:
            driver.pop("thread", None)
        deliver = self._undefer()
        if deliver is not None and exc_type is None:
            self.session.interrupted_since(self.first_seq)
            deliver()
