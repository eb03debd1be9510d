"""A RoundPipe model's life: exit with work in flight, close, dropped models, several
models, two threads, re-entry.

* a script that ends, raises or calls ``sys.exit(n)`` with async work in flight exits
  with the code Python gives (0, 1, n): never an abort (134), never a hang;
* ``close()`` stops every thread the model started (after a failed call too), waits
  for a queued async step so the wrapped module ends with the newest weights, and
  reports a background failure nobody has seen yet;
* a model dropped without ``close()`` is collected, stops its threads and warns
  ``ResourceWarning``; worker threads never keep it alive;
* models in one process train independently, and a failure in one leaves the other
  unaffected;
* two threads driving one model at once: one gets a RuntimeError naming threads, the
  other call is unaffected, no duplicate worker threads, training stays exact;
* a ``step_fn`` that calls back into the model (the optimizer thread) raises a
  RuntimeError naming ``step_fn``, never a hang; so does a layer calling back into the
  model from a background stage.

Every wait runs under a watchdog (``run_within``, or the ``no_hang`` fixture): a hang
fails the test, with every thread's stack in the message (and the test process then
exits without running roundpipe's exit hook, which would wait for the hung model).
Exit behaviour and a layer calling back are tested in child processes
(``support/children/exit_in_flight.py``, and a script given to ``python -c``). Ctrl-C is
tested in ``test_interrupts.py``.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from support import faults
from support.children.harness import (
    CHILDREN,
    Hang,
    assert_consistent,
    exit_at_once_after_a_hang,
    finish_child,
    run_within,
    sgd_step,
    start_child,
)
from support.oracle import (
    assert_grads_close,
    assert_weights_close,
    batch,
    mlp,
    mse_sum,
    pytorch_sgd_step,
    reference_loss_and_grads,
)
from torch import nn

from roundpipe import EmulatedOptions, RoundPipe, RoundPipeRunConfig

LIMIT_S = 15.0
DEPTH = 4
NUM_MICROBATCH = 3
CONFIG = RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH)
LR = 1e-3


def architecture() -> nn.Module:
    return mlp(depth=DEPTH)


def new_model(**options: Any) -> RoundPipe:
    return RoundPipe(architecture(), devices="emulated:2", model_run_config=CONFIG, **options)


def train_call(pipe: RoundPipe) -> torch.Tensor:
    x, y = batch()
    return pipe.forward_backward((x,), label=y, loss_fn=mse_sum)


def roundpipe_threads(before: set[threading.Thread]) -> list[str]:
    """Names of the live threads started since ``before`` by roundpipe."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t not in before and t.is_alive() and t.name.startswith("roundpipe")
    )


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
EXIT_RUNS = 10
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


def run_exit_child(mode: str) -> Exit:
    proc = start_child([EXIT_CHILD, mode])
    stdout, stderr, killed = finish_child(proc, EXIT_LIMIT_S)
    if killed:
        stderr += f"\n{killed}"
    return Exit(mode, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def exits(request) -> dict[str, list[Exit]]:
    """``EXIT_RUNS`` child runs of each mode this session selected, 4 at a time, and the probe."""
    selected = {
        item.callspec.params["mode"]
        for item in request.session.items
        if item.module is request.module
        and hasattr(item, "callspec")
        and "mode" in item.callspec.params
    }
    modes = ["drain"] + [mode for mode in EXIT_CODES if mode in selected for _ in range(EXIT_RUNS)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        runs = list(pool.map(run_exit_child, modes))
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
    expected = net
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


# -- several models in one process -----------------------------------------------------------


def test_models_in_one_process_train_independently(wrap, no_hang):
    first, first_reference = wrap(
        mlp(seed=1, depth=6), devices="emulated:3", model_run_config=faults.CONFIG
    )
    second, second_reference = wrap(
        mlp(seed=2, depth=4),
        devices="emulated:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=3),
    )
    x, y = batch()
    first_loss = no_hang(first.forward_backward, (x,), label=y, loss_fn=mse_sum)
    second_loss = no_hang(second.forward_backward, (x,), label=y, loss_fn=mse_sum)
    no_hang(second.synchronize)
    no_hang(first.synchronize)
    for model, reference, loss, num in (
        (first, first_reference, first_loss, faults.NUM_MICROBATCH),
        (second, second_reference, second_loss, 3),
    ):
        torch.testing.assert_close(loss, reference_loss_and_grads(reference, x, y, num))
        assert_grads_close(model.model, reference)


def test_failure_in_one_model_leaves_another_unaffected(faulty, wrap, no_hang, error_of):
    healthy, reference = wrap(
        mlp(seed=1, depth=6),
        devices="emulated:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=3),
    )
    broken, _, switch = faulty(faults.IN_FUSED_STAGE)
    switch.arm("grad forward", at=1)
    x, y = batch()
    loss = no_hang(healthy.forward_backward, (x,), label=y, loss_fn=mse_sum)
    error_of(train_call, broken)  # fails while the healthy model's backward may still run
    no_hang(healthy.synchronize)
    torch.testing.assert_close(loss, reference_loss_and_grads(reference, x, y, 3))
    assert_grads_close(healthy.model, reference)


# -- two threads at once ---------------------------------------------------------------------

SLOW = EmulatedOptions(kernel_time=lambda info: 0.005)  # a call lasts long enough to overlap
ATTEMPTS = 20


def single_model_threads() -> list[str]:
    """Names of the threads one model starts for: train, synchronize, a sync step."""
    before = set(threading.enumerate())
    pipe = new_model(emulated_options=SLOW)
    optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=LR)
    run_within(LIMIT_S, train_call, pipe)
    run_within(LIMIT_S, pipe.synchronize)
    run_within(LIMIT_S, pipe.step, sgd_step(optimizer), is_async=False)
    names = roundpipe_threads(before)
    run_within(LIMIT_S, pipe.close)
    return names


def race_two_calls(pipe: RoundPipe) -> list[tuple[str, Any]]:
    """Two threads call ``forward_backward`` at the same moment; -> both outcomes."""
    barrier = threading.Barrier(2)
    outcomes: list[tuple[str, Any]] = [("hang", None), ("hang", None)]

    def drive(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = ("loss", train_call(pipe))
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            outcomes[i] = ("error", exc)

    threads = [threading.Thread(target=drive, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(LIMIT_S)
    if any(thread.is_alive() for thread in threads):
        exit_at_once_after_a_hang()
    return outcomes


def test_two_threads_calling_a_fresh_model_at_once_one_raises_and_training_stays_exact():
    expected_threads = single_model_threads()
    x, y = batch()
    want_loss = reference_loss_and_grads(architecture(), x, y, NUM_MICROBATCH)
    for attempt in range(ATTEMPTS):
        before = set(threading.enumerate())
        pipe = new_model(emulated_options=SLOW)
        reference = architecture()
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=LR)
        outcomes = race_two_calls(pipe)
        where = f"attempt {attempt}: outcomes {outcomes}"
        assert ("hang", None) not in outcomes, f"a call did not return in {LIMIT_S} s; {where}"
        errors = [value for kind, value in outcomes if kind == "error"]
        losses = [value for kind, value in outcomes if kind == "loss"]
        assert len(errors) == 1 and len(losses) == 1, (
            f"exactly one of two concurrent calls must raise; {where}"
        )
        assert isinstance(errors[0], RuntimeError), where
        assert "thread" in str(errors[0]), where
        torch.testing.assert_close(losses[0], want_loss, atol=1e-5, rtol=1e-6)

        run_within(LIMIT_S, pipe.synchronize)
        reference_loss_and_grads(reference, x, y, NUM_MICROBATCH)  # the one call that ran
        assert_grads_close(pipe.model, reference)
        run_within(LIMIT_S, pipe.step, sgd_step(optimizer), is_async=False)
        sgd_step(torch.optim.SGD(reference.parameters(), lr=LR))()
        assert roundpipe_threads(before) == expected_threads, where
        trains_like_pytorch(pipe, reference)
        run_within(LIMIT_S, pipe.close)
        assert roundpipe_threads(before) == [], f"threads left after close(); {where}"


def trains_like_pytorch(pipe: RoundPipe, reference: nn.Module) -> None:
    """One call + synchronize equals PyTorch from ``reference`` (no gradients yet)."""
    x, y = batch(seed=7)
    loss = run_within(LIMIT_S, pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
    run_within(LIMIT_S, pipe.synchronize)
    expected = copy.deepcopy(reference)
    want = reference_loss_and_grads(expected, x, y, NUM_MICROBATCH)
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-6)
    assert_weights_close(pipe.model, expected)
    assert_grads_close(pipe.model, expected)


# -- re-entry from a step_fn -----------------------------------------------------------------

REENTRY: dict[str, Callable[[RoundPipe], Any]] = {
    "synchronize": lambda pipe: pipe.synchronize(),
    "state_dict": lambda pipe: pipe.state_dict(),
    "forward_backward": train_call,
    "step": lambda pipe: pipe.step(lambda: None),
}


def reentrant_step(pipe: RoundPipe, optimizer: torch.optim.Optimizer, call: str):
    """A step_fn that updates the weights, then calls ``call`` on its own model."""

    def step_fn() -> None:
        sgd_step(optimizer)()
        REENTRY[call](pipe)

    return step_fn


def assert_names_step_fn(error: BaseException) -> None:
    if isinstance(error, Hang):
        raise error
    cause = error.__cause__
    assert isinstance(error, RuntimeError) or isinstance(cause, RuntimeError), repr(error)
    message = f"{error} {cause or ''}"
    assert "step_fn" in message, f"the error does not mention step_fn: {message!r}"


@pytest.fixture
def model() -> tuple[RoundPipe, torch.optim.Optimizer]:
    """A model trained once, with its SGD optimizer (the test closes it when it passes)."""
    pipe = new_model()
    optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=LR)
    run_within(LIMIT_S, train_call, pipe)
    return pipe, optimizer


@pytest.mark.parametrize("call", list(REENTRY))
def test_async_step_fn_calling_back_into_the_model_raises_at_next_synchronize(call, model):
    pipe, optimizer = model
    run_within(LIMIT_S, pipe.step, reentrant_step(pipe, optimizer, call), is_async=True)
    with pytest.raises(Exception) as caught:
        run_within(LIMIT_S, pipe.synchronize)
    assert_names_step_fn(caught.value)
    run_within(LIMIT_S, pipe.synchronize)
    assert_consistent(pipe, optimizer, architecture, NUM_MICROBATCH, limit_s=LIMIT_S)
    run_within(LIMIT_S, pipe.close)


@pytest.mark.parametrize("call", list(REENTRY))
def test_sync_step_fn_calling_back_into_the_model_raises_at_step(call, model):
    pipe, optimizer = model
    step_fn = reentrant_step(pipe, optimizer, call)
    with pytest.raises(Exception) as caught:
        run_within(LIMIT_S, pipe.step, step_fn, is_async=False)
    assert_names_step_fn(caught.value)
    run_within(LIMIT_S, pipe.synchronize)
    assert_consistent(pipe, optimizer, architecture, NUM_MICROBATCH, limit_s=LIMIT_S)
    run_within(LIMIT_S, pipe.close)


# -- re-entry from a layer in a background stage ---------------------------------------------


CALLS_BACK_CHILD = r"""
import os, sys, threading
import torch
from torch import nn
sys.path.insert(0, sys.argv[1])
from support.oracle import batch, mlp, mse_sum
from roundpipe import RoundPipe, RoundPipeRunConfig

armed, caller_returned, finished, outcome = (
    threading.Event(), threading.Event(), threading.Event(), []
)

def hook(module, args):
    # layer 0's recompute: a background backward stage, after forward_backward returned
    if not (torch.is_grad_enabled() and armed.is_set()) or outcome:
        return
    outcome.append("started")
    caller_returned.wait(5)
    try:
        pipe.synchronize()
        outcome.append("returned")
    except RuntimeError as exc:
        outcome.append("raised")
    finally:
        finished.set()

first = nn.Identity()
first.register_forward_pre_hook(hook)
config = RoundPipeRunConfig(num_microbatch=3, execute_plan="3,3|1,1,1,1,2,1")
pipe = RoundPipe(nn.Sequential(first, *mlp()), devices="emulated:2", model_run_config=config)
x, y = batch()
pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
pipe.synchronize()
armed.set()
pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
caller_returned.set()
print("LAYER", "finished" if finished.wait(5) else "HUNG", outcome, flush=True)
try:
    pipe.synchronize()
    print("SYNC returned", flush=True)
except RuntimeError as exc:
    print("SYNC raised", str(exc)[:120], flush=True)
os._exit(0)
"""


def test_a_layer_calling_back_into_the_model_from_a_background_stage_raises_not_hangs():
    # In a child process: the failure mode is a device thread blocked forever.
    tests = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.run(
        [sys.executable, "-c", CALLS_BACK_CHILD, tests],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert "LAYER finished ['started', 'raised']" in child.stdout, child.stdout + child.stderr
    # the model is not left claimed by the device thread: never "another thread is driving"
    assert "SYNC returned" in child.stdout, child.stdout
