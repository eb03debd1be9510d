"""Full training-state checkpoints: ``RoundPipe.save_checkpoint`` / ``load_checkpoint``.

A run continues from a checkpoint exactly as the saved one would have: the weights,
the masters and their gradients, the optimizer, scheduler, scaler and RNG states go
into one directory of safetensors files and ``state.json``, written atomically (a save
killed half-way leaves the previous checkpoint), and sharded by rank on several nodes
(docs/design.md#checkpoints).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..cluster.comm import PeerFailure

FORMAT = 1


class Checkpoints:
    """``save_checkpoint`` / ``load_checkpoint`` of :class:`~roundpipe.RoundPipe`."""

    def save_checkpoint(
        self, path, optimizer=None, lr_scheduler=None, grad_scaler=None, extra=None
    ) -> None:
        """Wait for queued work, then write everything a run needs to continue: weights,
        masters (and accumulated gradients), the state of ``optimizer``,
        ``lr_scheduler`` and ``grad_scaler``, the RNG states, and ``extra`` (anything
        JSON can hold, e.g. the data position). Atomic (see :mod:`roundpipe.model.checkpoint`)."""
        with self._session.enter("save_checkpoint") as session:
            session.check_open()
            session.synchronize()
            buffers = list(self.model.named_buffers())
            shard = None
            if self._node is not None:
                token = int.from_bytes(os.urandom(7), "little")
                save_id = self._node.comm.gather_ints([token], "the checkpoint save id")[0][0]
                shard = {"rank": self._node.rank, "world": self._node.world, "save_id": save_id}
                path = shard_path(path, shard)
            save(self._session.store, self.pool, buffers, path, optimizer, lr_scheduler,
                 grad_scaler, extra, shard)  # fmt: skip
            if self._node is not None:
                self._node.comm.gather_ints([0], "the checkpoint save (every rank done)")

    def load_checkpoint(self, path, optimizer=None, lr_scheduler=None, grad_scaler=None) -> Any:
        """Restore a :meth:`save_checkpoint` of this model (and the given optimizer,
        scheduler and scaler, built as when it was saved); returns its ``extra``. The run
        continues exactly as the saved one would have."""
        with self._session.enter("load_checkpoint") as session:
            session.check_open()
            session.synchronize()
            store = self._session.store
            buffers = list(self.model.named_buffers())
            shard = None
            if self._node is not None:
                shard = {"rank": self._node.rank, "world": self._node.world}
                path = shard_path(path, shard)
            try:
                extra, masters, save_id = load(store, self.pool, buffers, path, optimizer,
                                               lr_scheduler, grad_scaler, shard)  # fmt: skip
            except Exception:
                if self._node is not None:  # the others must not wait for this rank
                    self._node.comm.gather_ints([1, 0], "the checkpoint load")
                raise
            if self._node is not None:
                rows = self._node.comm.gather_ints([0, save_id], "the checkpoint load")
                failed = [rank for rank, row in enumerate(rows) if row[0]]
                if failed:
                    raise PeerFailure(f"loading the checkpoint failed on rank(s) {failed}")
                ids = [row[1] for row in rows]
                if len(set(ids)) > 1:
                    raise ValueError(
                        f"the shards under {path.parent} come from different saves (a save "
                        "was interrupted on some rank); load an earlier checkpoint"
                    )
            session.synchronize()  # adopts the written weights (the masters take them) ...
            restore_masters(store, masters)  # ... then get their full-precision values
            session.make_current()  # .grad shows the restored gradients
        return extra


def shard_path(path, shard: dict) -> Path:
    """Where rank ``shard["rank"]`` of ``shard["world"]`` keeps its part of ``path``."""
    return Path(path) / f"rank{shard['rank']}-of-{shard['world']}"


def save(
    store, pool, buffers, path, optimizer, lr_scheduler, grad_scaler, extra, shard=None
) -> None:
    path = Path(path)
    names = [entry.name for entry in store.entries.values()]
    state: dict[str, Any] = {"format": FORMAT, "parameters": names, "extra": extra}
    if shard is not None:
        state["shard"] = shard
    tensors = {}
    if optimizer is not None:
        tensors, state["optimizer"] = _split_optimizer(optimizer.state_dict())
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    if grad_scaler is not None:
        state["grad_scaler"] = grad_scaler.state_dict()
    try:  # before anything is written: a value JSON cannot hold fails the save cleanly
        encoded = json.dumps(state)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"save_checkpoint: extra, the scheduler and the scaler state must be JSON "
            f"data (dicts, lists, numbers, strings): {exc}"
        ) from exc
    weights = {f"param/{e.name}": e.param.detach() for e in store.entries.values() if e.trainable}
    weights.update(
        {f"frozen/{e.name}": _sample(e.param) for e in store.entries.values() if not e.trainable}
    )
    weights.update({f"buffer/{name}": b for name, b in buffers})
    masters: dict[str, torch.Tensor] = {}
    for name, master in store.masters():
        masters[name] = master.detach()
        if master.grad is not None:
            masters[f"grad/{name}"] = master.grad
    rng = {"cpu": torch.get_rng_state()}
    for i, device in enumerate(pool):
        if device.torch_device.type != "cpu":
            rng[f"device/{i}"] = device.get_rng_state()
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_tensors(tmp / "weights.safetensors", weights)
        _write_tensors(tmp / "masters.safetensors", masters)
        _write_tensors(tmp / "rng.safetensors", rng)
        if optimizer is not None:
            _write_tensors(tmp / "optimizer.safetensors", tensors)
        with open(tmp / "state.json", "w") as file:
            file.write(encoded)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _swap(tmp, path)


def load(store, pool, buffers, path, optimizer, lr_scheduler, grad_scaler, shard=None):
    """Restore what :func:`save` wrote; returns its ``extra``, the saved masters and its
    save id (0 on one node). The caller has drained the runtime; it adopts the written
    weights afterwards, then :func:`restore_masters` sets the masters to their
    full-precision values. ``shard``: the rank and world this node loads as."""
    path = existing_checkpoint(Path(path), shard)
    with open(path / "state.json") as file:
        state = json.load(file)
    saved = state.get("shard")
    if (saved and {k: saved[k] for k in ("rank", "world")}) != (shard or None):
        raise ValueError(
            f"{path} was saved by "
            + (f"rank {saved['rank']} of {saved['world']} nodes" if saved else "one node")
            + (f", not by rank {shard['rank']} of {shard['world']}" if shard else "")
            + ": load a checkpoint with the number of nodes that saved it"
        )
    names = [entry.name for entry in store.entries.values()]
    if state.get("format") != FORMAT or state.get("parameters") != names:
        raise ValueError(
            f"{path} is not a checkpoint of this model: its parameters differ "
            f"({len(state.get('parameters', []))} saved, {len(names)} here)"
        )
    weights = _read_tensors(path / "weights.safetensors")
    for entry in store.entries.values():
        if not entry.trainable and not torch.equal(
            _sample(entry.param), weights.get(f"frozen/{entry.name}", torch.empty(0))
        ):
            raise ValueError(
                f"{path} was saved over other weights: the frozen parameter {entry.name} "
                "differs (load the checkpoint into the model it was trained from)"
            )
    with torch.no_grad():
        for entry in store.entries.values():
            if entry.trainable:
                entry.param.copy_(weights[f"param/{entry.name}"])
        for name, buffer in buffers:
            buffer.copy_(weights[f"buffer/{name}"])
    rng = _read_tensors(path / "rng.safetensors")
    torch.set_rng_state(rng["cpu"])
    for i, device in enumerate(pool):
        if f"device/{i}" in rng:
            device.set_rng_state(rng[f"device/{i}"])
    if optimizer is not None:
        if "optimizer" not in state:
            raise ValueError(f"{path} holds no optimizer state")
        tensors = _read_tensors(path / "optimizer.safetensors")
        optimizer.load_state_dict(_join_optimizer(tensors, state["optimizer"]))
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    if grad_scaler is not None:
        grad_scaler.load_state_dict(state["grad_scaler"])
    masters = _read_tensors(path / "masters.safetensors")
    return state.get("extra"), masters, (saved or {}).get("save_id", 0)


def restore_masters(store, masters: dict[str, torch.Tensor]) -> None:
    """Set the masters (and their gradients) to the saved full-precision values."""
    with torch.no_grad():
        for name, master in store.masters():
            master.copy_(masters[name])
            grad = masters.get(f"grad/{name}")
            master.grad = None if grad is None else grad.clone()


# -- files -------------------------------------------------------------------------------


def _sample(param: torch.Tensor) -> torch.Tensor:
    """The first and last (up to) 64 elements of ``param``: a frozen weight's fingerprint."""
    flat = param.detach().reshape(-1)
    return torch.cat([flat[:64], flat[-64:]]).clone()


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
    with open(path, "rb+") as file:
        os.fsync(file.fileno())


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _swap(tmp: Path, path: Path) -> None:
    """Replace ``path`` by ``tmp``; at every instant one complete checkpoint exists, at
    ``path`` or at ``path.old``."""
    old = path.with_name(f"{path.name}.old")
    if not path.exists() and old.exists():
        os.replace(old, path)  # finish the swap of a save killed half-way first
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    _remove_abandoned(path)


def _remove_abandoned(path: Path) -> None:
    """Temporary directories of saves whose process is gone (killed while writing)."""
    for candidate in path.parent.glob(f"{path.name}.tmp-*"):
        pid = candidate.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(candidate, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def existing_checkpoint(path: Path, shard: dict | None = None) -> Path:
    """``path``, or ``path.old`` where a save was killed between its two renames."""
    if (path / "state.json").is_file():
        return path
    old = path.with_name(f"{path.name}.old")
    if (old / "state.json").is_file():  # a save was killed between its two renames
        return old
    root = path.parent if shard else path
    shards = sorted(p.name for p in root.glob("rank*-of-*")) if root.is_dir() else []
    if shards:
        raise FileNotFoundError(
            f"no checkpoint at {path}: {root} holds shards {shards} of a save by several "
            "nodes; load it with that number of nodes"
        )
    raise FileNotFoundError(f"no checkpoint at {path} (no state.json)")


def _split_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}/{key}"] = value
            else:
                scalars.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _join_optimizer(tensors: dict[str, torch.Tensor], rest: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        index, name = key.split("/", 1)
        state.setdefault(int(index), {})[name] = value
    for index, values in rest["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": rest["param_groups"]}
