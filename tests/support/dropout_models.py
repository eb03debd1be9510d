"""Dropout that records the masks it draws, and replays them into a reference model:
the oracle of dropout under recompute (``test_model_features.py``, ``test_cuda.py``)."""

from __future__ import annotations

import torch
from torch import nn


class RecordingDropout(nn.Module):
    """Dropout that logs its masks: by phase (no-grad forward vs grad-enabled run)."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.p = p
        self.log: dict[str, list[torch.Tensor]] = {"forward": [], "grad": []}

    def forward(self, x):
        mask = (torch.rand_like(x) > self.p).to(x.dtype) / (1 - self.p)
        self.log["grad" if torch.is_grad_enabled() else "forward"].append(mask)
        return x * mask


class ReplayDropout(nn.Module):
    def __init__(self, masks: list[torch.Tensor]) -> None:
        super().__init__()
        self.masks = list(masks)

    def forward(self, x):
        return x * self.masks.pop(0)


def dropout_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), RecordingDropout(), nn.Linear(16, 16), RecordingDropout(),
        nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4),
    )  # fmt: skip


def collect_logs(wrapped):
    """Masks drawn by the per-device copies of each dropout layer, merged by phase."""
    merged = []
    for index, layer in enumerate(wrapped.runtime.layers):
        if not isinstance(layer.module, RecordingDropout):
            continue
        log = {"forward": [], "grad": []}
        for shell in layer._shells.values():
            for phase in log:
                log[phase] += shell.log[phase]
        merged.append((index, log))
    return merged
