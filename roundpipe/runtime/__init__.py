"""The runtime: executes lowered schedules on a device pool, keeps the training state.

Internal: users import from :mod:`roundpipe`; these modules are not a stable API.
``calls`` holds :class:`~.calls.Runtime`, the call owner a ``RoundPipe`` makes one
call of per public method (docs/design.md#following-a-call).

One call's threads (caller, prefetch, issue, completer, optimizer) and a device's
streams (weight and activation uploads, compute, download) are drawn in
docs/design.md#threads-and-streams-of-a-call.

The caller's side:

- ``session``: calls and steps in flight, the only writer of the ``ledger``; failure
  rules in ``failures``; Ctrl-C deferred by ``interrupts``; exit and GC in ``lifetime``.
- ``call``: one call (frozen); ``inputs`` and ``microbatch``: its inputs, split and
  copied, and its outputs merged; ``deferred``: ``model(x)`` wired to a later backward.

The device side:

- ``worker``: a device's prefetch, issue and completer threads; ``context``: the frozen
  job context they hand down; ``op_table``: which thread issues each op kind;
  ``prefetch``, ``issuer`` and ``stage_compute``: a job's weight uploads, device ops and
  layer code; ``transfer``: pytrees between host and
  device; ``layers``: meta-device shells bound to device tensors; ``sync``: handoffs,
  gates and latches between threads.

The host's state: ``params`` (weights, masters, gradients), ``versions`` (which weights
a call reads), ``optimizer`` (steps on a host thread; ``optimizer_guard``), and
``profiler`` (the measured costs the planner plans with).
"""
