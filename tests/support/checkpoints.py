"""Checkpoint test helpers: a pipe mid-training, everything a load may change, and
checkpoint files damaged or rewritten the way a hostile user or a bad disk would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from roundpipe import RoundPipe, RoundPipeRunConfig
from support.oracle import batch, mlp, mse_sum

CONFIG = RoundPipeRunConfig(num_microbatch=2)


def new_pipe(seed: int) -> RoundPipe:
    return RoundPipe(mlp(seed), devices="emulated:2", model_run_config=CONFIG)


def mid_training(pipe: RoundPipe, seed: int):
    """AdamW + StepLR after two steps, with a third call's gradients not stepped yet;
    returns ``(optimizer, scheduler)``."""
    optimizer = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    for step in range(3):
        x, y = batch(seed + step)
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        if step < 2:
            pipe.step(update, is_async=False)
    torch.manual_seed(seed)  # the RNG state a load restores
    return optimizer, scheduler


def live_state(pipe: RoundPipe, optimizer, scheduler) -> dict[str, Any]:
    """Everything a load may change: weights, masters and their gradients, the optimizer
    and scheduler state, the RNG states."""
    pipe.synchronize()
    masters = list(pipe.optim_parameters())
    return {
        "weights": [p.detach().clone() for p in pipe.model.parameters()],
        "masters": [m.detach().clone() for m in masters],
        "grads": [None if m.grad is None else m.grad.clone() for m in masters],
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": [torch.get_rng_state()] + [d.get_rng_state() for d in pipe.pool],
    }


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    """``got`` equals ``want`` exactly: tensors bit for bit, containers item by item."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def rewrite(file: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite the safetensors ``file`` after ``change`` edited its tensors in place
    (its metadata kept)."""
    with safe_open(str(file), "pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 - not a dict
    change(tensors)
    save_file(tensors, str(file), metadata=metadata)


def truncate(file: Path, fraction: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * fraction)])
