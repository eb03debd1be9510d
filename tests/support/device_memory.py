"""Device memory in the runtime tests: what a device holds once the runtime has let go,
and a model whose first layer runs out of a small emulated capacity (in its forward
stage or only in its recompute) on large microbatches."""

from __future__ import annotations

import time

import torch
from torch import nn

from roundpipe import EmulatedOptions, RoundPipe, RoundPipeRunConfig
from support.oracle import batch


def drained(device, patience_s: float = 2.0) -> int:
    """Device memory in use once the runtime's threads let go of the last job's tensors
    (they may drop their references a moment after ``synchronize`` returns)."""
    deadline = time.monotonic() + patience_s
    while device.memory_allocated() and time.monotonic() < deadline:
        time.sleep(0.01)
    return device.memory_allocated()


WIDTH = 64
SCRATCH_FLOATS = 4096  # per sample: 16 KiB
CAPACITY = 160 * 1024  # training on 2-sample microbatches fits (105 KiB), 32 samples do not
NUM_MICROBATCH = 2
CONFIG = RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH, execute_plan="1,1|2,1,1")


class Hungry(nn.Module):
    """A Linear that takes ``SCRATCH_FLOATS`` of device memory per sample in its forward
    stage (``phase="forward"``), or only when it runs for a backward (its recompute)."""

    def __init__(self, phase: str) -> None:
        super().__init__()
        self.phase = phase
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        if self.phase == "forward" or torch.is_grad_enabled():
            torch.zeros(len(x), SCRATCH_FLOATS)
        return self.proj(x)


def model_hungry_in(phase: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Hungry(phase), *[nn.Linear(WIDTH, WIDTH) for _ in range(3)])


def batches(seeds, size: int):
    return [batch(seed=seed, size=size, inputs=WIDTH, outputs=WIDTH) for seed in seeds]


def emulated_pipe(module: nn.Module) -> RoundPipe:
    options = EmulatedOptions(capacity_bytes=CAPACITY, count_compute_memory=True)
    return RoundPipe(
        module, devices="emulated:2", model_run_config=CONFIG, emulated_options=options
    )
