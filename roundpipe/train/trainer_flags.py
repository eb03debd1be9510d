"""Trainer's and TRL's options whose values translate into ours instead of carrying
over: switches that set one of our options (``--bf16``: ``--precision bf16``,
``--use_peft``: LoRA, ``--load_in_4bit``: ``--quantize nf4``), values spelled otherwise
(``--optim``, ``--dtype``, ``--lr_scheduler_type``), ``--max_steps`` and
``--num_train_epochs`` read as ``Trainer`` reads them, and names accepted that change
nothing here, each with a note saying why. :func:`translate` turns what one layer (the
command line or a ``--config`` file) gave into our options; a value we cannot honour is
a :class:`UsageError` naming it (docs/cli.md#coming-from-trainer--trl)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .aliases import flag
from .usage import UsageError

TRUE_WORDS, FALSE_WORDS = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")
"""The words ``HfArgumentParser`` reads as a boolean (any case)."""
OPTIMIZERS = {
    "adamw_torch": "fp32", "adamw_torch_fused": "fp32", "paged_adamw_32bit": "fp32",
    "adamw_torch_8bit": "int8", "adamw_bnb_8bit": "int8", "adamw_8bit": "int8",
    "paged_adamw_8bit": "int8",
}  # fmt: skip
"""``--optim`` -> ``--optimizer-states``: AdamW with 32-bit states, or block-wise 8-bit."""
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32",
          "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}  # fmt: skip
SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant",
             "constant_with_warmup": "constant"}  # fmt: skip
RECOMPUTES = (
    "roundpipe always recomputes activations layer by layer in the backward pass (the "
    "stateless GPUs keep no activations between passes; docs/design.md#recompute)"
)


def truth(text: str | bool) -> bool:
    """A boolean as ``HfArgumentParser`` reads one (``--bf16 true``, ``--bf16 0``)."""
    if isinstance(text, bool):
        return text
    if text.lower() in TRUE_WORDS + FALSE_WORDS:
        return text.lower() in TRUE_WORDS
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def checkpoint_or_truth(text: str | bool) -> bool | str:
    """``--resume_from_checkpoint``: true, false, or a checkpoint directory."""
    if isinstance(text, bool) or text.lower() in TRUE_WORDS + FALSE_WORDS:
        return truth(text)
    return text


@dataclass(frozen=True)
class TrainerFlag:
    """A Trainer or TRL option: ``--name`` on the command line and ``name`` in YAML;
    ``parse`` reads its text; a ``switch`` given alone means true (``--bf16``)."""

    name: str
    parse: Callable[[str], Any]
    help: str
    switch: bool = False
    metavar: str | None = None


FLAGS = (
    TrainerFlag("bf16", truth, "--precision bf16 (false: fp32 unless --fp16)", True),
    TrainerFlag("fp16", truth, "--precision fp16 (false: fp32 unless --bf16)", True),
    TrainerFlag(
        "dtype",
        str,
        "bfloat16, float16 or float32: --precision (a true --bf16 or --fp16 wins: the "
        "dtype the weights compute in)",
        metavar="DTYPE",
    ),  # fmt: skip
    TrainerFlag("torch_dtype", str, "as --dtype", metavar="DTYPE"),
    TrainerFlag("use_peft", truth, "LoRA, the default (false: --full)", True),
    TrainerFlag("load_in_4bit", truth, "--quantize nf4 (QLoRA)", True),
    TrainerFlag(
        "assistant_only_loss",
        truth,
        "the loss on assistant turns only, the default "
        "(false needs --completion_only_loss false: one switch, --train-on-prompt)",
        True,
    ),  # fmt: skip
    TrainerFlag(
        "completion_only_loss",
        truth,
        "the loss on completions only, the default (false: --train-on-prompt)",
        True,
    ),  # fmt: skip
    TrainerFlag("gradient_checkpointing", truth, f"accepted, changes nothing: {RECOMPUTES}", True),
    TrainerFlag(
        "logging_steps", float, "accepted, changes nothing: every step is logged", metavar="N"
    ),  # fmt: skip
    TrainerFlag("resume_from_checkpoint", checkpoint_or_truth, "--resume [DIR]", True, "DIR"),
    TrainerFlag(
        "optim",
        str,
        f"AdamW: {', '.join(OPTIMIZERS)} (8-bit: --optimizer-states int8 with --full)",
        metavar="NAME",
    ),  # fmt: skip
    TrainerFlag(
        "max_steps",
        int,
        "--steps; -1 (or 0): train --epochs, as Trainer does; wins over --num_train_epochs",
        metavar="N",
    ),  # fmt: skip
    TrainerFlag("num_train_epochs", float, "--epochs", metavar="E"),
    TrainerFlag("lr_scheduler_type", str, f"--schedule: {', '.join(SCHEDULES)}", metavar="NAME"),
)
BY_NAME = {f.name: f for f in FLAGS}


class _Layer:
    """Our options as one layer gives them, each remembered with the flag that set it,
    so that two flags setting one option differently are refused by name."""

    def __init__(self, ours: Mapping[str, Any]) -> None:
        self.values = dict(ours)
        self.set_by = {key: _means(key, value) for key, value in ours.items()}
        self.notes: list[str] = []

    def put(self, key: str, value: Any, spelled: str) -> None:
        if key in self.values and self.values[key] != value:
            raise UsageError(
                f"{spelled} means {_means(key, value)}, {self.set_by[key]} says otherwise: "
                "give one of them"
            )
        self.values[key] = value
        self.set_by[key] = spelled


def translate(layer: Mapping[str, Any], full: bool) -> tuple[dict[str, Any], list[str]]:
    """One layer's options by our keys (``layer`` holds ours and :data:`FLAGS`' names,
    parsed), and a note for each Trainer name that changes nothing here. ``full``: the
    run trains every weight (``--optim``'s 8-bit states are ``--full``'s)."""
    theirs = {k: v for k, v in layer.items() if k in BY_NAME and v is not None}
    out = _Layer({k: v for k, v in layer.items() if k not in BY_NAME and v is not None})
    _precision(out, theirs)
    if "use_peft" in theirs:
        out.put("full", not theirs["use_peft"], _spelled("use_peft", theirs))
    if theirs.get("load_in_4bit"):
        out.put("quantize", "nf4", "--load_in_4bit")
    _loss(out, theirs)
    if "gradient_checkpointing" in theirs:
        out.notes.append(f"--gradient_checkpointing: changes nothing here: {RECOMPUTES}")
    if "logging_steps" in theirs:
        steps = f"{theirs['logging_steps']:g}"
        out.notes.append(f"--logging_steps {steps}: changes nothing here: every step is "
                         "logged to metrics.jsonl (and --report-to)")  # fmt: skip
    if "resume_from_checkpoint" in theirs:
        resume = theirs["resume_from_checkpoint"]
        out.put("resume", resume, _spelled("resume_from_checkpoint", theirs))
    if "optim" in theirs:
        _optimizer(out, theirs["optim"], full)
    _length(out, theirs)
    if "lr_scheduler_type" in theirs:
        name = theirs["lr_scheduler_type"]
        if name not in SCHEDULES:
            raise UsageError(f"--lr_scheduler_type {name}: use {', '.join(SCHEDULES)}")
        out.put("schedule", SCHEDULES[name], f"--lr_scheduler_type {name}")
    return out.values, out.notes


def trains_every_weight(*layers: Mapping[str, Any]) -> bool:
    """``--full`` (or TRL's ``use_peft: false``) in the first of ``layers`` that says."""
    for layer in layers:
        if layer.get("full") is not None:
            return bool(layer["full"])
        if layer.get("use_peft") is not None:
            return not layer["use_peft"]
    return False


def _precision(out: _Layer, theirs: dict[str, Any]) -> None:
    """``--bf16``/``--fp16`` (a true one wins over ``--dtype``: our ``--precision`` is
    the dtype the weights compute in, TRL's mixed precision; the optimizer's masters stay
    fp32), else ``--dtype``/``--torch_dtype``, else fp32 for a false switch."""
    bf16, fp16 = theirs.get("bf16"), theirs.get("fp16")
    if bf16 and fp16:
        raise UsageError("--bf16 and --fp16: give one of them")
    if bf16 or fp16:
        out.put("precision", "bf16" if bf16 else "fp16", "--bf16" if bf16 else "--fp16")
        return
    for name in ("dtype", "torch_dtype"):
        if name in theirs:
            given = theirs[name]
            if given not in DTYPES:
                raise UsageError(
                    f"--{name} {given}: use bfloat16, float16 or float32 (--precision; "
                    "without it bf16 on CUDA, fp32 else)"
                )
            out.put("precision", DTYPES[given], f"--{name} {given}")
            return
    for name in ("bf16", "fp16"):
        if name in theirs:  # false
            out.put("precision", "fp32", f"--{name} false")


def _loss(out: _Layer, theirs: dict[str, Any]) -> None:
    """TRL's two loss switches on our one, ``--train-on-prompt``: assistant turns and
    completions only (our default), or every token of both."""
    assistant, completion = theirs.get("assistant_only_loss"), theirs.get("completion_only_loss")
    if assistant is False and completion is not False:
        raise UsageError(
            "--assistant_only_loss false (every token of a conversation) while completions "
            "alone are learnt: roundpipe has one switch for both formats, --train-on-prompt "
            "(or --completion_only_loss false with it)"
        )
    if assistant and completion is False:
        raise UsageError(
            "--assistant_only_loss with --completion_only_loss false: roundpipe has one "
            "switch for both formats, --train-on-prompt; give one of them"
        )
    for name in ("assistant_only_loss", "completion_only_loss"):
        if name in theirs:
            out.put("train_on_prompt", not theirs[name], _spelled(name, theirs))


def _optimizer(out: _Layer, name: str, full: bool) -> None:
    if name not in OPTIMIZERS:
        raise UsageError(
            f"--optim {name}: not an optimizer roundpipe has; use {', '.join(OPTIMIZERS)} "
            "(AdamW, its states in 32 or 8 bits)"
        )
    if full:
        out.put("optimizer_states", OPTIMIZERS[name], f"--optim {name}")
    elif OPTIMIZERS[name] == "int8":
        out.notes.append(
            f"--optim {name}: a LoRA adapter's AdamW keeps its (small) states in fp32 here; "
            "8-bit states are --full's (--optimizer-states int8)"
        )


def _length(out: _Layer, theirs: dict[str, Any]) -> None:
    """As ``Trainer``: a positive ``--max_steps`` wins over the epochs; otherwise the
    epochs count. (Our own ``--steps`` with ``--epochs`` stays a contradiction.)"""
    if "num_train_epochs" in theirs:
        out.put("epochs", _whole(theirs["num_train_epochs"]), "--num_train_epochs")
    steps = theirs.get("max_steps")
    if steps is not None and steps > 0:
        out.put("steps", steps, f"--max_steps {steps}")
    trainer_length = "num_train_epochs" in theirs or (steps is not None and steps > 0)
    if trainer_length and "steps" in out.values:
        out.values.pop("epochs", None)


def _whole(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _spelled(name: str, theirs: dict[str, Any]) -> str:
    value = theirs[name]
    return f"--{name}" + ("" if value is True else f" {'false' if value is False else value}")


def _means(key: str, value: Any) -> str:
    if value is True:
        return flag(key)
    if value is False:
        return f"no {flag(key)}"
    return f"{flag(key)} {value}"
