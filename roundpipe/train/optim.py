"""The optimizer side of ``roundpipe train``: AdamW over the masters, the learning-rate
schedule, and the step function that runs on RoundPipe's host optimizer thread."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """The learning rate of 0-based ``step`` as a fraction of the peak: a linear warm-up
    over ``warmup`` steps (from ``1 / (warmup + 1)`` up to 1), then ``constant``, or a
    ``linear`` or ``cosine`` decay that would reach 0 at step ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    params: list[torch.nn.Parameter], lr: float, weight_decay: float
) -> torch.optim.AdamW:
    """``AdamW(fused=True)`` where the masters' device and dtype support it, else the
    default implementation."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup: int, total: int, schedule: str
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over :func:`lr_factor`. The factor is a closure, not a callable
    object, so the scheduler's saved state holds no total: a resumed run may raise it."""

    def factor(step: int) -> float:
        return lr_factor(step, warmup, total, schedule)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def adopt_options(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    lr: float,
    weight_decay: float,
) -> None:
    """After loading a checkpoint: this run's peak ``lr``, ``weight_decay`` and schedule
    (a raised total) replace the saved ones. For unchanged options this sets the values
    the saved run would have used, bit for bit (the same expression as ``LambdaLR``)."""
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = lr
        group["weight_decay"] = weight_decay
        group["lr"] = lr * factor(scheduler.last_epoch)


def step_function(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    clip_grad_norm: Callable[[float], object],
    grad_clip: float,
    scaler: torch.amp.GradScaler | None,
) -> Callable[[], None]:
    """One optimizer step on the masters: unscale (fp16), clip the global gradient norm
    with ``clip_grad_norm`` (the pipe's: over every node's gradients, and on one node
    ``torch.nn.utils.clip_grad_norm_`` over the masters), step (skipped by the scaler on
    overflow), clear the gradients, advance the schedule. ``scheduler.last_epoch``
    therefore counts the steps that ran."""

    def step() -> None:
        if scaler is not None:
            scaler.unscale_(optimizer)
        if grad_clip > 0:
            clip_grad_norm(grad_clip)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    return step


def discard_gradients(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """A step function that drops accumulated gradients and changes no weight (for a run
    interrupted between a call and its step)."""
    return lambda: optimizer.zero_grad(set_to_none=True)
