"""Ctrl-C anywhere in a public method never hangs the model and never breaks exactness.

Two attacks, each in child processes, so that Ctrl-C is taken on the main thread as in
a real program, and a model left hung cannot hang pytest:

* ``support/children/trace_injection.py METHOD``: a trace hook simulates a SIGINT
  arriving at each line event of the caller-side orchestration
  (``roundpipe/model/__init__.py`` and ``roundpipe/runtime/*``) while METHOD runs, once
  per run, on one model (each METHOD's child forked from one process that imported torch
  once: ``support/children/forks.py``). After each run: the method returned or raised
  KeyboardInterrupt within seconds, ``synchronize()`` returns without an error, and the
  model is consistent and exact (``support/children/harness.py: assert_consistent``).
  For ``close()``: called again after an interrupted one, it returns and stops every
  thread. Mode ``raise`` is stricter than any real Ctrl-C: KeyboardInterrupt is raised
  at every line of ``roundpipe/model/__init__.py`` and ``roundpipe/runtime/session.py``
  even where the runtime defers SIGINT, so the orchestration must hold up without that
  deferral too.
* ``support/children/sigint_training.py``: real SIGINT bursts into a training loop that
  catches KeyboardInterrupt and carries on; the child must end with an exact model.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from support.children.harness import CHILDREN, run_forked, start_child

METHODS = [
    "forward_backward",
    "step-async",
    "step-sync",
    "synchronize",
    "state_dict",
    "load_state_dict",
    "inference",  # pipe(x) under torch.no_grad()
]
INJECTION_CHILD = os.path.join(CHILDREN, "trace_injection.py")
INJECTION_LIMIT_S = 240.0  # a whole child; each step inside has its own 20 s watchdog

SIGINT_CHILD = os.path.join(CHILDREN, "sigint_training.py")
SIGINT_RUNS = 8
BURSTS = 8  # of 1-5 SIGINTs each, 0.5-20 ms apart (so they land in different places)
SIGINT_LIMIT_S = 60.0


@dataclass
class ChildRun:
    what: str
    returncode: int | None
    stdout: str
    stderr: str
    note: str = ""

    def ok(self) -> bool:
        return self.returncode == 0 and "\nOK " in "\n" + self.stdout

    def report(self) -> str:
        last_at = [line for line in self.stdout.splitlines() if line.startswith("AT ")][-1:]
        return (
            f"{self.what}: exit code {self.returncode} {self.note}\n"
            f"last injection: {last_at[0][3:] if last_at else '-'}\n"
            f"stdout (end):\n{self.stdout[-1500:]}\nstderr (end):\n{self.stderr[-8000:]}"
        )


# -- a simulated SIGINT at every line ----------------------------------------------------------


MODES = {
    "sigint": [],  # what a real SIGINT does at that line (the runtime may defer it)
    "raise": ["--raise"],  # KeyboardInterrupt raised at that line, deferral or not
}


@pytest.fixture(scope="module")
def injection_runs(request, tmp_path_factory) -> dict[tuple[str, str], ChildRun]:
    """One child per (method, mode) this session selected, two at a time, each forked from
    one process that imported torch and roundpipe once (``children/forks.py``)."""
    wanted = [
        (item.callspec.params["method"], item.callspec.params["mode"])
        for item in request.session.items
        if item.module is request.module
        and hasattr(item, "callspec")
        and "method" in item.callspec.params
    ]
    keys = list(dict.fromkeys(wanted))
    out = str(tmp_path_factory.mktemp("injections"))
    runs = [[method, *MODES[mode]] for method, mode in keys]
    done = run_forked(INJECTION_CHILD, runs, out, INJECTION_LIMIT_S, parallel=2)
    return {
        (method, mode): ChildRun(method, code, stdout, stderr, note)
        for (method, mode), (code, stdout, stderr, note) in zip(keys, done, strict=True)
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", METHODS)
def test_ctrl_c_at_every_line_never_hangs_and_keeps_the_model_exact(method, mode, injection_runs):
    run = injection_runs[method, mode]
    assert run.ok(), run.report()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["close"])
def test_ctrl_c_at_every_line_of_close_then_close_again_stops_every_thread(
    method, mode, injection_runs
):
    run = injection_runs[method, mode]
    assert run.ok(), run.report()


# -- real SIGINT bursts into a child process -----------------------------------------------


def wait_for_line(stream, expected: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return False
        line = stream.readline()
        if not line:
            return False
        if line.strip() == expected:
            return True
    return False


def sigint_bursts(seed: int) -> ChildRun:
    """Start the child, send it seeded bursts of SIGINTs, tell it to stop, collect its output."""
    rng = random.Random(seed)
    start = time.monotonic()
    proc = start_child([SIGINT_CHILD, str(seed)], stdin=subprocess.PIPE)
    note = ""
    try:
        if not wait_for_line(proc.stdout, "READY", SIGINT_LIMIT_S / 2):
            note = "(never printed READY)"
        else:
            sent = 0
            for _ in range(BURSTS):
                time.sleep(rng.uniform(0.05, 0.3))
                for _ in range(rng.randint(1, 5)):
                    if proc.poll() is not None:
                        break
                    os.kill(proc.pid, signal.SIGINT)
                    sent += 1
                    time.sleep(rng.uniform(0.0005, 0.02))
            note = f"({sent} SIGINTs sent)"
            try:
                proc.stdin.write("STOP\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
        remaining = max(1.0, SIGINT_LIMIT_S - (time.monotonic() - start))
        stdout, stderr = proc.communicate(timeout=remaining)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        note += f" (killed: no exit within {SIGINT_LIMIT_S:.0f} s)"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return ChildRun(f"SIGINT child seed={seed}", proc.returncode, stdout, stderr, note)


def test_sigint_bursts_into_a_training_loop_never_hang_and_leave_the_model_exact():
    with ThreadPoolExecutor(max_workers=4) as pool:
        runs = list(pool.map(sigint_bursts, range(SIGINT_RUNS)))
    failed = [run for run in runs if not run.ok()]
    assert not failed, f"{len(failed)} of {len(runs)} child runs failed:\n\n" + "\n\n".join(
        run.report() for run in failed
    )
    quiet = [run.what for run in runs if "interrupts=0 " in run.stdout]
    assert not quiet, f"{quiet} caught no KeyboardInterrupt: the test would be vacuous"
