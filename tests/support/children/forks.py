"""Runs a child script several times, each run in its own process forked from this one.

Usage: ``forks.py SPEC``, SPEC a JSON object: ``script`` (a path), ``out`` (a folder),
``limit_s``, ``parallel`` and ``runs`` (one list of command-line arguments per run).
This process imports what the child scripts import (torch, roundpipe, the oracle, and
torch._dynamo, which the first optimizer imports) once, runs no torch operation and
starts no thread, then forks one child per run, at most ``parallel`` at a time. Each
child points its stdout and stderr at ``out/<i>.out`` and ``out/<i>.err``, sets
``sys.argv`` to ``script *args`` and executes the script's code as the rest of this
``__main__`` module: the script's globals are this module's, and when its code ends
(falls off the end, raises, ``sys.exit``, ``os._exit``) so does the process, through
the interpreter's normal shutdown (the threading join and ``atexit`` hooks) where the
script ends normally: exactly as the script run on its own would, only without
importing torch again (several seconds per run).

The parent kills a child still running ``limit_s`` seconds after its fork and writes
``out/codes.json``: per run, its exit code (negative: the signal that ended it) and
whether it was killed. :func:`harness.run_forked` starts this and reads the results.
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

SPEC = json.loads(sys.argv[1])
SCRIPT, OUT, LIMIT_S = SPEC["script"], SPEC["out"], float(SPEC["limit_s"])


def child(index: int, args: list[str]) -> None:
    """In the forked child: this run's output files and command line."""
    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(os.path.join(OUT, f"{index}.{suffix}"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [SCRIPT, *args]


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
forked = False
sys.stdout.flush()
sys.stderr.flush()
for index, args in enumerate(SPEC["runs"]):
    while len(running) >= SPEC["parallel"]:
        reap(running, codes)
        time.sleep(0.02)
    codes[index] = {"returncode": None, "killed": False}
    pid = os.fork()
    if pid == 0:
        child(index, args)
        forked = True
        break
    running[pid] = (index, time.monotonic())

if not forked:  # the parent
    while running:
        reap(running, codes)
        time.sleep(0.02)
    with open(os.path.join(OUT, "codes.json"), "w") as f:
        json.dump([codes[i] for i in range(len(SPEC["runs"]))], f)
    sys.exit(0)

# The forked child: the script's code, as the rest of this module.
__file__ = SCRIPT
with open(SCRIPT) as source:
    code = compile(source.read(), SCRIPT, "exec")
del source
exec(code)
