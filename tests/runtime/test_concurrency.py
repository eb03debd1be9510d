"""Concurrent use of RoundPipe models: several models, two threads, calls back in.

* models in one process train independently, interleaved too, and a failure in one
  leaves the other unaffected;
* two threads driving one model at once: one gets a RuntimeError naming threads, the
  other call is unaffected, no duplicate worker threads, training stays exact;
* a ``step_fn`` that calls back into the model (the optimizer thread) raises a
  RuntimeError naming ``step_fn``, never a hang; so does a layer calling back into the
  model from a background stage.

Every wait runs under a watchdog (``run_within``, or the ``no_hang`` fixture): a hang
fails the test, with every thread's stack in the message (and the test process then
exits without running roundpipe's exit hook, which would wait for the hung model). A
layer calling back is tested in a child process (a script given to ``python -c``).
Close, exit and dropped models: ``test_close_and_exit.py``.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support import faults
from support.children.harness import (
    Hang,
    assert_consistent,
    exit_at_once_after_a_hang,
    run_within,
    sgd_step,
)
from support.faults import train_call
from support.lifecycle import (
    LIMIT_S,
    NUM_MICROBATCH,
    architecture,
    new_model,
    roundpipe_threads,
)
from support.oracle import (
    assert_grads_close,
    assert_weights_close,
    batch,
    mlp,
    mse_sum,
    reference_loss_and_grads,
)
from torch import nn

from roundpipe import EmulatedOptions, RoundPipe, RoundPipeRunConfig

LR = 1e-3


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


def test_two_models_in_one_process_train_independently():
    x, y = batch()
    a_model, b_model = mlp(seed=1), mlp(seed=2)
    a_ref, b_ref = copy.deepcopy(a_model), copy.deepcopy(b_model)
    config = RoundPipeRunConfig(num_microbatch=3)
    with (
        RoundPipe(a_model, devices="emulated:2", model_run_config=config) as a,
        RoundPipe(b_model, devices="emulated:3", model_run_config=config) as b,
    ):
        a.forward_backward((x,), label=y, loss_fn=mse_sum)
        b.forward_backward((x * 2,), label=y, loss_fn=mse_sum)
        a.forward_backward((x,), label=y, loss_fn=mse_sum)
        a.synchronize()
        b.synchronize()
    for _ in range(2):
        reference_loss_and_grads(a_ref, x, y, 3)
    reference_loss_and_grads(b_ref, x * 2, y, 3)
    assert_grads_close(a_model, a_ref)
    assert_grads_close(b_model, b_ref)


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
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
