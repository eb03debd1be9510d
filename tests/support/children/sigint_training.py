"""Child of test_interrupts.py: a training loop that survives bursts of real SIGINTs.

Usage: ``sigint_training.py SEED``. Prints ``READY`` once the model is built, then
runs ``forward_backward`` + async ``step`` iterations, catching every
KeyboardInterrupt and carrying on, until it reads a line on stdin (the parent's
"no more signals") and has run at least ``MIN_ITERATIONS``. Then it ignores SIGINT,
synchronizes, checks the model is consistent and exact, closes it, and prints
``OK interrupts=<n> iterations=<n>``. Any stall longer than ``STALL_S`` dumps every
thread's stack to stderr and exits (code 1).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading

# Background shells start children with SIGINT ignored; Python then leaves it ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)

HERE = os.path.dirname(os.path.abspath(__file__))  # tests/support/children
TESTS = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(TESTS), TESTS, HERE]

import torch  # noqa: E402
from harness import assert_consistent, sgd_step  # noqa: E402

from roundpipe import RoundPipe, RoundPipeRunConfig  # noqa: E402
from support.oracle import batch, mlp, mse_sum  # noqa: E402

STALL_S = 15
MIN_ITERATIONS = 20
DEPTH = 4
NUM_MICROBATCH = 3

seed = int(sys.argv[1])
stop = threading.Event()


def wait_for_stop() -> None:
    sys.stdin.readline()
    stop.set()


threading.Thread(target=wait_for_stop, name="stop-reader", daemon=True).start()

pipe = RoundPipe(
    mlp(depth=DEPTH),
    devices="emulated:2",
    model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH),
)
optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=1e-3)  # never diverges
x, y = batch(seed=seed)
counts = {"interrupts": 0, "iterations": 0}


def train_until_stopped() -> None:
    while not (stop.is_set() and counts["iterations"] >= MIN_ITERATIONS):
        try:
            faulthandler.dump_traceback_later(STALL_S, exit=True)
            counts["iterations"] += 1
            try:
                pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
                pipe.step(sgd_step(optimizer), is_async=True)
            except KeyboardInterrupt:
                counts["interrupts"] += 1
        except KeyboardInterrupt:  # landed between the statements around the call
            counts["interrupts"] += 1


print("READY", flush=True)
while True:
    try:
        train_until_stopped()
        break
    except KeyboardInterrupt:
        counts["interrupts"] += 1

signal.signal(signal.SIGINT, signal.SIG_IGN)
faulthandler.dump_traceback_later(STALL_S, exit=True)
pipe.synchronize()
assert_consistent(pipe, optimizer, lambda: mlp(depth=DEPTH), NUM_MICROBATCH, limit_s=None)
pipe.close()
faulthandler.cancel_dump_traceback_later()
print(f"OK interrupts={counts['interrupts']} iterations={counts['iterations']}", flush=True)
