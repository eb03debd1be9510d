"""Preference tuning: DPO and KTO on the same stateless pool, as TRL computes them.

- ``dpo_loss``, ``kto_loss``, ``kto_kl``: the losses of sequence log-probabilities
  (pure tensor functions, TRL's formulas; :mod:`.losses`).
- ``dpo_forward_backward``, ``kto_forward_backward``: one step's loss, gradients and
  TRL's metrics through a ``from_hf`` pipe (:mod:`.steps`).
- ``adapters_off``, ``reference_logps``: a LoRA policy's reference, the same pipe with
  its adapters off (:mod:`.reference`).

docs/python-api.md#preference-tuning.
"""

from .losses import DPO_LOSS_TYPES, dpo_loss, kto_kl, kto_loss
from .reference import adapters_off, is_lora_pipe, reference_logps
from .steps import (
    NonFiniteStep,
    completion_lengths,
    dpo_forward_backward,
    dpo_metrics,
    kl_rows_of,
    kto_forward_backward,
    kto_metrics,
    main_rows,
)

__all__ = [
    "DPO_LOSS_TYPES",
    "NonFiniteStep",
    "adapters_off",
    "completion_lengths",
    "dpo_forward_backward",
    "dpo_loss",
    "dpo_metrics",
    "is_lora_pipe",
    "kto_forward_backward",
    "kto_kl",
    "kto_loss",
    "kl_rows_of",
    "kto_metrics",
    "main_rows",
    "reference_logps",
]
