"""Each row's log-probability through a ``from_hf`` pipe, for sequence-level losses.

A row's log-probability is the sum, over its label tokens (labels shifted by one,
``-100`` ignored, as for the model's own loss), of the log-probability the model gives
the label: minus the row's summed cross-entropy, which the head computes per row under
``RoundPipeRunConfig(row_losses=True)`` (:func:`.long_context.chunked_row_losses`).
:func:`sequence_logps` computes them without gradients (a reference model's);
:func:`forward_backward_logps` runs forward and backward of a loss of them, each
microbatch's loss from its own rows, rows kept in groups (a preference pair) so a
group's rows meet in one loss (docs/design.md#preference-tuning).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..core.config import RoundPipeRunConfig

RowLoss = Callable[[torch.Tensor, Any], torch.Tensor]
"""``loss_fn(logps, label)`` of a microbatch's rows (``pipe`` below: an ``HFRoundPipe``)."""


def sequence_logps(pipe: Any, batch: dict, group_rows: int = 1) -> torch.Tensor:
    """Without gradients: each row's summed label-token log-probability (float32, one
    per row of ``batch``, in its order)."""
    rows = batch["input_ids"].shape[0]
    config = _row_config(pipe, None, rows, group_rows)
    with torch.no_grad():
        totals, _ = pipe.runtime.forward((), batch, config)
    return -totals


def forward_backward_logps(
    pipe: Any,
    batch: dict,
    loss_fn: RowLoss,
    label: Any,
    group_rows: int = 1,
    run_config: RoundPipeRunConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward and backward of ``sum over microbatches of loss_fn(logps, label)``:
    ``logps`` the microbatch's rows' log-probabilities (with gradients), ``label`` its
    rows of ``label`` (a tensor, or a dict or tuple of them, rows along dim 0; on the
    device). Returns the loss, every row's log-probability and every row's count of
    label tokens the logits' argmax predicts (no gradients)."""
    rows = batch["input_ids"].shape[0]
    config = _row_config(pipe, run_config, rows, group_rows)
    _check_label_rows(label, rows)

    def row_loss(head: tuple[torch.Tensor, torch.Tensor], rows_label: Any) -> torch.Tensor:
        return loss_fn(-head[0], rows_label)

    loss, (totals, correct) = pipe.runtime.forward_backward(
        (), batch, label, row_loss, True, config
    )
    return loss, -totals, correct


def _row_config(
    pipe: Any, run_config: RoundPipeRunConfig | None, rows: int, group_rows: int
) -> RoundPipeRunConfig:
    if not isinstance(group_rows, int) or group_rows < 1 or rows % group_rows:
        raise ValueError(
            f"the batch's {rows} rows do not fall into groups of {group_rows} "
            "(group_rows: rows that must share a microbatch, e.g. 2 for a preference pair)"
        )
    config = run_config or pipe.run_config
    groups = rows // group_rows
    split = grouped_split(group_rows)
    return replace(
        config,
        num_microbatch=config.microbatches_for(len(pipe.pool), groups),
        row_losses=True,
        scale_grads=False,
        split_input=lambda args, kwargs, num: [((), part) for part in split(kwargs, num)],
        split_label=split,
        merge_output=_rows_of_heads,
    )


def grouped_split(group_rows: int) -> Callable[[Any, int], list]:
    """A split of a tree of tensors (rows along dim 0) into ``num`` parts of whole groups
    of ``group_rows`` rows, as ``torch.tensor_split`` cuts the groups."""

    def split(tree: Any, num: int) -> list:
        rows = _rows(tree)
        parts = torch.tensor_split(torch.arange(rows // group_rows), num)
        bounds = [(int(p[0]) * group_rows, (int(p[-1]) + 1) * group_rows) for p in parts]
        return [tree_map(lambda t, b=b: _cut(t, *b), tree) for b in bounds]

    return split


def _cut(value: Any, start: int, stop: int) -> Any:
    return value[start:stop] if isinstance(value, torch.Tensor) and value.dim() else value


def _rows(tree: Any) -> int:
    leaves = [t for t in _leaves(tree) if t.dim()]
    if not leaves:
        raise ValueError("the label holds no tensor with rows along dim 0")
    return leaves[0].shape[0]


def _leaves(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda t: found.append(t) if isinstance(t, torch.Tensor) else None, tree)
    return found


def _check_label_rows(label: Any, rows: int) -> None:
    for tensor in _leaves(label):
        if tensor.dim() and tensor.shape[0] != rows:
            raise ValueError(
                f"every tensor of the label needs the batch's {rows} rows along dim 0, "
                f"got shape {tuple(tensor.shape)}"
            )


def _rows_of_heads(heads: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row head outputs of the microbatches, in row order."""
    totals = torch.cat([total.detach().float().reshape(-1) for total, _ in heads])
    correct = torch.cat([right.reshape(-1) for _, right in heads])
    return totals, correct
