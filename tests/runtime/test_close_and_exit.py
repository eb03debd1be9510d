"""The end of a RoundPipe model: exit with work in flight, close(), dropped models.

* a script that ends, raises or calls ``sys.exit(n)`` with async work in flight exits
  with the code Python gives (0, 1, n): never an abort (134), never a hang;
* ``close()`` stops every thread the model started (after a failed call too), waits
  for a queued async step so the wrapped module ends with the newest weights, and
  reports a background failure nobody has seen yet;
* a model dropped without ``close()`` is collected, stops its threads and warns
  ``ResourceWarning``; worker threads never keep it alive;
* importing roundpipe and building a model start no thread.

Every wait runs under a watchdog (``run_within``, or the ``no_hang`` fixture): a hang
fails the test, with every thread's stack in the message (and the test process then
exits without running roundpipe's exit hook, which would wait for the hung model).
Exit behaviour is tested in child processes (``support/children/exit_in_flight.py``, each
run forked from one process that imported torch once: ``forks.py``).
Several models and threads driving one model: ``test_concurrency.py``; Ctrl-C:
``test_interrupts.py``.
"""

from __future__ import annotations

import copy
import gc
import os
import re
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from support import faults
from support.children.harness import CHILDREN, run_forked, run_within, sgd_step
from support.faults import train_call
from support.lifecycle import CONFIG, LIMIT_S, NUM_MICROBATCH, new_model, roundpipe_threads
from support.oracle import assert_weights_close, batch, mlp, mse_sum, pytorch_sgd_step

from roundpipe import RoundPipe


def wait_until(condition: Callable[[], bool], seconds: float) -> bool:
    """Poll ``condition`` (collecting garbage in between) for up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


# -- exit with work in flight ----------------------------------------------------------------

EXIT_CHILD = os.path.join(CHILDREN, "exit_in_flight.py")
EXIT_CODES = {"end": 0, "raise": 1, "exit3": 3}
EXIT_RUNS = 6
EXIT_LIMIT_S = 45.0


@dataclass
class Exit:
    mode: str
    returncode: int | None
    stdout: str
    stderr: str

    def report(self) -> str:
        return (
            f"mode={self.mode}: exit code {self.returncode}\n"
            f"stdout:\n{self.stdout[-1000:]}\nstderr:\n{self.stderr[-6000:]}"
        )

    def steps_done(self, when: str = "QUEUED") -> int | None:
        """Async steps run by the time the child printed ``when`` (QUEUED: as it began to exit)."""
        found = re.search(rf"{when} steps_done=(\d+)", self.stdout)
        return int(found.group(1)) if found else None


def run_exit_children(modes: list[str], out: str) -> list[Exit]:
    """One run of ``EXIT_CHILD`` per mode, each in its own process forked (4 at a time)
    from one that imported torch and roundpipe once (``children/forks.py``)."""
    runs = run_forked(EXIT_CHILD, [[mode] for mode in modes], out, EXIT_LIMIT_S, parallel=4)
    return [
        Exit(mode, code, stdout, stderr + (f"\n{note}" if note else ""))
        for mode, (code, stdout, stderr, note) in zip(modes, runs, strict=True)
    ]


@pytest.fixture(scope="module")
def exits(request, tmp_path_factory) -> dict[str, list[Exit]]:
    """``EXIT_RUNS`` child runs of each mode this session selected, 4 at a time, and the probe."""
    selected = {
        item.callspec.params["mode"]
        for item in request.session.items
        if item.module is request.module
        and hasattr(item, "callspec")
        and "mode" in item.callspec.params
    }
    modes = ["drain"] + [mode for mode in EXIT_CODES if mode in selected for _ in range(EXIT_RUNS)]
    runs = run_exit_children(modes, str(tmp_path_factory.mktemp("exits")))
    by_mode: dict[str, list[Exit]] = {}
    for run in runs:
        by_mode.setdefault(run.mode, []).append(run)
    return by_mode


@pytest.mark.parametrize("mode", list(EXIT_CODES))
def test_script_exiting_with_async_work_in_flight_exits_with_pythons_code(mode, exits):
    probe = exits["drain"][0]
    assert probe.returncode == 0 and "DRAINED" in probe.stdout, probe.report()
    total = probe.steps_done(when="DRAINED")
    expected = EXIT_CODES[mode]
    bad = [
        run
        for run in exits[mode]
        if run.returncode != expected
        or "terminate called" in run.stderr
        or "Timeout (" in run.stderr  # the child's faulthandler stall dump
        or "QUEUED" not in run.stdout
    ]
    assert not bad, (
        f"{len(bad)} of {len(exits[mode])} runs did not exit with code {expected}:\n\n"
        + "\n\n".join(run.report() for run in bad)
    )
    if mode == "raise":
        assert all("uncaught on purpose" in run.stderr for run in exits[mode])
    in_flight = [run for run in exits[mode] if (run.steps_done() or 0) < (total or 0)]
    assert len(in_flight) * 2 >= len(exits[mode]), (
        f"most runs had run all {total} steps before exiting: the test would be vacuous"
    )


# -- close() ---------------------------------------------------------------------------------


def new_threads(before: set[threading.Thread]) -> list[str]:
    return [t.name for t in threading.enumerate() if t not in before and t.is_alive()]


def test_close_stops_every_thread_the_model_started(no_hang):
    before = set(threading.enumerate())
    model = RoundPipe(mlp(depth=6), devices="emulated:3", model_run_config=faults.CONFIG)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    no_hang(train_call, model)
    model.step(sgd_step(optimizer))
    assert new_threads(before), "training started no thread; the check below would be vacuous"
    no_hang(model.close)
    assert new_threads(before) == []


def test_close_after_a_failed_call_stops_every_thread(no_hang, error_of):
    before = set(threading.enumerate())
    module, switch = faults.faulty_sequential(faults.IN_FUSED_STAGE)
    model = RoundPipe(module, devices="emulated:3", model_run_config=faults.CONFIG)
    switch.arm("grad forward", at=1)
    error_of(train_call, model)
    no_hang(model.close)
    assert new_threads(before) == []


def test_close_reports_a_background_failure_nobody_has_seen_yet(faulty):
    model, _, switch = faulty(faults.IN_FORWARD_AND_BACKWARD_STAGE)
    switch.arm("backward", at=0)
    model.forward_backward((batch()[0],), label=batch()[1], loss_fn=mse_sum)
    with pytest.raises(ValueError, match="injected fault"):
        model.close()


CLOSE_LR = 0.1


@pytest.mark.parametrize("steps", [0, 2])  # then one async step: 1 and 3 steps in all
def test_close_leaves_the_wrapped_model_with_the_newest_weights(steps, no_hang):
    net = mlp()
    expected = copy.deepcopy(net)  # the user's tensors are the pipe's to write until close()
    pipe = RoundPipe(net, devices="emulated:2", model_run_config=CONFIG)
    optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=CLOSE_LR)
    for seed in range(steps):
        x, y = batch(seed=seed)
        no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
        no_hang(pipe.step, sgd_step(optimizer), is_async=False)  # sync: versions are exact
        expected = pytorch_sgd_step(expected, x, y, NUM_MICROBATCH, CLOSE_LR)
    # one more async step, then close() without synchronize(): close waits for it
    x, y = batch(seed=steps)
    no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
    no_hang(pipe.step, sgd_step(optimizer), is_async=True)
    expected = pytorch_sgd_step(expected, x, y, NUM_MICROBATCH, CLOSE_LR)
    no_hang(pipe.close)
    assert_weights_close(net, expected)  # the user's module after `with RoundPipe(...)`


# -- models dropped without close() ----------------------------------------------------------

DROPPED = 20


def drop_used_models(count: int, synchronize: bool = False) -> list[weakref.ref]:
    """Build ``count`` models, train each once, drop them unclosed; -> weak references."""
    refs = []
    for _ in range(count):
        before = set(threading.enumerate())
        pipe = new_model()
        run_within(LIMIT_S, train_call, pipe)
        if synchronize:
            run_within(LIMIT_S, pipe.synchronize)
        assert roundpipe_threads(before), "training started no thread: the test is vacuous"
        refs.append(weakref.ref(pipe))
        del pipe
    return refs


def test_dropped_unclosed_models_stop_their_threads():
    before = set(threading.enumerate())
    count = threading.active_count()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        drop_used_models(DROPPED)
        stopped = wait_until(lambda: not roundpipe_threads(before), seconds=10)
    left = roundpipe_threads(before)
    assert stopped, (
        f"{len(left)} roundpipe threads of {DROPPED} dropped models still run "
        f"(active_count {threading.active_count()}, {count} before): {left[:8]} ..."
    )
    assert threading.active_count() <= count


def test_dropped_unclosed_model_warns_resource_warning():
    before = set(threading.enumerate())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refs = drop_used_models(DROPPED)
        wait_until(
            lambda: all(ref() is None for ref in refs) and not roundpipe_threads(before),
            seconds=10,
        )
    ours = [
        w
        for w in caught
        if issubclass(w.category, ResourceWarning)
        and re.search(r"roundpipe|close", str(w.message), re.IGNORECASE)
    ]
    assert len(ours) >= DROPPED, (
        f"{len(ours)} ResourceWarnings for {DROPPED} models dropped without close(); "
        f"warnings seen: {[f'{w.category.__name__}: {w.message}' for w in caught][:5]}"
    )


def test_worker_threads_do_not_keep_a_dropped_model_alive():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        (ref,) = drop_used_models(1, synchronize=True)
        gc.collect()
        alive = ref() is not None
    if alive:
        holders = [type(r).__name__ for r in gc.get_referrers(ref())]
        pytest.fail(f"a dropped, idle model survived gc.collect(); referred to by {holders}")


# -- threads start only when a model is used -------------------------------------------------


def test_import_starts_no_threads():
    code = (
        "import threading, roundpipe, torch; "
        "from torch import nn; "
        "n = threading.active_count(); "
        "roundpipe.RoundPipe(nn.Sequential(nn.Linear(2, 2)), devices='emulated:2'); "
        "print(n, threading.active_count())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = out.stdout.split()
    assert before == after == "1"
