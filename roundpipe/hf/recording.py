"""Recording the arguments of each decoder layer, and carrying them between stages.

While the general path's prologue runs the model's own decoder ``forward``, its layers
are :class:`LayerStub` modules that record how each is called (:func:`recording`); the
calls become a :class:`Carried` value, which the pipeline moves between stages as it
moves any dataclass of tensors (docs/design.md#the-general-decoder-path).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .structure import UnsupportedModel

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
_local = threading.local()


class LayerStub(nn.Module):
    """Stands in for decoder layer ``index`` while the prologue runs: records its call and
    returns the hidden state (as a one-tuple that is also usable as the tensor's holder,
    for decoders that index the layer's output)."""

    def __init__(self, layer: nn.Module, index: int) -> None:
        super().__init__()
        self.index = index
        for name, value in vars(layer).items():  # e.g. attention_type, layer_type, is_sliding
            if not name.startswith("_") and isinstance(value, _PLAIN) and name != "training":
                setattr(self, name, value)

    def forward(self, *args, **kwargs):
        return _recorder().layer(self.index, args, kwargs)


class NormStub(nn.Module):
    def forward(self, hidden):
        return _recorder().norm(hidden)


class Passed(tuple):
    """What a layer stub returns: ``(hidden,)``, so ``output[0]`` is the hidden state."""


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []
        self.returned: list[Passed] = []
        self.norm_input = None
        self.norm_output = None

    def layer(self, index: int, args: tuple, kwargs: dict) -> Passed:
        if index != len(self.calls):
            raise UnsupportedModel(f"the decoder called layer {index} out of order")
        self.calls.append((args, kwargs))
        hidden = args[0] if args else kwargs.get("hidden_states")
        hidden = hidden[0] if isinstance(hidden, Passed) else hidden
        passed = Passed((hidden,))
        self.returned.append(passed)
        return passed

    def norm(self, hidden):
        self.norm_input = hidden
        self.norm_output = hidden[0] if isinstance(hidden, Passed) else hidden
        return self.norm_output


def _recorder() -> Recorder:
    recorder = getattr(_local, "recorder", None)
    if recorder is None:
        raise RuntimeError("a roundpipe layer stub ran outside its prologue")
    return recorder


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    outer = getattr(_local, "recorder", None)
    _local.recorder = Recorder()
    try:
        yield _local.recorder
    finally:
        _local.recorder = outer


# -- what travels between stages -------------------------------------------------------------


@dataclass(frozen=True)
class LayerCall:
    """How to call one layer: where the hidden state goes (a position, or a keyword) and
    the indices into :attr:`Carried.values` of its other arguments."""

    hidden_at: int | str
    positional: tuple[int, ...]
    keywords: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Carried:
    """Between stages: the hidden state, the arguments the remaining layers take (each
    distinct value once) and the labels."""

    hidden: torch.Tensor
    values: tuple
    calls: tuple[LayerCall, ...]
    labels: torch.Tensor | None


def carried(hidden, recorded: list[tuple[tuple, dict]], labels, model_type: str) -> Carried:
    values: list = []
    index: dict[int, int] = {}

    def slot(value) -> int:
        _check_value(value, model_type)
        if id(value) not in index:
            index[id(value)] = len(values)
            values.append(value)
        return index[id(value)]

    calls = []
    for args, kwargs in recorded:
        if args:
            at, rest, words = 0, args[1:], kwargs
        else:
            at, rest = "hidden_states", ()
            words = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        calls.append(
            LayerCall(
                at,
                tuple(slot(v) for v in rest),
                tuple((k, slot(v)) for k, v in words.items()),
            )
        )
    return Carried(hidden, tuple(values), tuple(calls), labels)


def _check_value(value, model_type: str) -> None:
    """Values that can travel: tensors, plain values, and tuples of them. A mutable
    object shared by the layers is a side channel between them, which stages cannot
    carry."""
    if isinstance(value, (torch.Tensor, *_PLAIN)):
        return
    if type(value) is tuple:
        for item in value:
            _check_value(item, model_type)
        return
    raise UnsupportedModel(
        f"model_type {model_type!r}: its decoder layers share an argument of type "
        f"{type(value).__name__} (a side channel between layers, e.g. shared keys and "
        "values), which pipeline stages cannot carry; roundpipe does not train this "
        "model yet"
    )


def after_layer(state: Carried, hidden: torch.Tensor) -> Carried:
    """``state`` after its first layer ran: its call gone, values nobody needs dropped."""
    calls = state.calls[1:]
    used = sorted({i for c in calls for i in (*c.positional, *(i for _, i in c.keywords))})
    renumber = {old: new for new, old in enumerate(used)}
    calls = tuple(
        LayerCall(
            c.hidden_at,
            tuple(renumber[i] for i in c.positional),
            tuple((k, renumber[i]) for k, i in c.keywords),
        )
        for c in calls
    )
    return Carried(hidden, tuple(state.values[i] for i in used), calls, state.labels)
