"""The optimizer's part of a checkpoint: its tensors (``optimizer.safetensors``) and the
rest of its state dict (in ``state.json``), and the checks a load makes of them before
anything is loaded (docs/design.md#checkpoints).

A save records every state tensor's name and whether it has its parameter's shape
(Adam's moments do, its ``step`` does not), so a load refuses a state tensor that is
missing, or that would meet a parameter of another shape: ``load_state_dict`` checks
neither, and the step after it would fail or, with broadcasting, silently differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def split(optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """``optimizer.state_dict()`` as the tensors of ``optimizer.safetensors`` (named
    ``"<index>/<key>"``) and the JSON rest: the param groups, the non-tensor values and
    the record of the tensors."""
    state = optimizer.state_dict()
    params = _parameters(optimizer)
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    shaped: dict[str, bool] = {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                name = f"{index}/{key}"
                tensors[name] = value
                known = isinstance(index, int) and 0 <= index < len(params)
                param = params[index] if known else None
                shaped[name] = param is not None and value.dim() > 0 and value.shape == param.shape
            else:
                scalars.setdefault(str(index), {})[key] = value
    rest = {"param_groups": state["param_groups"], "scalars": scalars, "tensors": shaped}
    return tensors, rest


def staged(path: Path, tensors: dict[str, torch.Tensor], rest: dict, optimizer) -> dict:
    """The optimizer state dict of the checkpoint, checked against ``optimizer`` (the
    same groups of the same sizes; every recorded tensor present and of its parameter's
    shape where it had it) before anything is loaded; raises ``ValueError`` naming
    ``path`` and the tensor."""
    try:
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            index, name = key.split("/", 1)
            state.setdefault(int(index), {})[name] = value
        for index, values in rest["scalars"].items():
            state.setdefault(int(index), {}).update(values)
        saved = [len(group["params"]) for group in rest["param_groups"]]
        recorded = rest.get("tensors")  # absent in checkpoints written before the record
    except (KeyError, ValueError, TypeError, AttributeError) as error:
        raise ValueError(f"{path}: the optimizer state is damaged ({error!r})") from error
    here = [len(group["params"]) for group in optimizer.param_groups]
    if saved != here:
        raise ValueError(
            f"{path}: the optimizer was saved with parameter groups of {saved} parameters, "
            f"this one has {here}: pass an optimizer built as the saved one was"
        )
    if recorded is not None:
        _check_tensors(path, tensors, recorded, _parameters(optimizer))
    return {"state": state, "param_groups": rest["param_groups"]}


def _check_tensors(path: Path, tensors: dict, recorded: dict, params: list) -> None:
    missing = sorted(set(recorded) - set(tensors))
    unknown = sorted(set(tensors) - set(recorded))
    if missing or unknown:
        what = f"lacks {missing[:3]}" if missing else f"holds unrecorded {unknown[:3]}"
        raise ValueError(f"{path} is damaged: it {what}: load an earlier checkpoint")
    for name, shaped in recorded.items():
        index = int(name.split("/", 1)[0])
        if not shaped:
            continue
        if index >= len(params):
            raise ValueError(
                f"{path}: {name!r} belongs to parameter {index}, but this optimizer has "
                f"{len(params)}: pass an optimizer built as the saved one was"
            )
        if tensors[name].shape != params[index].shape:
            raise ValueError(
                f"{path}: {name!r} has shape {tuple(tensors[name].shape)}, but parameter "
                f"{index} of this optimizer has shape {tuple(params[index].shape)}: pass "
                "an optimizer built as the saved one was (the same parameters, in the same "
                "order)"
            )


def _parameters(optimizer) -> list:
    """The optimizer's parameters in its state dict's numbering (groups in order)."""
    return [param for group in optimizer.param_groups for param in group["params"]]
