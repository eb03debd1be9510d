"""The DPO and KTO losses of sequence log-probabilities, as TRL's ``DPOTrainer`` and
``KTOTrainer`` (TRL 1.16) compute them: pure functions of tensors, usable with any
source of log-probabilities (``HFRoundPipe.forward_backward_logps`` gives them with
gradients, ``HFRoundPipe.sequence_logps`` a reference's).

A sequence's log-probability is the sum over its completion tokens; a *log-ratio* is the
policy's minus the reference's; a *reward* is ``beta`` times it (detached).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
"""The DPO losses (TRL's ``loss_type`` names); ``label_smoothing`` is robust DPO's."""


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: ``(losses, chosen_rewards, rejected_rewards)``; TRL's loss is
    ``losses.mean()``. ``ipo`` divides each log-ratio by its completion's token count
    (``chosen_lengths``/``rejected_lengths``, required), as TRL does; ``robust`` takes
    ``label_smoothing`` in [0, 0.5), the probability a preference is flipped."""
    check_dpo_options(beta, loss_type, label_smoothing)
    chosen_ratios = chosen_logps - ref_chosen_logps
    rejected_ratios = rejected_logps - ref_rejected_logps
    delta = chosen_ratios - rejected_ratios
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("the IPO loss needs chosen_lengths and rejected_lengths")
        ipo_delta = chosen_ratios / chosen_lengths.clamp(min=1.0) - rejected_ratios / (
            rejected_lengths.clamp(min=1.0)
        )
        losses = (ipo_delta - 1 / (2 * beta)) ** 2
    else:  # robust
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * label_smoothing)
    return losses, beta * chosen_ratios.detach(), beta * rejected_ratios.detach()


def check_dpo_options(beta: float, loss_type: str, label_smoothing: float) -> None:
    """Refuse what TRL would reject or silently ignore, naming the option."""
    _check_beta(beta)
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(DPO_LOSS_TYPES)}, got {loss_type!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing!r}")
    if label_smoothing and loss_type != "robust":
        raise ValueError(
            f"label_smoothing {label_smoothing} is used by the robust DPO loss only "
            f"(TRL ignores it for {loss_type!r}): use the robust loss or leave it 0"
        )


def kto_kl(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's batch KL estimate: the mean log-ratio of the mismatched (prompt, other
    completion) rows, clamped at 0, without gradients (TRL's ``kl``)."""
    return (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example: ``(losses, rewards)``, each example's weighted KTO loss (TRL's loss
    is the mean over the batch's examples) and its reward; ``desirable`` a bool per
    example, ``kl`` :func:`kto_kl` of the batch."""
    check_kto_options(beta, desirable_weight, undesirable_weight)
    ratios = logps - ref_logps
    desirable = desirable.to(torch.bool)
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (ratios - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratios))),
    )
    return losses, beta * ratios.detach()


def check_kto_options(beta: float, desirable_weight: float, undesirable_weight: float) -> None:
    _check_beta(beta)
    for name, value in (
        ("desirable_weight", desirable_weight),
        ("undesirable_weight", undesirable_weight),
    ):
        if not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _check_beta(beta: float) -> None:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 < beta < float("inf"):
        raise ValueError(f"beta must be a positive finite number, got {beta!r}")
