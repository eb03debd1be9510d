"""What each rank of a checkpoint test on several nodes runs (see
``tests/support/multinode.py``): a save with one rank killed part-way."""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path

import torch

from roundpipe import RoundPipe
from roundpipe.cluster import CommOptions
from support.oracle import batch, mlp, mse_sum


def _share(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return torch.tensor_split(tensor, 2)[rank]


def save_killed(rank: int, *, checkpoint: str, phase: str, kill_at: str = "", **_: object):
    """``phase="save"``: checkpoint A after 2 steps, then B after a third with rank 1
    killed in B's save at ``kill_at`` ("writing": its first fsync; "swapping": just
    before its shard is renamed into place; "swapped": just after). ``"load"``: load,
    recording the warnings, then save C over what is there and load that."""
    pipe = RoundPipe(mlp(), devices="emulated:2", comm_options=CommOptions(timeout_s=5))
    opt = torch.optim.Adam(pipe.optim_parameters(), lr=0.01)
    states = {}
    if phase == "load":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = pipe.load_checkpoint(checkpoint, opt)
        states[loaded] = {k: v.clone() for k, v in pipe.state_dict().items()}
        pipe.save_checkpoint(checkpoint, opt, extra="C")
        result = {"loaded": loaded, "warnings": [str(w.message) for w in caught]}
        result["then"] = pipe.load_checkpoint(checkpoint, opt)
        pipe.close()
        return {**result, "states": states}
    for step in range(3):
        x, y = batch(seed=step, size=8)
        pipe.forward_backward((_share(x, rank),), label=_share(y, rank), loss_fn=mse_sum)
        pipe.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        if step == 1:
            pipe.save_checkpoint(checkpoint, opt, extra="A")
            states["A"] = {k: v.clone() for k, v in pipe.state_dict().items()}
    states["B"] = {k: v.clone() for k, v in pipe.state_dict().items()}
    if rank == 1:
        _kill_at(kill_at, Path(checkpoint) / "rank1-of-2")
    try:
        pipe.save_checkpoint(checkpoint, opt, extra="B")
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    pipe.close()
    return {"states": states, "error": error}


def _kill_at(point: str, shard: Path) -> None:
    """SIGKILL this process at ``point`` of its next checkpoint save (see save_killed)."""
    replace, fsync = os.replace, os.fsync

    def killed() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def replacing(src, dst, **kwargs) -> None:
        if Path(dst) == shard and point == "swapping":
            killed()
        replace(src, dst, **kwargs)
        if Path(dst) == shard and point == "swapped":
            killed()

    def syncing(fd: int) -> None:
        if point == "writing":
            killed()
        fsync(fd)

    os.replace, os.fsync = replacing, syncing
