"""The optimizer side of ``roundpipe train``: AdamW over the masters, the learning-rate
schedule, and the step function that runs on RoundPipe's host optimizer thread.

Each piece follows the convention of ``transformers``' ``Trainer``, so a run configured
as a Trainer run trains as it would (docs/design.md#training-loop): the schedule is
``get_scheduler``'s, the weight decay spares what ``Trainer.get_decay_parameter_names``
spares, and the logged gradient norm is the one ``clip_grad_norm_`` returns.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import SupportsFloat

import torch
from torch import nn

from .options import TrainOptions

NO_DECAY_PATTERNS = tuple(
    re.compile(pattern)
    for pattern in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
)
"""``Trainer.get_decay_parameter_names``' name patterns (matched on the lower-cased
name): biases and norm weights take no weight decay."""


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """The learning rate of 0-based ``step`` as a fraction of the peak, as
    ``transformers.get_scheduler`` computes it (``linear``, ``cosine`` or
    ``constant_with_warmup``): ``step / warmup`` during the warm-up (so the first step's
    rate is 0), then constant, or a linear or cosine decay reaching 0 at step ``total``."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if schedule == "constant":
        return 1.0
    remaining = float(max(1, total - warmup))
    if schedule == "linear":
        return max(0.0, float(total - step) / remaining)
    progress = float(step - warmup) / remaining
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def warmup_steps(total: int, steps: int, ratio: float | None) -> int:
    """The warm-up of a run of ``total`` steps: ``steps`` when nonzero, else
    ``ceil(total * ratio)`` (``TrainingArguments.get_warmup_steps``)."""
    if steps or ratio is None:
        return steps
    return math.ceil(total * ratio)


def decay_parameter_names(model: nn.Module) -> set[str]:
    """The names in ``model`` of the parameters weight decay applies to, as
    ``Trainer.get_decay_parameter_names``: all but those inside an ``nn.LayerNorm`` and
    those whose lower-cased name matches :data:`NO_DECAY_PATTERNS`."""
    inside_layer_norms = tuple(
        f"{name}."
        for name, module in model.named_modules(remove_duplicate=False)
        if name and isinstance(module, nn.LayerNorm)
    )
    return {
        name
        for name, _ in model.named_parameters(remove_duplicate=False)
        if not name.startswith(inside_layer_norms)
        and not any(pattern.search(name.lower()) for pattern in NO_DECAY_PATTERNS)
    }


def parameter_groups(
    named: Iterable[tuple[str, nn.Parameter]], decay_names: set[str], weight_decay: float
) -> list[dict]:
    """``Trainer``'s two parameter groups: those named in ``decay_names`` with
    ``weight_decay``, then the rest with none (either may be empty)."""
    decay: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for name, param in named:
        (decay if name in decay_names else rest).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def build_optimizer(
    groups: list[dict], lr: float, states: str = "fp32", masters: str = "fp32", seed: int = 0
) -> torch.optim.Optimizer:
    """:func:`roundpipe.optim.make_adamw` over ``groups``, its moments in ``states``;
    with bf16 ``masters`` each update is rounded stochastically, from random numbers of
    the optimizer's own drawn from ``seed``. The defaults (fp32, fp32) give
    ``torch.optim.AdamW(fused=True)`` where the masters support it, as always
    (docs/design.md#train-options)."""
    from ..optim import make_adamw

    return make_adamw(groups, lr=lr, states=states, stochastic_round=masters == "bf16", seed=seed)


def lean_pipe_options(options: TrainOptions) -> dict:
    """``from_pretrained``'s keywords for ``--master-weights bf16`` (masters in the
    model's dtype: the bf16 weights themselves) and ``--quantize nf4`` (the frozen base
    in NF4); none for the defaults, so a default run builds its pipe as before."""
    lean: dict = {}
    if options.full and options.master_weights == "bf16":
        lean["optim_dtype"] = torch.bfloat16
    if not options.full and options.quantize != "none":
        lean["quantize"] = options.quantize
    return lean


def lean_note(options: TrainOptions) -> str:
    """The run's lean settings for the line that starts training (nothing for the
    defaults): ``", optimizer states int8, bf16 masters"``, ``", NF4 base"``."""
    if not options.full:
        return ", NF4 base" if options.quantize == "nf4" else ""
    states, masters = optimizer_settings(options)
    notes = [f"optimizer states {states}"] if states != "fp32" else []
    notes += ["bf16 masters"] if masters == "bf16" else []
    return "".join(f", {note}" for note in notes)


def optimizer_settings(options: TrainOptions) -> tuple[str, str]:
    """``(states, masters)`` of the run's optimizer: ``--optimizer-states`` and
    ``--master-weights`` with ``--full``; fp32 for an adapter's."""
    if not options.full:
        return "fp32", "fp32"
    return options.optimizer_states, options.master_weights


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
    (a raised total) replace the saved ones. The first group takes ``weight_decay``, a
    second (:func:`parameter_groups`' rest) none. For unchanged options this sets the
    values the saved run would have used, bit for bit (the same expression as
    ``LambdaLR``)."""
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    groups = zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True)
    for index, (group, factor) in enumerate(groups):
        group["initial_lr"] = lr
        group["weight_decay"] = weight_decay if index == 0 else 0.0
        rate = lr * factor(scheduler.last_epoch)
        if isinstance(group["lr"], torch.Tensor):  # torchao's: filled, as LambdaLR does
            group["lr"].fill_(rate)
        else:
            group["lr"] = rate


class GradNorms:
    """The gradient norm of each step (1-based), before clipping: written by the step
    function on the optimizer thread, read by the loop, which with asynchronous steps
    writes a step's metrics once its norm is in."""

    def __init__(self) -> None:
        self._norms: dict[int, float] = {}
        self._lock = threading.Lock()

    def record(self, step: int, norm: float) -> None:
        with self._lock:
            self._norms[step] = norm

    def pop(self, step: int) -> float | None:
        """Step ``step``'s norm, forgotten here (None: not known yet)."""
        with self._lock:
            return self._norms.pop(step, None)


def step_function(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    clip_grad_norm: Callable[[float], SupportsFloat],
    grad_clip: float,
    scaler: torch.amp.GradScaler | None,
    norms: GradNorms,
) -> Callable[[], None]:
    """One optimizer step on the masters: unscale (fp16), clip the global gradient norm
    with ``clip_grad_norm`` (the pipe's: over every node's gradients, and on one node
    ``torch.nn.utils.clip_grad_norm_`` over the masters; with ``grad_clip`` 0 at an
    infinite norm, which measures without clipping) and record the norm in ``norms``,
    step (skipped by the scaler on overflow), clear the gradients, advance the schedule.
    ``scheduler.last_epoch`` therefore counts the steps that ran."""

    def step() -> None:
        if scaler is not None:
            scaler.unscale_(optimizer)
        norm = clip_grad_norm(grad_clip if grad_clip > 0 else math.inf)
        norms.record(scheduler.last_epoch + 1, float(norm))
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    return step


@dataclass(frozen=True)
class Optimization:
    """A run's optimizer, its schedule (over ``warmup`` warm-up steps), its step
    function and the gradient norms that records."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    step_fn: Callable[[], None]
    norms: GradNorms
    warmup: int


def build_optimization(
    pipe, options: TrainOptions, total: int, scaler, grouped: bool = True
) -> Optimization:
    """AdamW over ``pipe``'s masters in :func:`parameter_groups` (``grouped=False``: one
    group, all decayed, as before roundpipe spared biases and norms: what a checkpoint
    of then holds), the schedule of a run of ``total`` steps, the step function."""
    named = list(pipe.optim_named_parameters())
    if grouped:
        decay_names = decay_parameter_names(pipe.hf_model)
        groups = parameter_groups(named, decay_names, options.weight_decay)
    else:
        groups = [{"params": [p for _, p in named], "weight_decay": options.weight_decay}]
    optimizer = build_optimizer(groups, options.lr, *optimizer_settings(options), seed=options.seed)
    warmup = warmup_steps(total, options.warmup_steps, options.warmup_ratio)
    scheduler = build_scheduler(optimizer, warmup, total, options.schedule)
    norms = GradNorms()
    step_fn = step_function(
        optimizer, scheduler, pipe.clip_grad_norm_, options.grad_clip, scaler, norms
    )
    return Optimization(optimizer, scheduler, step_fn, norms, warmup)


def step_without_update(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """A step function that drops accumulated gradients and changes no weight (for a run
    interrupted between a call and its step)."""
    return lambda: optimizer.zero_grad(set_to_none=True)
