"""Helpers shared by the interrupt/lifecycle tests and the child scripts they start.

Importable two ways: as ``support.children.harness`` from a test module (``tests/`` is
on ``sys.path`` under pytest) and as ``harness`` from a child script in this folder.
Nothing here uses pytest, so a child process can run the same checks.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

CHILDREN = os.path.dirname(os.path.abspath(__file__))  # tests/support/children
TESTS = os.path.dirname(os.path.dirname(CHILDREN))
REPO = os.path.dirname(TESTS)


class Hang(AssertionError):
    """A call did not return in time; the message holds every thread's stack."""


_exit_guard_registered = False


def _exit_without_draining() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def exit_at_once_after_a_hang() -> None:
    """After a hang, make this process skip the exit hooks registered before now.

    roundpipe drains every open model in an ``atexit`` hook; a model left hung by a
    failed test would hang the test process's exit there. This hook, registered
    later, runs first (atexit is last-in, first-out) and ends the process with status
    1, which is what pytest returns anyway once a test has failed.
    """
    global _exit_guard_registered
    if not _exit_guard_registered:
        _exit_guard_registered = True
        atexit.register(_exit_without_draining)


def thread_stacks() -> str:
    """The current stack of every thread (identical stacks once, with their thread names)."""
    frames = sys._current_frames()
    names_by_stack: dict[str, list[str]] = {}
    for thread in threading.enumerate():
        frame = frames.get(thread.ident) if thread.ident is not None else None
        if frame is None:
            continue
        entries = [
            e
            for e in traceback.extract_stack(frame)
            if not (e.filename == threading.__file__ and e.name.startswith(("_bootstrap", "run")))
        ]
        stack = "".join(traceback.format_list(entries[-10:]))
        names_by_stack.setdefault(stack, []).append(thread.name)
    return "\n".join(
        f"--- {len(names)} thread(s): {', '.join(names)}\n{stack}"
        for stack, names in names_by_stack.items()
    )


def run_within(seconds: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` on a helper thread; return its result or re-raise its exception here.

    Raises :class:`Hang` (an AssertionError) if it has not returned within ``seconds``;
    the helper thread is a daemon and is left behind.
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the waiting thread
            outcome["error"] = exc

    name = getattr(fn, "__qualname__", repr(fn))
    thread = threading.Thread(target=target, name=f"test-watchdog-{name}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        exit_at_once_after_a_hang()
        raise Hang(f"{name} did not return within {seconds:g} s (a hang)\n{thread_stacks()}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def sgd_step(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    def step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    return step


def assert_consistent(
    pipe: Any,
    optimizer: torch.optim.Optimizer,
    architecture: Callable[[], nn.Module],
    num_microbatch: int,
    limit_s: float | None = 20.0,
) -> None:
    """The check after a ``synchronize()`` that an interrupt or a failure must pass: the
    model is consistent and exact.

    * the masters (``optim_parameters()``) equal the model's parameters exactly;
    * one more ``forward_backward`` + synchronous SGD ``step`` gives the loss and the
      weights plain PyTorch gives when started from the weights W and gradients G the
      model shows now (load W, set ``.grad = G``, sum the microbatch losses, backward,
      SGD step with the optimizer's learning rate).

    ``optimizer`` must be a plain SGD over ``pipe.optim_parameters()``. The model's
    calls run under :func:`run_within` (``limit_s``), or directly if it is None.
    """
    from support.oracle import batch, mse_sum, reference_loss_and_grads

    params = list(pipe.model.parameters())
    weights = [p.detach().clone() for p in params]
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    assert all(torch.isfinite(w).all() for w in weights), "the model's weights are not finite"
    masters = list(pipe.optim_parameters())
    assert len(masters) == len(params), (len(masters), len(params))
    for i, (master, weight) in enumerate(zip(masters, weights, strict=True)):
        assert torch.equal(master.detach(), weight), (
            f"master {i} differs from the model's parameter after synchronize() "
            f"(max |diff| {(master.detach() - weight).abs().max().item():.3g})"
        )

    reference = architecture()
    with torch.no_grad():
        for p, w, g in zip(reference.parameters(), weights, grads, strict=True):
            p.copy_(w)
            p.grad = None if g is None else g.clone()
    x, y = batch(seed=7)
    want_loss = reference_loss_and_grads(reference, x, y, num_microbatch)
    lr = optimizer.param_groups[0]["lr"]
    torch.optim.SGD(reference.parameters(), lr=lr).step()

    def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) if limit_s is None else run_within(limit_s, fn, *args, **kwargs)

    loss = call(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
    call(pipe.step, sgd_step(optimizer), is_async=False)
    call(pipe.synchronize)
    torch.testing.assert_close(
        loss,
        want_loss,
        atol=1e-5,
        rtol=1e-6,
        msg=lambda m: f"the loss of the next call is not PyTorch's from the weights shown: {m}",
    )
    pairs = zip(pipe.model.named_parameters(), reference.named_parameters(), strict=True)
    for (name, got), (_, want) in pairs:
        torch.testing.assert_close(
            got.detach(),
            want.detach(),
            atol=1e-5,
            rtol=1e-5,
            msg=lambda m, name=name: f"{name} after one more call + SGD step: {m}",
        )


def child_env() -> dict[str, str]:
    """The environment for a child script: the repository and ``tests/`` importable."""
    env = dict(os.environ)
    paths = [REPO, TESTS, CHILDREN]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def start_child(args: list[str], stdin: int = subprocess.DEVNULL) -> subprocess.Popen:
    """Start ``python ARGS`` as a child script (see :func:`child_env`), text pipes."""
    return subprocess.Popen(
        [sys.executable, *args],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=TESTS,
    )


def finish_child(proc: subprocess.Popen, limit_s: float) -> tuple[str, str, str]:
    """Wait up to ``limit_s`` for ``proc``, killing it after; -> stdout, stderr, and a
    note saying it was killed (empty if it exited on its own)."""
    try:
        stdout, stderr = proc.communicate(timeout=limit_s)
        return stdout, stderr, ""
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        return stdout, stderr, f"(killed: no exit within {limit_s:.0f} s)"


def run_forked(
    script: str, runs: list[list[str]], out: str, limit_s: float, parallel: int
) -> list[tuple[int | None, str, str, str]]:
    """Run the child ``script`` once per entry of ``runs`` (its arguments), each in its
    own process forked (``parallel`` at a time) from one that imported torch and
    roundpipe once (``forks.py``), each killed after ``limit_s``; -> per run: exit code,
    stdout, stderr, and a note saying it was killed (empty if it exited on its own)."""
    import json

    spec = {"script": script, "out": out, "limit_s": limit_s, "parallel": parallel, "runs": runs}
    server = start_child([os.path.join(CHILDREN, "forks.py"), json.dumps(spec)])
    rounds = -(-len(runs) // parallel)
    stdout, stderr, killed = finish_child(server, limit_s * (rounds + 1))
    assert server.returncode == 0 and not killed, f"forks.py: {killed}\n{stdout}\n{stderr}"
    with open(os.path.join(out, "codes.json")) as f:
        codes = json.load(f)
    results = []
    for index, code in enumerate(codes):
        with (
            open(os.path.join(out, f"{index}.out")) as f_out,
            open(os.path.join(out, f"{index}.err")) as f_err,
        ):
            stdout, stderr = f_out.read(), f_err.read()
        note = f"(killed: no exit within {limit_s:.0f} s)" if code["killed"] else ""
        results.append((code["returncode"], stdout, stderr, note))
    return results


def run_child(args: list[str], limit_s: float) -> dict:
    """Run ``python ARGS`` as a child script for at most ``limit_s`` seconds: the JSON line
    it printed last."""
    return child_result(*finish_child(start_child(args), limit_s), args[0])


def child_result(stdout: str, stderr: str, killed: str, what: str) -> dict:
    """The JSON line a child printed last (fails with its stderr if there is none)."""
    lines = stdout.strip().splitlines()
    assert lines and not killed, f"{what} failed {killed}\n{stderr[-3000:]}"
    return json.loads(lines[-1])
