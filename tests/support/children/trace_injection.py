"""Child of test_interrupts.py: Ctrl-C at every line of one public method, on the main thread.

Usage: ``trace_injection.py METHOD [--raise]`` (a key of ``SCENARIOS``, or ``close``).

A trace hook, set on the main thread only, simulates a SIGINT arriving at one line
event of the caller-side orchestration (``roundpipe/model/__init__.py`` and every file
under ``roundpipe/runtime/``), once per run: at that line it calls the Python-level SIGINT
handler installed at that moment, which is what the interpreter does when a real
SIGINT lands there. With Python's default handler that raises KeyboardInterrupt at
that very line; a handler the runtime installed (to defer Ctrl-C) runs instead.

With ``--raise`` the hook is stricter than any real Ctrl-C: it raises
KeyboardInterrupt itself at each line event of the public methods and the session
code they run (``roundpipe/model/__init__.py``, ``roundpipe/runtime/session.py``), even
where the runtime defers SIGINT.

A dry run lists the method's line events; the injected runs then hit each of them
(every event, or past ``MAX_INJECTIONS`` every distinct line plus a stride of the
rest), all on ONE model (the ``close`` runs use a fresh model each). After each run:
the method returned or raised KeyboardInterrupt, ``synchronize()`` returns without an
error, and the model is consistent and exact (``harness.assert_consistent``). For
``close``: an interrupted ``close()`` called again returns and stops every thread.

Prints ``AT <line>`` before each injection and ``OK <counts>`` at the end. A failure
prints its traceback (with the injection in a note) and exits 1 at once, skipping
the exit hooks that would drain a hung model. Each step runs under a faulthandler
watchdog: a stall of ``LIMIT_S`` dumps every thread's stack and exits 1.
"""

from __future__ import annotations

import faulthandler
import math
import os
import signal
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Background shells start children with SIGINT ignored; Python then leaves it ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)

HERE = os.path.dirname(os.path.abspath(__file__))  # tests/support/children
TESTS = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(TESTS), TESTS, HERE]

import torch  # noqa: E402
from harness import assert_consistent, sgd_step  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipe, RoundPipeRunConfig  # noqa: E402
from support.oracle import batch, mlp, mse_sum  # noqa: E402

LIMIT_S = 20  # no step (a public call, or the exactness check) may take longer
MAX_INJECTIONS = 400  # per method, unless it has more distinct lines than that
DEPTH = 4
NUM_MICROBATCH = 3
LR = 1e-3  # small enough that hundreds of steps on one batch never diverge

PACKAGE = os.path.dirname(os.path.realpath(roundpipe.__file__))
RUNTIME = os.path.join(PACKAGE, "runtime") + os.sep
MODEL_PY = os.path.join(PACKAGE, "model", "__init__.py")  # the RoundPipe class
SESSION_PY = os.path.join(RUNTIME, "session.py")
RAISE = "--raise" in sys.argv[2:]

Site = tuple[str, int]  # (file, line)
Target = tuple[Site, int]  # inject the k-th (1-based) time this line runs


def architecture() -> torch.nn.Module:
    return mlp(depth=DEPTH)


def watchdog(seconds: float = LIMIT_S) -> None:
    """(Re)arm the stall watchdog: dump every thread's stack and exit 1 after ``seconds``."""
    faulthandler.dump_traceback_later(seconds, exit=True)


_orchestration: dict[str, bool] = {}


def is_orchestration(filename: str) -> bool:
    """Caller-side orchestration code: roundpipe/model/__init__.py and roundpipe/runtime/*."""
    known = _orchestration.get(filename)
    if known is None:
        path = os.path.realpath(filename)
        if RAISE:
            known = path in (MODEL_PY, SESSION_PY)
        else:
            known = path == MODEL_PY or path.startswith(RUNTIME)
        _orchestration[filename] = known
    return known


class Injector:
    """A ``sys.settrace`` hook delivering one simulated SIGINT at ``target``.

    With no target it only records the line events (a dry run).
    """

    def __init__(self, target: Target | None = None) -> None:
        self.target = target
        self.seen: Counter[Site] = Counter()
        self.sequence: list[Site] = []
        self.fired = False

    def trace_calls(self, frame, event: str, arg: Any):
        if is_orchestration(frame.f_code.co_filename):
            return self.trace_lines
        return None

    def trace_lines(self, frame, event: str, arg: Any):
        if event != "line" or self.fired:
            return self.trace_lines
        site = (frame.f_code.co_filename, frame.f_lineno)
        if self.target is None:
            self.sequence.append(site)
            return self.trace_lines
        self.seen[site] += 1
        if (site, self.seen[site]) == self.target:
            self.fired = True
            sys.settrace(None)  # once; frames already traced return at once from here on
            if RAISE:
                raise KeyboardInterrupt(f"injected at {describe(self.target)}")
            handler = signal.getsignal(signal.SIGINT)
            if callable(handler):
                handler(signal.SIGINT, frame)  # Python's default raises KeyboardInterrupt
        return self.trace_lines

    def run(self, fn: Callable[[], Any]) -> Any:
        """Call ``fn`` with this hook on the current (main) thread only."""
        sys.settrace(self.trace_calls)
        try:
            return fn()
        finally:
            sys.settrace(None)


def describe(target: Target) -> str:
    (filename, line), occurrence = target
    return f"{os.path.relpath(filename, os.path.dirname(PACKAGE))}:{line} (pass {occurrence})"


def injection_targets(sequence: list[Site], cap: int = MAX_INJECTIONS) -> list[Target]:
    """Every line event of the dry run, or (past ``cap``) every distinct line plus a stride."""
    passes: Counter[Site] = Counter()
    events: list[Target] = []
    for site in sequence:
        passes[site] += 1
        events.append((site, passes[site]))
    if len(events) <= cap:
        return events
    first_passes = [e for e in events if e[1] == 1]
    repeats = [e for e in events if e[1] > 1]
    room = cap - len(first_passes)
    extra = repeats[:: math.ceil(len(repeats) / room)] if room > 0 and repeats else []
    chosen = set(first_passes) | set(extra)
    return [e for e in events if e in chosen]


def dry_run(call: Callable[[], Any]) -> list[Site]:
    injector = Injector()
    watchdog()
    injector.run(call)
    return injector.sequence


def call_interrupted(call: Callable[[], Any], target: Target) -> str:
    """Run ``call`` with the injection armed; -> what happened, in words."""
    injector = Injector(target)
    watchdog()
    try:
        injector.run(call)
    except KeyboardInterrupt:
        outcome = "raised KeyboardInterrupt"
    else:
        outcome = "returned"
    return f"the call {outcome}" if injector.fired else "the line was not reached"


# -- one model, many injections ------------------------------------------------------------


@dataclass
class Rig:
    """One RoundPipe model with its SGD optimizer and the batch it trains on."""

    pipe: RoundPipe
    optimizer: torch.optim.Optimizer
    x: torch.Tensor = field(default_factory=lambda: batch()[0])
    y: torch.Tensor = field(default_factory=lambda: batch()[1])
    other_weights: dict = field(default_factory=lambda: mlp(seed=5, depth=DEPTH).state_dict())

    @classmethod
    def build(cls) -> Rig:
        pipe = RoundPipe(
            architecture(),
            devices="emulated:2",
            model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH),
        )
        return cls(pipe, torch.optim.SGD(pipe.optim_parameters(), lr=LR))

    def train(self) -> torch.Tensor:
        return self.pipe.forward_backward((self.x,), label=self.y, loss_fn=mse_sum)

    def step(self, is_async: bool) -> None:
        self.pipe.step(sgd_step(self.optimizer), is_async=is_async)

    def train_and_step(self) -> None:
        self.train()
        self.step(is_async=True)

    def infer(self) -> torch.Tensor:
        with torch.no_grad():
            return self.pipe(self.x)

    def check(self) -> None:
        """``synchronize()`` returns without an error, then the model is exact."""
        watchdog()
        self.pipe.synchronize()
        watchdog()
        assert_consistent(self.pipe, self.optimizer, architecture, NUM_MICROBATCH, None)


@dataclass
class Scenario:
    prepare: Callable[[Rig], Any]  # runs untraced before each injected call
    call: Callable[[Rig], Any]  # the traced public method


SCENARIOS = {
    "forward_backward": Scenario(lambda rig: None, Rig.train),
    "step-async": Scenario(Rig.train, lambda rig: rig.step(is_async=True)),
    "step-sync": Scenario(Rig.train, lambda rig: rig.step(is_async=False)),
    "synchronize": Scenario(Rig.train_and_step, lambda rig: rig.pipe.synchronize()),
    "state_dict": Scenario(Rig.train_and_step, lambda rig: rig.pipe.state_dict()),
    "load_state_dict": Scenario(
        Rig.train_and_step, lambda rig: rig.pipe.load_state_dict(rig.other_weights)
    ),
    "inference": Scenario(Rig.train_and_step, Rig.infer),
}


class Failed(Exception):
    pass


def failure(error: BaseException, note: str) -> BaseException:
    """``error`` with ``note`` added (a stray KeyboardInterrupt becomes a ``Failed``)."""
    if isinstance(error, KeyboardInterrupt):
        error = Failed(f"KeyboardInterrupt raised again later: {error!r}")
    error.add_note(note)
    return error


def every_line_of(method: str) -> Counter[str]:
    scenario = SCENARIOS[method]
    rig = Rig.build()
    watchdog()
    scenario.prepare(rig)
    targets = injection_targets(dry_run(lambda: scenario.call(rig)))
    rig.check()
    assert targets, f"{method} ran no orchestration line: the injection would be vacuous"
    print(f"TARGETS {len(targets)}", flush=True)

    def run_once(target, stage: list[str], previous: str) -> str:
        stage[0] = f"preparing the next run failed after {previous}"
        watchdog()
        scenario.prepare(rig)
        stage[0] = "the call did not end"
        result = stage[0] = call_interrupted(lambda: scenario.call(rig), target)
        rig.check()
        return result

    outcomes = inject_each(targets, method, run_once)
    watchdog()
    rig.pipe.close()
    return outcomes


def inject_each(targets, label: str, run_once) -> Counter[str]:
    """Interrupt at each of ``targets`` in turn: ``run_once(target, stage, previous)``
    runs one interrupted call and returns its outcome, keeping ``stage[0]`` on what it
    is doing so a failure says where it happened."""
    outcomes: Counter[str] = Counter()
    previous = "the dry run"
    for target in targets:
        where = f"{label}: Ctrl-C at {describe(target)}"
        print(f"AT {where}", flush=True)
        stage = ["starting"]
        try:
            outcomes[run_once(target, stage, previous)] += 1
        except BaseException as exc:
            raise failure(exc, f"{where}; {stage[0]}") from None
        previous = where
    return outcomes


def fresh_threads(before: set[threading.Thread]) -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if t not in before and t.is_alive() and t.name.startswith("roundpipe")
    ]


def every_line_of_close() -> Counter[str]:
    before = set(threading.enumerate())
    rig = Rig.build()
    watchdog()
    rig.train_and_step()
    targets = injection_targets(dry_run(rig.pipe.close))
    assert targets, "close ran no orchestration line: the injection would be vacuous"
    assert fresh_threads(before) == [], "threads left running after close()"
    print(f"TARGETS {len(targets)}", flush=True)

    def run_once(target, stage: list[str], previous: str) -> str:
        before = set(threading.enumerate())
        stage[0] = f"building and training a fresh model failed after {previous}"
        rig = Rig.build()
        watchdog()
        rig.train_and_step()
        stage[0] = "the first close() did not end"
        result = stage[0] = call_interrupted(rig.pipe.close, target)
        watchdog()
        rig.pipe.close()
        left = fresh_threads(before)
        assert left == [], f"threads left running after the second close(): {left}"
        return result

    return inject_each(targets, "close", run_once)


def main(method: str) -> None:
    outcomes = every_line_of_close() if method == "close" else every_line_of(method)
    total = sum(outcomes.values())
    reached = total - outcomes["the line was not reached"]
    assert reached >= total / 2, f"most injections were never reached: {dict(outcomes)}"
    faulthandler.cancel_dump_traceback_later()
    print(f"OK {dict(outcomes)}", flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip the exit hooks: they would wait for a model left hung
