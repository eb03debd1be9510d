"""Randomised cost profiles the planner is judged on (tests and ``bench/planner.py``).

The planner's target workloads: 24–96 transformer layers (each within ±20% of a mean
forward time), backward 1.5–4× forward, an LM head of 1–4 layers' time, an activation
hop of 0–20% of a layer, 4 or 8 devices, 8–32 microbatches per call (one round). A
layer's weights take 10–60% of the time one job spends on it to upload, so uploads can
hide behind compute, as they must on real PCIe links.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .costs import CostModel, LayerCosts

LINK_BYTES_PER_S = 1e9


@dataclass(frozen=True)
class Profile:
    seed: int
    costs: CostModel
    num_devices: int
    num_microbatches: int


def random_profile(seed: int, layers: tuple[int, int] = (24, 96)) -> Profile:
    rng = random.Random(seed)
    n = rng.randint(*layers)
    devices, micro = rng.choice([4, 8]), rng.randint(8, 32)
    forward = [rng.uniform(0.8, 1.2) * 1e-3 for _ in range(n)]
    mean = sum(forward) / n
    ratio = rng.uniform(1.5, 4)
    head = rng.uniform(1, 4) * mean
    upload = rng.uniform(0.1, 0.6) * mean * micro
    layer_bytes = int(upload * LINK_BYTES_PER_S)
    costs = CostModel(
        LayerCosts(
            (*forward, head),
            (*[f * ratio for f in forward], head * ratio),
            (*[layer_bytes] * n, 2 * layer_bytes),
        ),
        comm=rng.uniform(0, 0.2) * mean,
        h2d_bandwidth=LINK_BYTES_PER_S,
        d2h_bandwidth=LINK_BYTES_PER_S,
    )
    return Profile(seed, costs, devices, micro)
