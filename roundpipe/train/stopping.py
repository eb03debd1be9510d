"""The signals that stop a run after its current step: Ctrl-C (SIGINT), SIGTERM (what
schedulers send on pre-emption) and SIGHUP (the terminal closed). The run checkpoints
that step and exits with 128 + the signal's number (docs/design.md#stopping).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class StopRequest:
    """While :meth:`installed`: the first stop signal asks the loop to stop after the
    current step (``signum``); a second Ctrl-C raises ``KeyboardInterrupt``, abandoning
    the step, where ``abandon`` (one process). A repeated SIGTERM or SIGHUP only repeats
    the request: a scheduler's second SIGTERM must not cost the step."""

    def __init__(self, abandon: bool = True) -> None:
        self.signum = 0
        """The first stop signal received (0: none)."""
        self.abandon = abandon
        self.terminal: list[int] = []
        """stdout and stderr where they are a terminal (when installed)."""

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGHUP:
            self._leave_the_terminal()
        if self.signum and self.abandon and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    def _leave_the_terminal(self) -> None:
        """A hung-up terminal fails every write (EIO), which would end the run before
        its checkpoint: what the run prints goes nowhere instead."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in self.terminal:
            os.dup2(devnull, fd)
        os.close(devnull)

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        # An ignored signal stays ignored: SIGINT in a background job, SIGHUP under nohup.
        handled = [s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
        self.terminal = [fd for fd in (1, 2) if os.isatty(fd)]
        previous = {s: signal.signal(s, self._handle) for s in handled}
        try:
            yield self
        finally:
            # Asked to stop where a signal never abandons a step (several processes): the
            # process is on its way out, and a signal from now on could only kill it
            # half-way through its exit while the other ranks wait for it.
            keep_out = self.signum and not self.abandon
            for s, handler in previous.items():
                signal.signal(s, signal.SIG_IGN if keep_out else handler)
