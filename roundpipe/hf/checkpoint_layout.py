"""Which checkpoint tensors fill which tensors of a model (pure logic, no I/O).

:func:`plan_loading` pairs them up as ``transformers`` loads them (a tied tensor from
whichever of its names the checkpoint holds, per-expert tensors into their slices of
stacked experts) and refuses, naming them, a checkpoint that lacks a tensor the model
needs or holds one it has no place for (docs/design.md#hugging-face-models).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from .safetensors_io import CheckpointError, StoredTensor

_SHOWN = 8  # names listed in an error message


@dataclass(frozen=True)
class ModelTensor:
    """One tensor of the model, under all of its names (the first is the canonical one)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_parameter: bool


@dataclass(frozen=True)
class Piece:
    """A checkpoint tensor and the part of a model tensor it fills (``()``: all of it)."""

    stored: StoredTensor
    index: tuple


@dataclass
class LoadItem:
    target: ModelTensor
    pieces: list[Piece] = field(default_factory=list)

    @property
    def whole(self) -> StoredTensor | None:
        """The checkpoint tensor that is this model tensor entire, if one is."""
        if len(self.pieces) == 1 and self.pieces[0].index == ():
            return self.pieces[0].stored
        return None


_STACKED_EXPERTS = {
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def plan_loading(
    targets: Iterable[ModelTensor],
    stored: dict[str, StoredTensor],
    ignored_patterns: Iterable[str] = (),
) -> list[LoadItem]:
    """A :class:`LoadItem` for every model tensor; raises :class:`CheckpointError` naming
    the tensors missing from the checkpoint, or those the model has no place for."""
    used: set[str] = set()
    items, missing = [], []
    for target in targets:
        item = LoadItem(target)
        direct = [name for name in target.names if name in stored]
        if direct:
            item.pieces.append(Piece(stored[direct[0]], ()))
            used.update(direct)  # the other names of a tied tensor: tied, as transformers does
        else:
            item.pieces.extend(_expert_pieces(target, stored))
            used.update(piece.stored.name for piece in item.pieces)
        if not item.pieces:
            missing.append(target.names[0])
        items.append(item)
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} tensor(s) the model needs: "
            f"{_listing(missing)} (does config.json belong to these weights?)"
        )
    ignored = [re.compile(pattern) for pattern in ignored_patterns]
    unexpected = [n for n in stored if n not in used and not any(p.search(n) for p in ignored)]
    if unexpected:
        files = sorted({str(stored[n].path) for n in unexpected})
        raise CheckpointError(
            f"{', '.join(files)} hold(s) {len(unexpected)} tensor(s) the model has no place "
            f"for: {_listing(unexpected)} (does config.json belong to these weights?)"
        )
    for item in items:
        _check_shapes(item)
    return items


def _expert_pieces(target: ModelTensor, stored: dict[str, StoredTensor]) -> list[Piece]:
    """The per-expert tensors that make up a stacked experts tensor
    (docs/design.md#hugging-face-models)."""
    prefix, _, kind = target.names[0].rpartition(".")
    parts = _STACKED_EXPERTS.get(kind)
    if not prefix.endswith("experts") or parts is None or len(target.shape) != 3:
        return []
    experts, rows = target.shape[0], target.shape[1] // len(parts)
    pieces = []
    for expert in range(experts):
        for i, part in enumerate(parts):
            name = f"{prefix}.{expert}.{part}.weight"
            if name in stored:
                index = (expert,) if len(parts) == 1 else (expert, slice(i * rows, (i + 1) * rows))
                pieces.append(Piece(stored[name], index))
    return pieces


def _check_shapes(item: LoadItem) -> None:
    shape = item.target.shape
    for piece in item.pieces:
        want = tuple(torch.empty(shape, device="meta")[piece.index].shape)
        if piece.stored.shape != want:
            part = "" if piece.index == () else f" (a part of {item.target.names[0]})"
            raise CheckpointError(
                f"tensor {piece.stored.name!r} in {piece.stored.path} has shape "
                f"{list(piece.stored.shape)}, the model expects {list(want)}{part} "
                "(does config.json belong to these weights?)"
            )
    covered = sum(piece.stored.nbytes // piece.stored.dtype.itemsize for piece in item.pieces)
    total = torch.Size(shape).numel()
    if covered != total:
        names = ", ".join(piece.stored.name for piece in item.pieces[:_SHOWN])
        raise CheckpointError(
            f"the checkpoint holds only part of {item.target.names[0]} ({covered} of {total} "
            f"elements, from {names}); some experts' tensors are missing"
        )


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown if len(names) <= _SHOWN else f"{shown} and {len(names) - _SHOWN} more"
