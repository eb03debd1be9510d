"""Which operation of a model the current thread is in: the public method the caller's
thread entered (the outermost one), or ``"step"`` on the host optimizer thread.
Collectives across nodes carry it, so ranks out of step can say what each was doing
(docs/design.md#several-nodes)."""

from __future__ import annotations

import contextvars

OPERATION: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "roundpipe_operation", default=None
)
