"""Does a long run without ``synchronize()`` slow down?

Trains a tiny model for many async steps on emulated devices and prints the mean
time per iteration of each block of steps; bookkeeping that grows with the number of
steps shows up as a rising series.

    .venv/bin/python bench/long_run.py [--steps 5000] [--block 500]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--block", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 4))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    config = RoundPipeRunConfig(num_microbatch=2)
    with RoundPipe(model, devices="emulated:2", model_run_config=config) as pipe:
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=1e-4)
        blocks = []
        start = time.perf_counter()
        for i in range(1, args.steps + 1):
            pipe.forward_backward((x,), label=y, loss_fn=nn.functional.mse_loss)
            pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()))
            if i % args.block == 0:
                now = time.perf_counter()
                blocks.append((now - start) / args.block * 1e3)
                start = now
    print(f"ms per iteration, blocks of {args.block} steps:", " ".join(f"{b:.2f}" for b in blocks))
    print(f"last block / first block: {blocks[-1] / blocks[0]:.2f}")


if __name__ == "__main__":
    main()
