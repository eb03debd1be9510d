"""The checks of ``roundpipe train``'s options once merged: contradictions and
out-of-range values, each named by its option (docs/design.md#train-options).

:func:`check` sees the options as the user gave them (before the machine fills
``--devices`` and ``--precision``); :func:`check_dtypes` sees them filled, for the
choices that depend on the model's dtype.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from .aliases import flag
from .preference_options import check_preference
from .trackers import check_trackers
from .usage import UsageError

TrainOptions = Any
"""A :class:`roundpipe.train.options.TrainOptions` (not imported: that module imports
this one)."""

PRECISIONS = ("bf16", "fp16", "fp32")
SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZER_STATES = ("fp32", "bf16", "int8")
"""``--optimizer-states``: the dtype of AdamW's two moments (docs/design.md#train-options)."""
MASTER_WEIGHTS = ("fp32", "bf16")
"""``--master-weights``: fp32 copies, or the bf16 weights themselves."""
QUANTIZATIONS = ("none", "nf4")
"""``--quantize``: how a LoRA run keeps its frozen base in host memory."""
FULL_ONLY = ("optimizer_states", "master_weights")
"""Options of the optimizer over every weight: a LoRA run has no use for them."""
LORA_ONLY = ("quantize",)
"""Options of a LoRA run's frozen base: ``--full`` trains (so keeps) every weight."""
CHOICES = {"precision": PRECISIONS, "schedule": SCHEDULES, "optimizer_states": OPTIMIZER_STATES,
           "master_weights": MASTER_WEIGHTS, "quantize": QUANTIZATIONS}  # fmt: skip
_SPEED = r"(\d+(\.\d*)?|\.\d+)"
DEVICE_SPEC = re.compile(rf"cuda(:\d+(,\d+)*)?|emulated:[1-9]\d*(@{_SPEED}(,{_SPEED})*)?")
"""``--devices``: GPUs, or emulated devices with one speed for all or one per device (how
many speeds, and their values: :func:`_check_devices`)."""


def check(options: TrainOptions, given: set[str]) -> None:
    """Contradictions and out-of-range values, each named by its option (contradictions
    count only between the options in ``given``, those the user gave)."""
    o = options
    if not o.demo:
        missing = [f"--{n}" for n in ("model", "data", "output") if getattr(o, n) is None]
        if missing:
            raise UsageError(f"missing {', '.join(missing)} (or use --demo)")
    _check_finite(o)
    _check_mode(o, given)
    check_preference(o, given)
    if o.steps is not None and o.epochs is not None:
        raise UsageError(f"give --steps ({o.steps}) or --epochs ({o.epochs}), not both")
    if o.eval_every is not None and o.eval_data is None and o.eval_split is None:
        raise UsageError("--eval-every needs --eval-data or --eval-split (the data to evaluate on)")
    if o.eval_split is not None and o.eval_data is not None:
        raise UsageError(
            "give --eval-data (data to evaluate on) or --eval-split (a share of --data held "
            "out), not both"
        )
    if o.eval_split is not None and not 0 < o.eval_split < 1:
        raise UsageError(f"--eval-split must be a fraction in (0, 1), got {o.eval_split}")
    for key in ("lora_r", "steps", "batch_size", "seq_len", "microbatches",
                "eval_every", "save_every", "keep_checkpoints"):  # fmt: skip
        _check_at_least(key, getattr(o, key), 1)
    for key in ("lr", "lora_alpha", "dist_timeout", "epochs"):
        if getattr(o, key) is not None and getattr(o, key) <= 0:
            raise UsageError(f"{flag(key)} must be positive, got {getattr(o, key)}")
    for key in ("warmup_steps", "grad_clip", "weight_decay"):
        _check_at_least(key, getattr(o, key), 0)
    if not 0 <= o.lora_dropout < 1:
        raise UsageError(f"--lora-dropout must be in [0, 1), got {o.lora_dropout}")
    if not o.full and not o.lora_target_modules():
        raise UsageError(f"--lora-targets names no module: {o.lora_targets!r}")
    if o.microbatches is not None and o.microbatches > o.batch_size:
        raise UsageError(
            f"--microbatches {o.microbatches} exceeds --batch-size {o.batch_size}: each "
            "microbatch needs at least one sequence"
        )
    _check_devices(o.devices)
    for key, allowed in CHOICES.items():
        value = getattr(o, key)
        if value is not None and value not in allowed:
            raise UsageError(f"{flag(key)} must be one of {', '.join(allowed)}, got {value!r}")
    if o.warmup_ratio is not None and not 0 <= o.warmup_ratio <= 1:
        raise UsageError(f"--warmup-ratio must be a fraction in [0, 1], got {o.warmup_ratio}")
    check_trackers(o.trackers())


def _check_devices(devices: str | None) -> None:
    """``--devices`` is one of the device spec forms (``roundpipe.devices.SPEC_FORMS``);
    an emulated pool's speeds are as many as its devices, each above 0 (checked as
    ``make_pool`` checks them)."""
    if devices is None:
        return
    from ..devices import SPEC_FORMS, device_count

    if not DEVICE_SPEC.fullmatch(devices.replace(" ", "")):
        raise UsageError(f"--devices {devices!r}: write {SPEC_FORMS}")
    if devices.strip().startswith("emulated"):
        try:
            device_count(devices)
        except ValueError as error:
            raise UsageError(f"--devices: {error}") from None


def _check_finite(o: TrainOptions) -> None:
    """A number option that is NaN or infinite is refused, by name (``--lr inf`` would
    train to NaN losses and exit 0; comparisons with NaN pass every range check)."""
    for field in dataclasses.fields(o):
        value = getattr(o, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag(field.name)} must be a finite number, got {value}")


def _check_mode(o: TrainOptions, given: set[str]) -> None:
    """The options of the other mode (LoRA or ``--full``), given, are refused by name."""
    if o.full:
        lora_given = sorted(k for k in given if k.startswith("lora_") or k in LORA_ONLY)
        if lora_given:
            names = ", ".join(flag(k) for k in lora_given)
            raise UsageError(f"--full trains every weight: it contradicts {names}")
        return
    full_given = sorted(k for k in given if k in FULL_ONLY)
    if full_given:
        names = ", ".join(flag(k) for k in full_given)
        raise UsageError(
            f"{names}: the optimizer of every weight, for --full only (a LoRA adapter is "
            "small: its optimizer keeps fp32)"
        )


def check_dtypes(options: TrainOptions) -> None:
    """The choices that depend on the model's dtype (``--precision``, filled by the
    machine where not given): bf16 masters are the bf16 weights themselves. And that
    the lean optimizer can be built here (torchao installed): ``make_adamw`` itself is
    asked, over one tensor of the masters' dtype."""
    if not options.full or (options.optimizer_states, options.master_weights) == ("fp32", "fp32"):
        return
    if options.master_weights == "bf16" and options.precision != "bf16":
        raise UsageError(
            f"--master-weights bf16 updates the model's own bf16 weights: it needs "
            f"--precision bf16 (this run's is {options.precision}); or keep --master-weights "
            "fp32"
        )
    import torch

    from ..optim import make_adamw

    bf16 = options.master_weights == "bf16"
    probe = torch.zeros(1, dtype=torch.bfloat16 if bf16 else torch.float32)
    try:
        make_adamw([probe], lr=1.0, states=options.optimizer_states, stochastic_round=bf16)
    except (ImportError, ValueError) as error:
        raise UsageError(
            f"--optimizer-states {options.optimizer_states} with --master-weights "
            f"{options.master_weights}: {error}"
        ) from error


def _check_at_least(key: str, value: float | None, least: int) -> None:
    if value is not None and value < least:
        kind = "a positive number" if least == 1 else "zero or more"
        raise UsageError(f"{flag(key)} must be {kind}, got {value}")
