"""What each rank runs in the tests of ranks agreeing on what they do: starting from the
same model, and calling the same collective methods (see ``tests/support/multinode.py``)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.cluster import CommOptions
from support.multinode_scenarios import rank_share
from support.oracle import batch, mlp, mse_sum


class Offset(nn.Module):
    """Adds a fixed random offset: a buffer, not trained, that changes the output."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("offset", torch.randn(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset


def offset_mlp(seed: int, width: int = 16, offset_shape: tuple[int, ...] = (4,)) -> nn.Sequential:
    """``oracle.mlp(seed)`` followed by an :class:`Offset` drawn from the same seed."""
    model = mlp(seed=seed, width=width)
    return nn.Sequential(*model, Offset(offset_shape)).double()


def _error(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - what the test looks at
        return f"{type(exc).__name__}: {exc}"
    return None


def _pipe(model: nn.Module, timeout_s: float = 30) -> RoundPipe:
    return RoundPipe(
        model,
        devices="emulated:2",
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        comm_options=CommOptions(timeout_s=timeout_s),
    )


def _train_step(pipe: RoundPipe, opt, rank: int, step: int, step_fn=None) -> None:
    x, y = batch(seed=step, size=12)
    world = dist.get_world_size()
    xs, ys = rank_share(x.double(), rank, world), rank_share(y.double(), rank, world)
    pipe.forward_backward((xs,), label=ys, loss_fn=mse_sum)
    pipe.step(step_fn or (lambda: (opt.step(), opt.zero_grad())), is_async=False)


def seeded_by_rank(rank: int, *, steps: int = 3, **_: object) -> dict:
    """Rank r wraps ``offset_mlp(seed=r)`` and trains it with Adam."""
    pipe = _pipe(offset_mlp(seed=rank))
    opt = torch.optim.Adam(pipe.optim_parameters(), lr=0.01)
    for step in range(steps):
        _train_step(pipe, opt, rank, step)
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe.close()
    return {"state": state}


def model_differs(rank: int, *, part: str, **_: object) -> dict:
    """Rank 1's ``part`` ("weight" or "buffer") has another shape than rank 0's."""
    differs = rank == 1
    width = 17 if differs and part == "weight" else 16
    shape = (1, 4) if differs and part == "buffer" else (4,)
    pipe = None

    def build() -> None:
        nonlocal pipe
        pipe = _pipe(offset_mlp(seed=0, width=width, offset_shape=shape))

    error = _error(build)
    if pipe is not None:
        pipe.close()
    return {"error": error}


def one_rank_does(rank: int, *, method: str, checkpoint: str, **_: object) -> dict:
    """After a step together, rank 0 calls ``method`` while rank 1 calls forward_backward;
    then each tries forward_backward once more (timed)."""
    pipe = _pipe(mlp().double())
    opt = torch.optim.Adam(pipe.optim_parameters(), lr=0.01)
    _train_step(pipe, opt, rank, 0)
    pipe.save_checkpoint(checkpoint, opt)  # together: something to load
    x, y = batch(seed=1, size=12)
    xs, ys = rank_share(x.double(), rank, 2), rank_share(y.double(), rank, 2)
    if rank == 0 and method == "save_checkpoint":
        error = _error(pipe.save_checkpoint, checkpoint, opt)
    elif rank == 0 and method == "load_checkpoint":
        error = _error(pipe.load_checkpoint, checkpoint, opt)
    else:
        error = _error(pipe.forward_backward, (xs,), label=ys, loss_fn=mse_sum)
    start = time.monotonic()
    then = _error(pipe.forward_backward, (xs,), label=ys, loss_fn=mse_sum)
    then_s = time.monotonic() - start
    return {"error": error, "then": then, "then_s": then_s, "closing": _error(pipe.close)}


def step_fns_differ(rank: int, **_: object) -> dict:
    """Rank 0's step_fn clips the gradient norm (an all-reduce), rank 1's does not."""
    pipe = _pipe(mlp().double())
    opt = torch.optim.Adam(pipe.optim_parameters(), lr=0.01)

    def step_fn() -> None:
        if rank == 0:
            pipe.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    error = _error(_train_step, pipe, opt, rank, 0, step_fn)
    return {"error": error, "closing": _error(pipe.close)}


def step_on_one_rank(rank: int, *, timeout_s: float, **_: object) -> dict:
    """Rank 0 steps after a call, rank 1 starts another call instead."""
    pipe = _pipe(mlp().double(), timeout_s=timeout_s)
    opt = torch.optim.Adam(pipe.optim_parameters(), lr=0.01)
    x, y = batch(seed=0, size=12)
    xs, ys = rank_share(x.double(), rank, 2), rank_share(y.double(), rank, 2)

    def two_calls() -> None:
        for _ in range(2):
            pipe.forward_backward((xs,), label=ys, loss_fn=mse_sum)

    start = time.monotonic()
    error = _error(_train_step, pipe, opt, rank, 0) if rank == 0 else _error(two_calls)
    elapsed = time.monotonic() - start
    return {"error": error, "seconds": elapsed, "closing": _error(pipe.close)}


SCENARIOS = {
    "seeded_by_rank": seeded_by_rank,
    "model_differs": model_differs,
    "one_rank_does": one_rank_does,
    "step_fns_differ": step_fns_differ,
    "step_on_one_rank": step_on_one_rank,
}
