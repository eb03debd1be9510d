"""Recording the arguments of each decoder layer, and carrying them between stages.

While the general path's prologue runs the model's own decoder ``forward``, its layers
are :class:`LayerStub` modules that record how each is called (:func:`recording`); the
calls become a :class:`Carried` value, which the pipeline moves between stages as it
moves any dataclass of tensors (docs/design.md#the-general-decoder-path).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .structure import UnsupportedModel

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
_local = threading.local()


class LayerStub(nn.Module):
    """Stands in for decoder layer ``index`` while the prologue runs: records its call and
    returns the hidden state as a :class:`Passed`."""

    def __init__(self, layer: nn.Module, index: int) -> None:
        super().__init__()
        self.index = index
        copy_plain_attributes(layer, self)  # e.g. attention_type, layer_type, is_sliding

    def forward(self, *args, **kwargs):
        return _recorder().layer(self.index, args, kwargs)


def copy_plain_attributes(source: nn.Module, target: nn.Module) -> None:
    """The public plain-valued attributes of ``source`` (what decoder code reads of a
    layer, or head code of a base model), set on ``target``."""
    for name, value in vars(source).items():
        if not name.startswith("_") and isinstance(value, _PLAIN) and name != "training":
            setattr(target, name, value)


class NormStub(nn.Module):
    def forward(self, hidden):
        return _recorder().norm(hidden)


class Unused:
    """Fills a :class:`Passed` beyond the hidden state (a layer's attention weights, or
    a value the decoder hands a later layer: then recorded as :class:`FromLayer`)."""


class Passed(tuple):
    """What a layer stub returns: ``(hidden, Unused(), ...)`` as long as the decoder code
    unpacks (``arity``), so ``output[0]`` is the hidden state; other attributes are the
    hidden state's (``output.shape``, ``output[:, positions]``), for decoder code that
    uses the output itself."""

    def __getattr__(self, name):
        return getattr(self[0], name)

    def __getitem__(self, key):
        if isinstance(key, int | slice):
            return tuple.__getitem__(self, key)
        return self[0][key]  # the hidden state indexed (Gemma 4: a whole-sequence view)


class Recorder:
    def __init__(self, arity: int) -> None:
        self.arity = arity
        self.calls: list[tuple[tuple, dict]] = []
        self.returned: list[Passed] = []
        self.norm_input: Any = None  # what the decoder passed its final norm
        self.norm_output: Any = None

    def layer(self, index: int, args: tuple, kwargs: dict) -> Passed:
        if index != len(self.calls):
            raise UnsupportedModel(f"the decoder called layer {index} out of order")
        self.calls.append((args, kwargs))
        hidden = hidden_of(args, kwargs)
        hidden = hidden[0] if isinstance(hidden, Passed) else hidden
        passed = Passed((hidden, *(Unused() for _ in range(self.arity - 1))))
        self.returned.append(passed)
        return passed

    def norm(self, hidden):
        self.norm_input = hidden
        self.norm_output = hidden[0] if isinstance(hidden, Passed) else hidden
        return self.norm_output


def hidden_of(args: tuple, kwargs: dict):
    """The hidden state of a recorded layer call: its first positional argument, or
    ``hidden_states``."""
    return args[0] if args else kwargs.get("hidden_states")


def _recorder() -> Recorder:
    recorder = getattr(_local, "recorder", None)
    if recorder is None:
        raise RuntimeError("a roundpipe layer stub ran outside its prologue")
    return recorder


@contextlib.contextmanager
def recording(arity: int) -> Iterator[Recorder]:
    outer = getattr(_local, "recorder", None)
    _local.recorder = Recorder(arity)
    try:
        yield _local.recorder
    finally:
        _local.recorder = outer


# -- what travels between stages -------------------------------------------------------------


@dataclass(frozen=True)
class LayerCall:
    """How to call layer ``layer``: where the hidden state goes (a position, or a
    keyword) and the indices into :attr:`Carried.values` of its other arguments."""

    layer: int
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


def carried(hidden, recorder: Recorder, labels, model_type: str) -> Carried:
    """What the recorded calls carry: each distinct argument once (by identity), an
    output of one layer that the decoder hands a later one as :class:`FromLayer`."""
    values: list = []
    index: dict[int, int] = {}
    outputs = {
        id(item): FromLayer(layer, position)
        for layer, passed in enumerate(recorder.returned)
        for position, item in enumerate(passed)
        if isinstance(item, Unused)
    }

    def slot(value) -> int:
        if id(value) not in index:
            index[id(value)] = len(values)
            values.append(outputs.get(id(value)) or _travelling(value, model_type))
        return index[id(value)]

    calls: list[LayerCall] = []
    for args, kwargs in recorder.calls:
        at: int | str
        if args:
            at, rest, words = 0, args[1:], kwargs
        else:
            at, rest = "hidden_states", ()
            words = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        calls.append(
            LayerCall(
                len(calls),
                at,
                tuple(slot(v) for v in rest),
                tuple((k, slot(v)) for k, v in words.items()),
            )
        )
    return Carried(hidden, tuple(values), tuple(calls), labels)


@dataclass(frozen=True)
class FromLayer:
    """Carried in place of output ``position`` of layer ``layer`` until that layer has
    run (GLM-5's layers hand their indexer's top-k to the next)."""

    layer: int
    position: int


@dataclass(frozen=True)
class SharedContainer:
    """Carried for a container every layer is handed empty and may write into (Gemma 4
    E-series' ``shared_kv_states``: layers store their keys and values, later layers
    read them): its contents travel between stages, so a layer in a later stage reads
    what an earlier one wrote, and gradients flow back through them."""

    kind: type
    contents: dict

    def open(self):
        """The container a layer is called with: a new one of the model's type."""
        return self.kind(self.contents) if self.contents else self.kind()

    def after(self, container, keep: bool) -> SharedContainer:
        """What travels on once a layer has run with ``container``: what it holds now
        (``keep``), or still nothing (the model's config says no layer reads it)."""
        if not keep or len(container) == len(self.contents):
            return self
        return SharedContainer(self.kind, dict(container))


def _travelling(value, model_type: str, top: bool = True):
    """``value`` as it travels: tensors, plain values and tuples of them as they are; an
    empty container every layer is handed as a :class:`SharedContainer`. Anything else
    shared by the layers is a side channel between them, which stages cannot carry."""
    if isinstance(value, (torch.Tensor, *_PLAIN)):
        return value
    if type(value) is tuple:
        return tuple(_travelling(item, model_type, top=False) for item in value)
    if top and isinstance(value, MutableMapping) and not value:
        return SharedContainer(type(value), {})
    raise UnsupportedModel(
        f"model_type {model_type!r}: its decoder layers share an argument of type "
        f"{type(value).__name__} (a side channel between layers, e.g. shared keys and "
        "values), which pipeline stages cannot carry; roundpipe does not train this "
        "model yet"
    )


def after_layer(state: Carried, out, model_type: str) -> Carried:
    """``state`` after its first layer ran and returned ``out``: its call gone, the
    layer's outputs a later layer takes in place of their :class:`FromLayer`, values
    nobody needs dropped."""
    ran = state.calls[0].layer
    outputs = out if isinstance(out, tuple) else (out,)
    values = list(state.values)
    for i, value in enumerate(values):
        if isinstance(value, FromLayer) and value.layer == ran:
            if value.position >= len(outputs):
                raise UnsupportedModel(
                    f"model_type {model_type!r}: decoder layer {ran} returned "
                    f"{len(outputs)} value(s), but its decoder hands output "
                    f"{value.position} of it to a later layer"
                )
            values[i] = outputs[value.position]
    hidden = outputs[0]
    calls = state.calls[1:]
    used = sorted({i for c in calls for i in (*c.positional, *(i for _, i in c.keywords))})
    renumber = {old: new for new, old in enumerate(used)}
    calls = tuple(
        LayerCall(
            c.layer,
            c.hidden_at,
            tuple(renumber[i] for i in c.positional),
            tuple((k, renumber[i]) for k, i in c.keywords),
        )
        for c in calls
    )
    return Carried(hidden, tuple(values[i] for i in used), calls, state.labels)
