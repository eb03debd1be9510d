"""Child of test_close_and_exit.py: the script ends while async work is still in flight.

Usage: ``exit_in_flight.py MODE``. It queues two ``forward_backward`` calls and two
async ``step``s (backward stages with modelled kernel time, step functions that
sleep 0.1 s: ~0.3 s of work in all), prints ``QUEUED steps_done=<steps run so
far>`` and then, without ``close()``, by MODE:

* ``end``: falls off the end of the script (exit code 0 expected);
* ``raise``: raises an uncaught exception (exit code 1 expected);
* ``exit3``: calls ``sys.exit(3)`` (exit code 3 expected);
* ``drain``: the parent's probe: synchronizes, closes and prints
  ``DRAINED steps_done=2``.

A stall of ``STALL_S`` dumps every thread's stack to stderr and exits (code 1); the
parent tells that from a real exit by the dump's "Timeout (" header.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))  # tests/support/children
TESTS = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(TESTS), TESTS, HERE]

import torch  # noqa: E402

from roundpipe import EmulatedOptions, OpInfo, RoundPipe, RoundPipeRunConfig  # noqa: E402
from support.oracle import batch, mlp, mse_sum  # noqa: E402

STALL_S = 20
MODE = sys.argv[1]
NUM_MICROBATCH = 3
DEPTH = 8
BACKWARD_S = 0.03  # modelled seconds per backward op; forward ops are nearly free
STEP_S = 0.1  # each step_fn sleeps this long: a step is surely in flight at exit

steps_done: list[int] = []


def kernel_time(info: OpInfo) -> float:
    return BACKWARD_S if info.kind == "backward" else 0.002


def slow_step(optimizer: torch.optim.Optimizer):
    def step_fn() -> None:
        time.sleep(STEP_S)
        optimizer.step()
        optimizer.zero_grad()
        steps_done.append(1)

    return step_fn


faulthandler.dump_traceback_later(STALL_S, exit=True)
pipe = RoundPipe(
    mlp(depth=DEPTH, width=64),
    devices="emulated:2",
    model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH),
    emulated_options=EmulatedOptions(kernel_time=kernel_time),
)
optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=1e-3)
x, y = batch(size=48)
for _ in range(2):
    pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
    pipe.step(slow_step(optimizer), is_async=True)
print(f"QUEUED steps_done={len(steps_done)}", flush=True)

if MODE == "drain":
    pipe.synchronize()
    pipe.close()
    print(f"DRAINED steps_done={len(steps_done)}", flush=True)
    faulthandler.cancel_dump_traceback_later()
    sys.exit(0)
if MODE == "raise":
    raise RuntimeError("uncaught on purpose, with work in flight")
if MODE == "exit3":
    sys.exit(3)
assert MODE == "end", MODE
