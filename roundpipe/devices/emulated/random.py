"""Seeded random numbers for emulated devices, which share torch's one CPU generator.

A GPU has its own generator; emulated devices all draw from the process's CPU
generator, from their executor threads at once. A layer that draws runs holding a
process-wide lock with the generator seeded for it (and put back after), so no other
thread draws in between; a layer that draws nothing takes no lock, so compute of
models without dropout is not serialised. Which layers draw is learned: a layer's
first run in each combination of training flags routes every random operator to a
generator of its own (a dispatch mode, thread-local) and notes whether any drew
(docs/design.md#random-numbers).

On CUDA a dropout mask depends on the launch grid, so on the GPU model: the same seed
draws other masks on another kind of card. Emulated devices model that: a device whose
class is not the default one (speed 1.0) draws from ``class_seed(seed, its class)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

_CPU_RNG_LOCK = threading.Lock()
"""Held while a layer draws from the CPU generator: one generator, so one lock for all
emulated devices and pools."""

_learned_lock = threading.Lock()
_draws: weakref.WeakKeyDictionary[nn.Module, dict[tuple[bool, ...], bool]] = (
    weakref.WeakKeyDictionary()
)
"""Per layer shell: whether a run with these training flags drew random numbers.
A shell is made again when its module changes (``Dropout.p`` set), so it is learned anew."""


def class_seed(seed: int, device_class: str) -> int:
    """The seed a device of class ``device_class`` draws from where another class would
    draw from ``seed``: a 63-bit mix of both, the same on every platform and run."""
    digest = hashlib.blake2b(f"{seed}@{device_class}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextlib.contextmanager
def seeded(seed: int, module: nn.Module) -> Iterator[None]:
    """Run ``module``'s layer drawing as after ``torch.manual_seed(seed)``."""
    flags = tuple(m.training for m in module.modules())
    with _learned_lock:
        draws = _draws.get(module, {}).get(flags)
    if draws is False:
        yield
        return
    if draws is None:
        detector = _RoutedDraws(seed)
        with detector:
            yield
        with _learned_lock:
            _draws.setdefault(module, {})[flags] = detector.drew
        return
    with _CPU_RNG_LOCK:
        state = torch.get_rng_state()
        torch.default_generator.manual_seed(seed)  # torch.manual_seed also visits other backends
        try:
            yield
        finally:
            torch.set_rng_state(state)


class _RoutedDraws(TorchDispatchMode):
    """Runs every random operator (ATen tags them ``nondeterministic_seeded``) on a
    generator state of its own, swapped into the CPU generator under the lock for just
    that operator, and notes that one ran; other operators run as they are."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.state = torch.Generator().manual_seed(seed).get_state()
        self.drew = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **(kwargs or {}))
        self.drew = True
        with _CPU_RNG_LOCK:
            outside = torch.get_rng_state()
            torch.set_rng_state(self.state)
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.state = torch.get_rng_state()
                torch.set_rng_state(outside)
