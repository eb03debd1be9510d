"""Child: save a checkpoint, say so, then save again and again until killed.

Usage: python save_forever.py DIR. Prints "SAVED 1" after the first save completed.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from roundpipe import RoundPipe


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])  # ~8 MB per save
    with RoundPipe(model, devices="emulated:2") as pipe:
        optimizer = torch.optim.AdamW(pipe.optim_parameters())
        x, y = torch.randn(6, 512), torch.randn(6, 512)
        pipe.forward_backward((x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum())
        pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
        pipe.save_checkpoint(sys.argv[1], optimizer, extra=1)
        print("SAVED 1", flush=True)
        count = 1
        while True:
            count += 1
            pipe.save_checkpoint(sys.argv[1], optimizer, extra=count)


if __name__ == "__main__":
    main()
