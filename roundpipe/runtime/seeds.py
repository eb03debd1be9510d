"""The random seeds layers draw from: one per call, derived per microbatch and layer.

A layer run for microbatch ``m`` of a call draws from a generator seeded with
``layer_seed(call_seed, m, layer)``, on whichever device runs it, so a run's random
numbers (dropout masks) depend on the seed, the call and the layer only: not on the
plan, the device, or the order threads reach the generators in; a recompute derives
the forward's seed again (docs/design.md#random-numbers).
"""

from __future__ import annotations

import torch

_MASK = 2**64 - 1


def derive(*values: int) -> int:
    """A 63-bit seed mixed from ``values`` (splitmix64 steps: neighbouring inputs give
    unrelated seeds, the same inputs the same seed on every platform)."""
    x = 0x9E3779B97F4A7C15
    for value in values:
        x = (x ^ (value & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
        x ^= x >> 31
    return x >> 1


def microbatch_seed(call_seed: int, m: int, redraw: bool = False) -> int:
    """The seed of microbatch ``m``'s layers; ``redraw``: a recompute that does not
    preserve the forward's random numbers (``preserve_rng_state=False``) draws anew."""
    return derive(call_seed, m, 1) if redraw else derive(call_seed, m)


def layer_seed(microbatch: int, layer: int) -> int:
    """The seed layer ``layer`` draws from, given its microbatch's seed."""
    return derive(microbatch, layer)


class CallSeeds:
    """A model's seed and its count of calls; each call draws from the next call seed.

    The seed is ``torch.initial_seed()`` when the model is wrapped (what the last
    ``torch.manual_seed`` set), so seeding before wrapping makes runs reproducible;
    checkpoints save and restore both numbers (:meth:`state`, :meth:`load`)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed & (2**63 - 1)
        self.calls = 0

    def next_call(self) -> int:
        """The seed of the next call."""
        seed = derive(self.seed, self.calls)
        self.calls += 1
        return seed

    def state(self) -> torch.Tensor:
        return torch.tensor([self.seed, self.calls], dtype=torch.int64)

    def load(self, state: torch.Tensor) -> None:
        self.seed, self.calls = (int(v) for v in state.tolist())
