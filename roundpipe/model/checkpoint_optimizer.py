"""The optimizer's part of a checkpoint: its tensors (``optimizer.safetensors``) and the
rest of its state dict (in ``state.json``), and the checks a load makes of them before
anything is loaded (docs/design.md#checkpoints).

A save records the optimizer's kind (its class, and the dtype of its states where it
chooses one) and every state tensor's name and whether it has its parameter's shape
(Adam's moments do, its ``step`` does not), so a load refuses another kind of optimizer,
a state tensor that is missing, or one that would meet a parameter of another shape:
``load_state_dict`` checks none of them, and the step after it would fail or, with
broadcasting or another state format, silently differ.

Tensors in the param groups (torchao keeps ``lr`` as one) are stored as tensors
(``group/<g>/<key>``) and put back as such. A state tensor of a known subclass
(torchao's quantized optimizer states, :data:`SUBCLASSES`) is stored as its inner
tensors (``part/<index>/<key>/<inner>``, the ``__tensor_flatten__`` protocol) and its
class recorded by name; a load rebuilds it with ``__tensor_unflatten__``, and imports
only the classes named here. Any other subclass is refused when the save begins.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

# The tensor subclasses a checkpoint may hold, by the name it records them under.
SUBCLASSES = {
    f"torchao.optim.{module}.{name}": (f"torchao.optim.{module}", name)
    for module, name in (
        ("subclass_8bit", "OptimState8bit"),
        ("subclass_4bit", "OptimState4bit"),
        ("subclass_fp8", "OptimStateFp8"),
    )
}
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def split(optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """``optimizer.state_dict()`` as the tensors of ``optimizer.safetensors`` (named
    ``"<index>/<key>"``, ``"group/<g>/<key>"`` and ``"part/<index>/<key>/<inner>"``) and
    the JSON rest: the param groups, the non-tensor values and the record of the
    tensors; raises ``TypeError`` for a tensor subclass it cannot store."""
    state = optimizer.state_dict()
    params = _parameters(optimizer)
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    shaped: dict[str, bool] = {}
    subclasses: dict[str, dict] = {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                name = f"{index}/{key}"
                if type(value) in _PLAIN:
                    tensors[name] = value
                else:
                    subclasses[name] = _flatten(name, value, tensors)
                known = isinstance(index, int) and 0 <= index < len(params)
                param = params[index] if known else None
                shaped[name] = param is not None and value.dim() > 0 and value.shape == param.shape
            else:
                scalars.setdefault(str(index), {})[key] = value
    groups: list[dict] = []
    in_groups: list[str] = []
    for g, group in enumerate(state["param_groups"]):
        groups.append({})
        for key, value in group.items():
            if not isinstance(value, torch.Tensor):
                groups[-1][key] = value
                continue
            if type(value) not in _PLAIN:
                raise TypeError(_refusal(f"param group {g}'s {key!r}", value))
            tensors[f"group/{g}/{key}"] = value
            in_groups.append(f"{g}/{key}")
    rest = {"param_groups": groups, "scalars": scalars, "tensors": shaped}
    rest["kind"] = optimizer_kind(optimizer)
    if in_groups:
        rest["group_tensors"] = in_groups
    if subclasses:
        rest["subclasses"] = subclasses
    return tensors, rest


def staged(path: Path, tensors: dict[str, torch.Tensor], rest: dict, optimizer) -> dict:
    """The optimizer state dict of the checkpoint, checked against ``optimizer`` (the
    same groups of the same sizes; every recorded tensor present and of its parameter's
    shape where it had it) before anything is loaded; raises ``ValueError`` naming
    ``path`` and the tensor."""
    try:
        tensors = dict(tensors)
        groups = [dict(group) for group in rest["param_groups"]]
        for name in rest.get("group_tensors", []):
            g, key = name.split("/", 1)
            groups[int(g)][key] = tensors.pop(f"group/{name}")
        for name, record in rest.get("subclasses", {}).items():
            tensors[name] = _unflatten(path, name, record, tensors)
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            index, name = key.split("/", 1)
            state.setdefault(int(index), {})[name] = value
        for index, values in rest["scalars"].items():
            state.setdefault(int(index), {}).update(values)
        saved = [len(group["params"]) for group in groups]
        recorded = rest.get("tensors")  # absent in checkpoints written before the record
    except _Refused:
        raise
    except (KeyError, ValueError, TypeError, AttributeError, IndexError) as error:
        raise ValueError(f"{path}: the optimizer state is damaged ({error!r})") from error
    kind, saved_kind = optimizer_kind(optimizer), rest.get("kind")  # absent before the record
    if saved_kind is not None and saved_kind != kind:
        raise ValueError(
            f"{path}: the optimizer state was saved by {saved_kind}, and this optimizer is "
            f"{kind}: its state would load without a complaint and then fail or differ at "
            "the next step; pass an optimizer built as the saved one was"
        )
    here = [len(group["params"]) for group in optimizer.param_groups]
    if saved != here:
        raise ValueError(
            f"{path}: the optimizer was saved with parameter groups of {saved} parameters, "
            f"this one has {here}: pass an optimizer built as the saved one was"
        )
    if recorded is not None:
        _check_tensors(path, tensors, recorded, _parameters(optimizer))
    return {"state": state, "param_groups": groups}


def optimizer_kind(optimizer) -> str:
    """The optimizer's class and, for one that keeps its states in a chosen dtype
    (:class:`roundpipe.optim.AdamW`), that dtype: what decides the state's format."""
    kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    state_dtype = getattr(optimizer, "state_dtype", None)
    return kind if state_dtype is None else f"{kind}(state_dtype={state_dtype})"


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


# -- tensor subclasses -----------------------------------------------------------------


class _Refused(ValueError):
    """A load's refusal that names its cause already (not "damaged")."""


def _class_name(value: torch.Tensor) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _refusal(what: str, value: torch.Tensor) -> str:
    return (
        f"save_checkpoint: the optimizer's {what} is a {_class_name(value)}, a tensor "
        f"subclass a checkpoint cannot store (it stores plain tensors and "
        f"{', '.join(sorted(SUBCLASSES))})"
    )


def _flatten(name: str, value: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict:
    """Put the inner tensors of the subclass ``value`` into ``tensors``; its record."""
    if _class_name(value) not in SUBCLASSES:
        raise TypeError(_refusal(f"state {name!r}", value))
    inner, context = value.__tensor_flatten__()  # type: ignore[attr-defined]  # a subclass's
    for attr in inner:
        part = getattr(value, attr)
        if type(part) not in _PLAIN:
            raise TypeError(_refusal(f"state {name!r} (its {attr!r})", part))
        tensors[f"part/{name}/{attr}"] = part
    return {
        "class": _class_name(value),
        "inner": list(inner),
        "context": [_encode(name, item) for item in context],
        "shape": list(value.shape),
        "stride": list(value.stride()),
        "dtype": str(value.dtype).removeprefix("torch."),
    }


def _unflatten(path: Path, name: str, record: dict, tensors: dict) -> torch.Tensor:
    """The subclass tensor ``name`` rebuilt from its record and inner tensors (popped
    from ``tensors``); raises ``ValueError`` for a class not in :data:`SUBCLASSES`."""
    if record["class"] not in SUBCLASSES:
        raise _Refused(
            f"{path}: {name!r} is recorded as a {record['class']}, which RoundPipe does not "
            "load (it loads only plain tensors and " + ", ".join(sorted(SUBCLASSES)) + ")"
        )
    module, attr = SUBCLASSES[record["class"]]
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as error:
        message = f"{path}: {name!r} is a {record['class']}: install torchao"
        raise _Refused(message) from error
    parts = {inner: tensors.pop(f"part/{name}/{inner}") for inner in record["inner"]}
    context = [_decode(item) for item in record["context"]]
    size, stride = torch.Size(record["shape"]), tuple(record["stride"])
    try:
        value = cls.__tensor_unflatten__(parts, context, size, stride)
    except Exception as error:  # the class's own checks (dtypes, sizes) refused them
        raise _Refused(f"{path}: {name!r} cannot be rebuilt ({error!r})") from error
    if list(value.shape) != record["shape"] or str(value.dtype) != f"torch.{record['dtype']}":
        raise _Refused(f"{path}: {name!r} rebuilds with another shape or dtype than saved")
    return value


def _encode(name: str, item: Any) -> Any:
    """A subclass's flatten context item as JSON: scalars, dtypes and sizes."""
    if isinstance(item, torch.dtype):
        return {"dtype": str(item).removeprefix("torch.")}
    if isinstance(item, torch.Size):
        return {"size": list(item)}
    if item is None or isinstance(item, bool | int | float | str):
        return item
    raise TypeError(
        f"save_checkpoint: the optimizer's state {name!r} has a flatten context of "
        f"{type(item).__name__}, which a checkpoint cannot store"
    )


def _decode(item: Any) -> Any:
    if isinstance(item, dict) and set(item) == {"dtype"}:
        dtype = getattr(torch, str(item["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"no dtype {item['dtype']!r}")
        return dtype
    if isinstance(item, dict) and set(item) == {"size"}:
        return torch.Size(int(n) for n in item["size"])
    if item is None or isinstance(item, bool | int | float | str):
        return item
    raise ValueError(f"a flatten context item {item!r}")


# -- small tensors in JSON (a scheduler's ``base_lrs`` over a tensor ``lr``) -------------

TENSOR_KEY = "roundpipe.tensor"
_JSON_TENSOR_LIMIT = 64  # elements: an lr or a step count, not a state


def tensors_to_json(value: Any) -> Any:
    """``value`` (a scheduler's or scaler's state dict) with each small plain tensor in
    it as ``{TENSOR_KEY: {"dtype", "shape", "values"}}``: exact, for JSON numbers hold
    every float32 and int64 value; raises ``TypeError`` for other tensors."""
    if isinstance(value, dict):
        return {key: tensors_to_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [tensors_to_json(item) for item in value]
    if not isinstance(value, torch.Tensor):
        return value
    if type(value) not in _PLAIN or value.numel() > _JSON_TENSOR_LIMIT or value.is_complex():
        raise TypeError(
            f"save_checkpoint: a scheduler or scaler state holds a {_class_name(value)} of "
            f"shape {tuple(value.shape)}; it may hold only tensors of up to "
            f"{_JSON_TENSOR_LIMIT} real values"
        )
    dtype = str(value.dtype).removeprefix("torch.")
    values = value.detach().cpu().reshape(-1).tolist()
    return {TENSOR_KEY: {"dtype": dtype, "shape": list(value.shape), "values": values}}


def tensors_from_json(value: Any) -> Any:
    """The state dict :func:`tensors_to_json` wrote, its tensors rebuilt; raises
    ``ValueError`` for a damaged one."""
    if isinstance(value, dict) and set(value) == {TENSOR_KEY}:
        record = value[TENSOR_KEY]
        dtype = getattr(torch, str(record["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"no dtype {record['dtype']!r}")
        return torch.tensor(record["values"], dtype=dtype).reshape(record["shape"])
    if isinstance(value, dict):
        return {key: tensors_from_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [tensors_from_json(item) for item in value]
    return value
