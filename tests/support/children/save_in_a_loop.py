"""Child: save a small model's checkpoint to DIR COUNT times, then print "DONE".

Usage: python save_in_a_loop.py DIR COUNT TAG. Each save's ``extra`` is
``{"by": TAG, "save": i}``; a failing save ends the process with its traceback.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from roundpipe import RoundPipe


def main() -> None:
    path, count, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with RoundPipe(model, devices="emulated:1") as pipe:
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=0.1)
        for i in range(count):
            pipe.save_checkpoint(path, optimizer, extra={"by": tag, "save": i})
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
