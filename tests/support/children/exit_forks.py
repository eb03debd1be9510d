"""Runs ``exit_in_flight.py`` once per MODE, each run in its own forked process.

Usage: ``exit_forks.py OUTDIR LIMIT_S MODE...``. This process imports what
``exit_in_flight.py`` imports (torch, roundpipe, the oracle, and torch._dynamo, which
the first optimizer imports) once, runs no torch
operation and starts no thread, then forks one child per MODE, at most ``PARALLEL`` at
a time. Each child points its stdout and stderr at ``OUTDIR/<i>.out`` and
``OUTDIR/<i>.err``, sets ``sys.argv`` to ``exit_in_flight.py MODE`` and executes that
script's code as the rest of this ``__main__`` module: the script's globals are this
module's, and when its code ends (falls off the end, raises, ``sys.exit``) so does the
module, and the child exits through the interpreter's normal shutdown (the threading
join and ``atexit`` hooks), exactly as the script run on its own would, only without
importing torch again (a few seconds per run).

The parent kills a child still running ``LIMIT_S`` seconds after its fork and writes
``OUTDIR/codes.json``: per run, its exit code (negative: the signal that ended it) and
whether it was killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))  # tests/support/children
TESTS = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(TESTS), TESTS, HERE]

import torch  # noqa: E402, F401 - imported once, before the forks
import torch._dynamo  # noqa: E402, F401 - what a first optimizer imports (1-2 s)

import roundpipe  # noqa: E402, F401
import support.oracle  # noqa: E402, F401

SCRIPT = os.path.join(HERE, "exit_in_flight.py")
PARALLEL = 4
OUT, LIMIT_S, MODES = sys.argv[1], float(sys.argv[2]), sys.argv[3:]


def child(index: int, mode: str) -> None:
    """In the forked child: this run's output files and command line."""
    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(os.path.join(OUT, f"{index}.{suffix}"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [SCRIPT, mode]


def reap(running: dict[int, tuple[int, float]], codes: dict[int, dict]) -> None:
    """Collect the children that ended; kill those past ``LIMIT_S``."""
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        index, _ = running.pop(pid)
        codes[index]["returncode"] = os.waitstatus_to_exitcode(status)
    now = time.monotonic()
    for pid, (index, started) in running.items():
        if now - started > LIMIT_S and not codes[index]["killed"]:
            codes[index]["killed"] = True
            os.kill(pid, signal.SIGKILL)


running: dict[int, tuple[int, float]] = {}
codes: dict[int, dict] = {}
forked_mode = None
sys.stdout.flush()
sys.stderr.flush()
for index, mode in enumerate(MODES):
    while len(running) >= PARALLEL:
        reap(running, codes)
        time.sleep(0.02)
    codes[index] = {"mode": mode, "returncode": None, "killed": False}
    pid = os.fork()
    if pid == 0:
        child(index, mode)
        forked_mode = mode
        break
    running[pid] = (index, time.monotonic())

if forked_mode is None:  # the parent
    while running:
        reap(running, codes)
        time.sleep(0.02)
    with open(os.path.join(OUT, "codes.json"), "w") as f:
        json.dump([codes[i] for i in range(len(MODES))], f)
    sys.exit(0)

# The forked child: the script's code, as the rest of this module.
__file__ = SCRIPT
with open(SCRIPT) as source:
    code = compile(source.read(), SCRIPT, "exec")
del source
exec(code)
