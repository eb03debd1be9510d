"""What a call's jobs hand to each other, named (the keys of a call's ``Mailbox``).

Each key is a value of its own type, so two kinds of handoff can never be confused
(``Activation(3, 0)`` is not ``InputGrad(3, 0)``), and every key is derived from the
schedule: the layer whose input or input gradient it is, and the microbatch.
"""

from __future__ import annotations

import re
from dataclasses import astuple, dataclass


@dataclass(frozen=True, slots=True)
class Activation:
    """The input of ``layer`` for ``microbatch``, in host memory (``layer`` = the number
    of layers: the model's output)."""

    layer: int
    microbatch: int


@dataclass(frozen=True, slots=True)
class InputGrad:
    """The gradient with respect to the input of ``layer`` (the model's output for
    ``layer`` = the number of layers, from a deferred ``.backward()``)."""

    layer: int
    microbatch: int


@dataclass(frozen=True, slots=True)
class RngState:
    """The RNG state the forward drew from when it ran ``layer``."""

    layer: int
    microbatch: int


@dataclass(frozen=True, slots=True)
class Loss:
    microbatch: int


@dataclass(frozen=True, slots=True)
class Output:
    microbatch: int


HandoffKey = Activation | InputGrad | RngState | Loss | Output


def key_label(key: HandoffKey) -> str:
    """A handoff in words, for op labels and errors: ``act 3``, ``grad``, ``loss``, ``output``."""
    if isinstance(key, Activation):
        return f"act {key.layer}"
    if isinstance(key, InputGrad):
        return "grad"
    return type(key).__name__.lower()


def key_repr(key: HandoffKey) -> str:
    """A handoff as printed op programs show it: ``Activation(3,0)``."""
    return f"{type(key).__name__}({','.join(str(v) for v in astuple(key))})"


_KEY_TYPES = {kind.__name__: kind for kind in (Activation, InputGrad, RngState, Loss, Output)}


def parse_keys(text: str) -> list[HandoffKey]:
    """The handoffs ``text`` prints (``key_repr``, comma separated): ``Activation(3,0),Loss(0)``."""
    keys: list[HandoffKey] = []
    for match in re.finditer(r"(\w+)\(([\d,]*)\)", text):
        name, fields = match.groups()
        if name not in _KEY_TYPES:
            raise ValueError(f"unknown handoff {name!r}: the handoffs are {', '.join(_KEY_TYPES)}")
        keys.append(_KEY_TYPES[name](*(int(v) for v in fields.split(","))))
    return keys
