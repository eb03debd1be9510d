"""One DPO or KTO forward-backward through a ``from_hf`` pipe, and its metrics under
TRL's names.

A DPO batch holds its pairs in adjacent rows, ``[chosen_0, rejected_0, chosen_1, ...]``
(``labels`` ``-100`` outside the completions), so a pair's rows share a microbatch and
each microbatch's loss is its pairs' share of the batch's mean. A KTO batch holds one
completion per row, ``desirable`` per row, and the rows of the KL estimate
(``kl_input_ids``, ``kl_attention_mask``, ``kl_labels``: each prompt with another row's
completion). The reference's log-probabilities are given (precomputed, a full
fine-tune's) or computed by the pipe itself with its adapters off (a LoRA policy's:
:func:`.reference.reference_logps`). A step whose loss or reference is not finite is
refused before the weights change (:class:`NonFiniteStep`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..hf.decoder import IGNORE_INDEX
from .losses import check_dpo_options, check_kto_options, dpo_loss, kto_kl, kto_loss
from .reference import reference_logps

MAIN_INPUTS = ("input_ids", "attention_mask", "labels")
KL_INPUTS = {"kl_input_ids": "input_ids", "kl_attention_mask": "attention_mask",
             "kl_labels": "labels"}  # fmt: skip


Gather = Callable[[torch.Tensor], torch.Tensor]
"""On several processes (data parallel): a per-row tensor of this process's rows
concatenated with every process's, in rank order (the global batch's rows)."""


class NonFiniteStep(ValueError):
    """A step's loss or reference log-probabilities are NaN or infinite: its gradients
    must not reach the weights (the caller drops them instead of stepping)."""


def dpo_forward_backward(
    pipe,
    batch: dict,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    run_config=None,
    batch_pairs: int | None = None,
    gather: Gather | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The DPO loss of ``batch`` (the mean over its pairs), its gradients accumulated,
    and the metrics TRL's ``DPOTrainer`` logs with it (:func:`dpo_metrics`).
    ``ref_logps``: the reference's log-probability of each row (else the pipe's with its
    adapters off). On several processes, each passes its share of the global batch,
    ``batch_pairs`` the global batch's pairs (the loss is their mean) and ``gather``
    (the metrics are the global batch's)."""
    check_dpo_options(beta, loss_type, label_smoothing)
    main = main_rows(batch)
    rows = main["input_ids"].shape[0]
    if rows % 2:
        raise ValueError(f"a DPO batch holds pairs of rows, got {rows} rows")
    lengths = _label_rows(main["labels"])
    ref = _reference(pipe, main, ref_logps)
    pairs = batch_pairs or rows // 2

    def pair_losses(logps: torch.Tensor, label: dict) -> torch.Tensor:
        losses, _, _ = dpo_loss(
            logps[0::2], logps[1::2], label["ref"][0::2], label["ref"][1::2],
            beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
            chosen_lengths=label["lengths"][0::2], rejected_lengths=label["lengths"][1::2],
        )  # fmt: skip
        return losses.sum() / pairs

    label = {"ref": ref, "lengths": lengths}
    loss, logps, correct = pipe.forward_backward_logps(
        main, pair_losses, label, group_rows=2, run_config=run_config
    )
    _check_finite(loss, "DPO loss")
    tokens = (main["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1)
    logps, ref, correct, tokens = _gathered(gather, logps, ref, correct, tokens)
    return loss, dpo_metrics(logps, ref, beta, correct, tokens)


def dpo_metrics(
    logps: torch.Tensor, ref: torch.Tensor, beta: float, correct=None, label_tokens=None
) -> dict[str, float]:
    """TRL's DPO metrics of a batch's rows (pairs adjacent): ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
    ``logps/rejected``, and with each row's ``correct`` and ``label_tokens`` (counts
    after the shift) the chosen rows' ``mean_token_accuracy``."""
    chosen, rejected = logps[0::2], logps[1::2]
    chosen_rewards = beta * (chosen - ref[0::2])
    rejected_rewards = beta * (rejected - ref[1::2])
    metrics = {
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
        "logps/chosen": chosen.mean().item(),
        "logps/rejected": rejected.mean().item(),
    }
    if correct is not None and label_tokens is not None:
        tokens = label_tokens[0::2].sum()
        right = correct[0::2].sum()
        metrics["mean_token_accuracy"] = (right / tokens).item() if tokens else 0.0
    return metrics


def kto_forward_backward(
    pipe,
    batch: dict,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    ref_logps: torch.Tensor | None = None,
    ref_kl_logps: torch.Tensor | None = None,
    run_config=None,
    batch_rows: int | None = None,
    gather: Gather | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The KTO loss of ``batch`` (the mean over its rows), its gradients accumulated, and
    the metrics TRL's ``KTOTrainer`` logs with it (:func:`kto_metrics`). On several
    processes, each passes its share of the global batch, ``batch_rows`` the global
    batch's rows and ``gather``: the KL estimate is the mean of the processes' (as TRL
    gathers it), the metrics the global batch's."""
    check_kto_options(beta, desirable_weight, undesirable_weight)
    main, kl_rows = main_rows(batch), kl_rows_of(batch)
    desirable = batch["desirable"].to(torch.bool)
    rows = main["input_ids"].shape[0]
    _label_rows(main["labels"])
    _label_rows(kl_rows["labels"])
    kl_logps = pipe.sequence_logps(kl_rows)  # the policy's, before its update
    ref = _reference(pipe, main, ref_logps)
    ref_kl = _reference(pipe, kl_rows, ref_kl_logps)
    kl = kto_kl(kl_logps, ref_kl)
    if gather is not None:  # TRL: each process's mean, gathered, averaged, clamped
        kl = gather((kl_logps - ref_kl).mean().reshape(1)).mean().clamp(min=0)

    def row_losses(logps: torch.Tensor, label: dict) -> torch.Tensor:
        losses, _ = kto_loss(
            logps, label["ref"], label["desirable"], kl.to(logps.device),
            beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
        )  # fmt: skip
        return losses.sum() / (batch_rows or rows)

    label = {"ref": ref, "desirable": desirable}
    loss, logps, _ = pipe.forward_backward_logps(main, row_losses, label, run_config=run_config)
    _check_finite(loss, "KTO loss")
    logps, ref, desirable = _gathered(gather, logps, ref, desirable)
    return loss, kto_metrics(logps, ref, desirable, kl, beta)


def kto_metrics(
    logps: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, beta: float
) -> dict[str, float]:
    """TRL's KTO metrics: ``kl``, and where the batch has such rows ``rewards/chosen``,
    ``logps/chosen`` (desirable rows), ``rewards/rejected``, ``logps/rejected``, and with
    both ``rewards/margins``."""
    rewards = beta * (logps - ref)
    metrics = {"kl": kl.item()}
    for name, rows in (("chosen", desirable), ("rejected", ~desirable)):
        count = int(rows.sum())
        if count:
            metrics[f"rewards/{name}"] = rewards[rows].nansum().item() / count
            metrics[f"logps/{name}"] = logps[rows].nansum().item() / count
    if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return metrics


def _gathered(gather: Gather | None, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if gather is None else gather(t) for t in tensors]


def main_rows(batch: dict) -> dict:
    """The policy's rows of a preference batch: ``input_ids``, ``attention_mask``, ``labels``."""
    missing = [k for k in ("input_ids", "labels") if k not in batch]
    if missing:
        raise ValueError(f"the batch needs {', '.join(missing)}")
    return {k: batch[k] for k in MAIN_INPUTS if k in batch}


def kl_rows_of(batch: dict) -> dict:
    """A KTO batch's KL rows (``kl_input_ids``...) under the policy's names."""
    missing = [k for k in ("kl_input_ids", "kl_labels", "desirable") if k not in batch]
    if missing:
        raise ValueError(f"a KTO batch needs {', '.join(missing)} (the KL rows, each row's label)")
    return {ours: batch[k] for k, ours in KL_INPUTS.items() if k in batch}


def _label_rows(labels: torch.Tensor) -> torch.Tensor:
    """Each row's completion tokens (labels not ``-100``, unshifted, as TRL counts them
    for IPO); a row with none after the shift is refused (its log-probability would be
    0 and its reward meaningless)."""
    empty = ((labels[:, 1:] != IGNORE_INDEX).sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"rows {empty} of the batch have no completion token to score (all truncated?): "
            "every row needs a label token after its first position"
        )
    return completion_lengths(labels)


def completion_lengths(labels: torch.Tensor) -> torch.Tensor:
    """Each row's completion tokens: labels not ``-100``, unshifted (TRL's IPO divisor)."""
    return (labels != IGNORE_INDEX).sum(dim=1).float()


def _reference(pipe, rows: dict, given: torch.Tensor | None) -> torch.Tensor:
    ref = reference_logps(pipe, rows) if given is None else given.detach().float().cpu()
    if ref.shape != (rows["input_ids"].shape[0],):
        raise ValueError(
            f"the reference log-probabilities need one per row ({rows['input_ids'].shape[0]}), "
            f"got shape {tuple(ref.shape)}"
        )
    if not bool(torch.isfinite(ref).all()):
        raise NonFiniteStep("the reference log-probabilities are not finite (NaN or inf)")
    return ref


def _check_finite(loss: torch.Tensor, what: str) -> None:
    value = float(loss)
    if not math.isfinite(value):
        raise NonFiniteStep(f"the {what} is {value}: the step's gradients must not be applied")
