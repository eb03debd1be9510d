"""The files of one checkpoint directory: what a save writes, and reading it back.

:func:`contents` takes everything a save writes and :func:`write` puts it in a
directory. :func:`read` checks a directory against the model and the optimizer,
scheduler and scaler it will load into (every file, every tensor's name, shape and
dtype, the JSON) and changes nothing; :func:`load_objects` and :func:`put` then load
what it returned (docs/design.md#checkpoints).
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import checkpoint_optimizer as optimizer_part

if TYPE_CHECKING:
    from ..devices.base import DevicePool
    from ..runtime.params import ParameterStore
    from ..runtime.seeds import CallSeeds

FORMAT = 1
TENSOR_FILES = ("weights", "masters", "rng", "optimizer")
NAMES = frozenset({f"{name}.safetensors" for name in TENSOR_FILES} | {"state.json"})
# A checkpoint written before saves had ids reads as save 1; drawn ids are larger.
UNNUMBERED = 1


@dataclass(frozen=True)
class LiveState:
    """The model's state a checkpoint saves and restores, besides the optimizer,
    scheduler and scaler: its parameters (weights, masters and their gradients), its
    buffers, and the random-number state of its host, devices and layers."""

    store: ParameterStore
    pool: DevicePool
    buffers: list[tuple[str, torch.Tensor]]
    seeds: CallSeeds


@dataclass(frozen=True)
class Contents:
    """What one save writes: the tensors of each file, and ``state.json``."""

    tensors: dict[str, dict[str, torch.Tensor]]
    state: str
    save_id: int


@dataclass(frozen=True)
class Staged:
    """A checkpoint read and checked against the model, ready to load."""

    extra: Any
    weights: dict[str, torch.Tensor]
    masters: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]
    objects: dict[str, dict]  # "optimizer", "lr_scheduler", "grad_scaler": state dicts


def contents(live: LiveState, optimizer, lr_scheduler, grad_scaler, extra, save_id, shard):
    """Everything a save writes; raises before anything is written if ``extra`` or a
    state dict is not JSON data."""
    store, pool, buffers, seeds = live.store, live.pool, live.buffers, live.seeds
    state: dict[str, Any] = {"format": FORMAT, "parameters": _names(store), "extra": extra}
    if shard is None:
        state["save_id"] = save_id
    else:
        state["shard"] = {**shard, "save_id": save_id}
    tensors = {"weights": _weights(store, buffers), "masters": {}, "rng": _rng(pool, seeds)}
    for name, master in store.masters():
        tensors["masters"][name] = master.detach()
        if master.grad is not None:
            tensors["masters"][f"grad/{name}"] = master.grad
    if optimizer is not None:
        tensors["optimizer"], state["optimizer"] = optimizer_part.split(optimizer)
    for key, given in (("lr_scheduler", lr_scheduler), ("grad_scaler", grad_scaler)):
        if given is not None:  # a scheduler over a tensor lr holds tensors
            state[key] = optimizer_part.tensors_to_json(given.state_dict())
    try:
        encoded = json.dumps(state)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"save_checkpoint: extra, the scheduler and the scaler state must be JSON "
            f"data (dicts, lists, numbers, strings): {exc}"
        ) from exc
    files = {f"{name}.safetensors": values for name, values in tensors.items()}
    return Contents(files, encoded, save_id)


def write(directory: Path, contents: Contents) -> None:
    """Write and flush every file into ``directory``; ``state.json`` last, so a directory
    with one is complete."""
    for name, tensors in contents.tensors.items():
        _write_tensors(directory / name, tensors, contents.save_id)
    with open(directory / "state.json", "w") as file:
        file.write(contents.state)
        file.flush()
        os.fsync(file.fileno())


def read_state(directory: Path) -> dict:
    """The checked ``state.json`` of ``directory``."""
    file = directory / "state.json"
    try:
        state = json.loads(file.read_bytes())
    except ValueError as error:  # not JSON, or not UTF-8
        raise ValueError(f"{file} is damaged ({error}): load an earlier checkpoint") from error
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{file} is not the state of a RoundPipe checkpoint (format {FORMAT})")
    for key, kind in (
        ("parameters", list),
        ("optimizer", dict),
        ("lr_scheduler", dict),
        ("grad_scaler", dict),
        ("shard", dict),
        ("save_id", int),
    ):
        if key in state and not isinstance(state[key], kind):
            raise ValueError(f"{file} is damaged: its {key} is not a {kind.__name__}")
    if "shard" in state and not all(
        isinstance(state["shard"].get(key), int) for key in ("rank", "world", "save_id")
    ):
        raise ValueError(f"{file} is damaged: its shard is not a rank, world and save id")
    return state


def new_save_id() -> int:
    """A fresh id for a save (rank 0's is every rank's), above :data:`UNNUMBERED`."""
    return UNNUMBERED + 1 + int.from_bytes(os.urandom(7), "little")


def saved_id(state: dict) -> int:
    """The id of the save that wrote ``state`` (shared by all its shards)."""
    return int((state.get("shard") or state).get("save_id", UNNUMBERED))


def read(directory, save_id, shard, live: LiveState, optimizer, lr_scheduler, grad_scaler):
    """Read checkpoint ``directory`` (of save ``save_id``) and check it fits the model's
    ``live`` state and the given optimizer, scheduler and scaler; raises (naming the
    file, the tensor, both sides) before anything changes."""
    store, pool, buffers, seeds = live.store, live.pool, live.buffers, live.seeds
    state = read_state(directory)
    file = directory / "state.json"
    if saved_id(state) != save_id:
        raise ValueError(f"{directory} changed while it was loaded (saved again): load again")
    saved = state.get("shard")
    if (saved and {k: saved.get(k) for k in ("rank", "world")}) != (shard or None):
        raise ValueError(
            f"{directory} was saved by "
            + (f"rank {saved.get('rank')} of {saved.get('world')} nodes" if saved else "one node")
            + (f", not by rank {shard['rank']} of {shard['world']}" if shard else "")
            + ": load a checkpoint with the number of nodes that saved it"
        )
    names = _names(store)
    if state.get("parameters") != names:
        raise ValueError(
            f"{directory} is not a checkpoint of this model: its parameters differ "
            f"({len(state.get('parameters', []))} saved, {len(names)} here)"
        )
    objects = {}
    for key, given in (
        ("optimizer", optimizer),
        ("lr_scheduler", lr_scheduler),
        ("grad_scaler", grad_scaler),
    ):
        if given is not None and key not in state:
            raise ValueError(
                f"{file} holds no {key} state (it was saved without one): load it without {key}="
            )
        if given is not None:
            try:
                objects[key] = optimizer_part.tensors_from_json(state[key])
            except (KeyError, ValueError, TypeError, RuntimeError) as error:
                raise ValueError(f"{file} is damaged: its {key} ({error!r})") from error
    tensors = {
        name: _read_tensors(directory / f"{name}.safetensors", save_id)
        for name in ("weights", "masters", "rng")
    }
    _check_weights(directory / "weights.safetensors", tensors["weights"], store, buffers)
    masters = dict(store.masters())
    grads = {f"grad/{name}": master for name, master in masters.items()}
    _check(directory / "masters.safetensors", tensors["masters"], masters, grads)
    here = _rng(pool, seeds)  # only the devices this pool has: another machine's pool may differ
    rng = {k: v for k, v in tensors["rng"].items() if k in here or not k.startswith("device/")}
    _check(directory / "rng.safetensors", rng, {"cpu": here["cpu"]}, here)
    if optimizer is not None:
        path = directory / "optimizer.safetensors"
        objects["optimizer"] = optimizer_part.staged(
            path, _read_tensors(path, save_id), objects["optimizer"], optimizer
        )
    return Staged(state.get("extra"), tensors["weights"], tensors["masters"], rng, objects)


def load_objects(staged: Staged, **objects) -> Callable[[], None]:
    """Load the optimizer, scheduler and scaler states of ``staged`` into ``objects``
    (by the names :func:`read` was given them); returns what puts their own states back.
    A load that fails puts them back itself."""
    # A state dict holds references, not copies: loading one replaces an object's state
    # (no tensor is written into), so the references bring the old state back.
    loaded: list[tuple[Any, dict]] = []

    def undo() -> None:
        for target, before in reversed(loaded):
            target.load_state_dict(before)

    try:
        for key, state in staged.objects.items():
            loaded.append((objects[key], objects[key].state_dict()))
            objects[key].load_state_dict(state)
    except BaseException:
        undo()
        raise
    return undo


def put(staged: Staged, live: LiveState) -> None:
    """Copy the checked weights, buffers and RNG states of ``staged`` into ``live``
    (shapes and dtypes were checked, so nothing can fail half-way)."""
    store, pool, buffers, seeds = live.store, live.pool, live.buffers, live.seeds
    with torch.no_grad():
        for entry in store.entries.values():
            if entry.trainable:
                entry.param.copy_(staged.weights[f"param/{entry.name}"])
        for name, buffer in buffers:
            buffer.copy_(staged.weights[f"buffer/{name}"])
    torch.set_rng_state(staged.rng["cpu"])
    if "seeds" in staged.rng:  # absent from checkpoints saved before seeds were
        seeds.load(staged.rng["seeds"])
    for i, device in enumerate(pool):
        if f"device/{i}" in staged.rng:
            device.set_rng_state(staged.rng[f"device/{i}"])


# -- tensors -------------------------------------------------------------------------------


def _names(store) -> list[str]:
    return [entry.name for entry in store.entries.values()]


def _weights(store, buffers) -> dict[str, torch.Tensor]:
    entries = store.entries.values()
    weights = {f"param/{e.name}": e.param.detach() for e in entries if e.trainable}
    weights.update({f"frozen/{e.name}": _sample(e.param) for e in entries if not e.trainable})
    weights.update({f"buffer/{name}": b for name, b in buffers})
    return weights


def _rng(pool, seeds) -> dict[str, torch.Tensor]:
    """The generators' states, and the model's seed and call count its layers' random
    numbers derive from (docs/design.md#random-numbers)."""
    rng = {"cpu": torch.get_rng_state(), "seeds": seeds.state()}
    for i, device in enumerate(pool):
        if device.torch_device.type != "cpu":
            rng[f"device/{i}"] = device.get_rng_state()
    return rng


def _sample(param: torch.Tensor) -> torch.Tensor:
    """The first and last (up to) 64 elements of ``param``: a frozen weight's fingerprint."""
    flat = param.detach().reshape(-1)
    return torch.cat([flat[:64], flat[-64:]]).clone()


def _check_weights(file: Path, weights: dict[str, torch.Tensor], store, buffers) -> None:
    want = _weights(store, buffers)
    _check(file, weights, want)
    for key, sample in want.items():
        if key.startswith("frozen/") and not torch.equal(sample, weights[key]):
            raise ValueError(
                f"{file.parent} was saved over other weights: the frozen parameter "
                f"{key.removeprefix('frozen/')} differs (load the checkpoint into the model "
                "it was trained from)"
            )


def _check(file: Path, got: dict, want: dict, optional: dict | None = None) -> None:
    """``got`` holds every tensor of ``want`` (and may hold those of ``optional``), each
    with exactly the shape and dtype it has there."""
    optional = optional or {}
    missing = [key for key in want if key not in got]
    if missing:
        raise ValueError(
            f"{file} lacks {_few(missing)}: it is not a checkpoint of this model, or it is damaged"
        )
    stray = [key for key in got if key not in want and key not in optional]
    if stray:
        raise ValueError(
            f"{file} holds {_few(stray)}, which this model does not have: it "
            "is not a checkpoint of this model"
        )
    for key, tensor in got.items():
        like = want[key] if key in want else optional[key]
        if tensor.shape != like.shape or tensor.dtype != like.dtype:
            raise ValueError(
                f"{file}: {key} is {_kind(tensor)} there but {_kind(like)} here; shapes "
                "and dtypes must match exactly: load a checkpoint of this model"
            )


def _kind(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} of shape {tuple(tensor.shape)}"


def _few(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


_OS_ERROR = re.compile(r"os error (\d+)")


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor], save_id: int) -> None:
    import safetensors.torch
    from safetensors import SafetensorError

    values = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    try:
        safetensors.torch.save_file(values, str(path), metadata={"save_id": str(save_id)})
    except SafetensorError as error:  # an I/O error (a full disk): the OSError it was
        found = _OS_ERROR.search(str(error))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from error
    with open(path, "rb+") as file:
        os.fsync(file.fileno())


def _read_tensors(path: Path, save_id: int) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as file:
            written_by = (file.metadata() or {}).get("save_id", str(UNNUMBERED))
            tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 - not a dict
    except FileNotFoundError as error:
        message = "a file of the checkpoint is missing (load an earlier checkpoint)"
        raise FileNotFoundError(errno.ENOENT, message, str(path)) from error
    except SafetensorError as error:
        raise ValueError(
            f"{path} is damaged or truncated ({error}): load an earlier checkpoint"
        ) from error
    if written_by != str(save_id):
        raise ValueError(
            f"{path} comes from another save than {path.parent / 'state.json'} "
            "(files of two checkpoints mixed): load an earlier checkpoint"
        )
    return tensors
