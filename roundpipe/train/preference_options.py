"""The options of ``roundpipe train --method dpo|kto`` (TRL's names: ``beta``,
``loss_type``, ``label_smoothing``, ``desirable_weight``, ``undesirable_weight``) and
their checks (docs/cli.md#preference-tuning)."""

from __future__ import annotations

from typing import Any

from ..preference.losses import DPO_LOSS_TYPES, check_dpo_options, check_kto_options
from .aliases import flag
from .usage import UsageError

METHODS = ("sft", "dpo", "kto")
DPO_ONLY = ("loss_type", "label_smoothing")
KTO_ONLY = ("desirable_weight", "undesirable_weight")
PREFERENCE_ONLY = ("beta", "precompute_ref_log_probs", *DPO_ONLY, *KTO_ONLY)
"""Options of a preference method: an SFT run's record leaves them out."""
PREFERENCE_GROUP = "preference tuning (--method dpo, kto)"


def preference_options(option: Any) -> tuple:
    """The rows of :data:`roundpipe.train.options.OPTIONS` for preference tuning, made
    with its ``Option`` class (passed in: that module imports this one)."""
    group = PREFERENCE_GROUP
    return (
        option(
            "method", str, "sft",
            "sft (supervised), dpo (preference pairs) or kto (desirable/undesirable examples)",
            group, METHODS,
        ),
        option("beta", float, 0.1, "DPO/KTO: how far from the reference the policy may go", group),
        option(
            "loss-type", str, "sigmoid", "DPO's loss (TRL's loss_type)", group, DPO_LOSS_TYPES
        ),
        option(
            "label-smoothing", float, 0.0,
            "DPO, --loss-type robust: the probability a preference is flipped, in [0, 0.5)",
            group,
        ),
        option(
            "precompute-ref-log-probs", None, False,
            "LoRA: the reference's log-probabilities of every example in one pass before the "
            "first step, not each step's (a full fine-tune always precomputes them)", group,
        ),
        option("desirable-weight", float, 1.0, "KTO: the weight of desirable examples", group),
        option("undesirable-weight", float, 1.0, "KTO: the weight of undesirable ones", group),
    )  # fmt: skip


def check_preference(o: Any, given: set[str]) -> None:
    """The method's options: another method's, given, are refused by name; values as
    TRL would take them, else refused naming the option."""
    if o.method not in METHODS:
        raise UsageError(f"--method must be one of {', '.join(METHODS)}, got {o.method!r}")
    other = {"sft": PREFERENCE_ONLY, "dpo": KTO_ONLY, "kto": DPO_ONLY}[o.method]
    wrong = sorted(k for k in given if k in other)
    if wrong:
        raise UsageError(
            f"{', '.join(flag(k) for k in wrong)}: not an option of --method {o.method}"
        )
    if o.method == "sft":
        return
    for key in ("packing", "train_on_prompt"):
        if getattr(o, key):
            raise UsageError(
                f"{flag(key)} is an SFT option: --method {o.method} scores completions"
            )
    try:
        if o.method == "dpo":
            check_dpo_options(o.beta, o.loss_type, o.label_smoothing)
        else:
            check_kto_options(o.beta, o.desirable_weight, o.undesirable_weight)
    except ValueError as error:
        key = str(error).split(" ", 1)[0]
        raise UsageError(f"{flag(key)}{str(error)[len(key) :]}") from None


def record_without(o: Any, record: dict) -> dict:
    """``record`` (a run record) without the options the run's method does not use."""
    other = {"sft": PREFERENCE_ONLY, "dpo": KTO_ONLY, "kto": DPO_ONLY}[o.method]
    skip = (*other, "method") if o.method == "sft" else other
    return {k: v for k, v in record.items() if k not in skip}
