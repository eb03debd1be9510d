"""The checkpoints of a run: ``<output>/checkpoints/step-N``, which one ``--resume``
continues from, and which old ones to delete.

Each is a :meth:`RoundPipe.save_checkpoint` directory holding the run's position and
options; under ``torchrun`` each rank keeps its own shard
(:func:`roundpipe.model.checkpoint.shard_path`) and finds, resumes and prunes only its
own (docs/design.md#run-checkpoints). ``shard`` below is ``{"rank", "world"}``, None
for one process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..model.checkpoint import existing_checkpoint, shard_path
from ..model.checkpoint_optimizer import split as optimizer_tensors
from .option_checks import FULL_ONLY, LORA_ONLY
from .options import BY_KEY, SHAPE_KEYS, STATE_KEYS, TrainOptions, UsageError

CHECKPOINTS_DIR = "checkpoints"
_NAME = re.compile(r"step-(\d+)")
_SHARD = re.compile(r"rank(\d+)-of-(\d+)")


@dataclass(frozen=True)
class Position:
    """Where a run stands after ``step`` optimizer steps: the data order is a function
    of the step, so this is all a resumed run needs besides the weights."""

    step: int
    tokens: int
    elapsed_s: float


@dataclass(frozen=True)
class Found:
    """A checkpoint ``--resume`` can continue from (``path`` is ``step-N``; sharded, the
    save id its shards share)."""

    path: Path
    position: Position
    options: dict[str, Any]
    save_id: int = 0


def checkpoint_path(output: Path, step: int) -> Path:
    return Path(output) / CHECKPOINTS_DIR / f"step-{step}"


def checkpoint_bytes(tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """About a checkpoint's size: ``tensors`` (the trainable weights and their masters)
    and the optimizer's state as the checkpoint stores it (an 8-bit state's codes and
    scales, not the size of the full-precision tensor it stands for)."""
    state, _ = optimizer_tensors(optimizer)
    return sum(t.nbytes for t in (*tensors, *state.values()))


def extra_record(position: Position, options: TrainOptions) -> dict[str, Any]:
    """The ``extra`` a checkpoint of this run carries."""
    return {"position": asdict(position), "options": options.run_record()}


def complete_checkpoints(output: Path, shard: dict | None = None) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint directory in ``output`` with a ``state.json``
    (at ``step-N`` or, for a save killed between its renames, ``step-N.old``), newest
    first. With ``shard``: the ``step-N`` directories holding this rank's complete shard
    (its ``state.json``, or that of the ``.old`` of a save killed between its renames)."""
    found: dict[int, Path] = {}
    root = Path(output) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    for entry in root.iterdir():
        if shard is not None:
            match = _NAME.fullmatch(entry.name)
            mine = match and shard_path(entry, shard)
            if match and mine and any((d / "state.json").is_file() for d in (mine, _old(mine))):
                found[int(match.group(1))] = entry
            continue
        name = entry.name.removesuffix(".old")
        match = _NAME.fullmatch(name)
        if match and (entry / "state.json").is_file():
            step = int(match.group(1))
            if step not in found or not entry.name.endswith(".old"):
                found[step] = root / name
    return sorted(found.items(), reverse=True)


def saved_worlds(output: Path) -> dict[int, set[int]]:
    """For each step with a complete checkpoint (or a shard of one) in ``output``, the
    numbers of processes that wrote it (1: unsharded)."""
    worlds: dict[int, set[int]] = {}
    root = Path(output) / CHECKPOINTS_DIR
    if not root.is_dir():
        return worlds
    for entry in root.iterdir():
        match = _NAME.fullmatch(entry.name.removesuffix(".old"))
        if not match or not entry.is_dir():
            continue
        step = int(match.group(1))
        if (entry / "state.json").is_file():
            worlds.setdefault(step, set()).add(1)
        for part in entry.iterdir():
            shard = _SHARD.fullmatch(part.name.removesuffix(".old"))
            if shard and (part / "state.json").is_file():
                worlds.setdefault(step, set()).add(int(shard.group(2)))
    return worlds


def describe_world(world: int) -> str:
    return "one process" if world == 1 else f"{world} processes (torchrun)"


def resumable_checkpoints(
    output: Path, options: TrainOptions, shard: dict | None = None
) -> tuple[list[Found], list[str]]:
    """The checkpoints in ``output`` whose files can be read (their state and every
    tensor file's header), newest first, the newest checked against ``options``; and
    why each damaged one newer than the newest readable one is skipped. A
    :class:`UsageError` when there is none, when the newest was written by another number
    of processes, or when it belongs to another model or adapter shape. With ``shard``:
    this rank's shards."""
    root = Path(output) / CHECKPOINTS_DIR
    worlds = saved_worlds(output)
    if worlds:
        _check_world("--resume", root / f"step-{max(worlds)}", worlds[max(worlds)], shard)
    candidates = complete_checkpoints(output, shard)
    if not candidates:
        raise UsageError(
            f"--resume: no checkpoint in {root} to continue from (drop --resume to start a new run)"
        )
    found: list[Found] = []
    damaged: list[str] = []
    for step, path in candidates:
        try:
            found_here = _read(path, shard)
        except (OSError, ValueError, KeyError, TypeError) as error:
            if not found:  # newer than any readable one: the user should know
                damaged.append(str(error) or f"{path} cannot be read ({type(error).__name__})")
            continue
        if found_here.position.step == step:
            found.append(found_here)
    if not found:
        raise UsageError(
            f"--resume: none of the {len(candidates)} checkpoints in {root} is readable "
            f"({'; '.join(damaged)})"
        )
    check_compatible(found[0], options)
    return found, damaged


def named_checkpoint(
    output: Path, path: Path, options: TrainOptions, shard: dict | None = None
) -> Found:
    """``--resume DIR``: checkpoint ``path``, one of ``output``'s, checked as
    :func:`resumable_checkpoints` checks the newest (no older one is tried in its place).
    Refused while ``output`` holds newer checkpoints: this run would overwrite them and
    a later ``--resume`` would take them for its own."""
    path, root = Path(path).absolute(), Path(output) / CHECKPOINTS_DIR
    flag = f"--resume {path}"
    match = _NAME.fullmatch(path.name)
    if not match or path.parent.resolve() != root.resolve():
        raise UsageError(
            f"{flag}: not a checkpoint of --output {output} (those are {root}/step-N); "
            "--resume alone takes the newest"
        )
    step, worlds = int(match.group(1)), saved_worlds(output)
    if step not in worlds:
        raise UsageError(f"{flag}: no complete checkpoint there (no state.json)")
    _check_world(flag, path, worlds[step], shard)
    newer = sorted(s for s in worlds if s > step)
    if newer:
        names = ", ".join(f"step-{s}" for s in newer)
        raise UsageError(
            f"{flag}: {root} holds newer checkpoints ({names}), which this run would "
            f"overwrite: delete them to continue from step {step}, or use another --output"
        )
    try:
        found = _read(path, shard)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"{flag}: cannot be read ({error})") from error
    if found.position.step != step:
        raise UsageError(f"{flag}: it holds step {found.position.step}, not {step}")
    check_compatible(found, options)
    return found


def read_checkpoint(path: Path) -> tuple[Found, Path]:
    """Checkpoint ``path`` (``step-N``) read on its own, outside a run: what it holds and
    the directory of its files. Sharded, the lowest rank's shard there: every rank's
    weights file holds every trainable parameter (only the masters are split)."""
    shard = None
    if not (path / "state.json").is_file() and not (_old(path) / "state.json").is_file():
        ranks = sorted(
            (int(m.group(1)), int(m.group(2)))
            for m in (_SHARD.fullmatch(p.name.removesuffix(".old")) for p in path.glob("rank*"))
            if m
        )
        if ranks:
            shard = {"rank": ranks[0][0], "world": ranks[0][1]}
    found = _read(path, shard)
    return found, existing_checkpoint(shard_path(path, shard) if shard else path, shard)


def newest_of_run(run: Path) -> tuple[Path, bool] | None:
    """For ``roundpipe export --checkpoint RUN``: where ``run`` is a run's ``--output``
    (it holds ``run.yaml`` or ``checkpoints/``), its newest checkpoint, and whether the
    run finished there (its result, complete, was written after it: the same weights);
    None for another directory (a checkpoint itself). A :class:`UsageError` for a run
    without a checkpoint."""
    from .result import result_complete

    run = Path(run)
    if (run / "state.json").is_file() or not (
        (run / CHECKPOINTS_DIR).is_dir() or (run / "run.yaml").is_file()
    ):
        return None
    worlds = saved_worlds(run)
    if not worlds:
        raise UsageError(
            f"--checkpoint {run}: a run directory without a checkpoint (none in "
            f"{run / CHECKPOINTS_DIR})"
        )
    newest = checkpoint_path(run, max(worlds))
    try:
        written_after = (run / "tokenizer_config.json").stat().st_mtime >= newest.stat().st_mtime
    except OSError:
        written_after = False
    complete = any(result_complete(run, full) for full in (False, True))
    return newest, complete and written_after


def _check_world(flag: str, path: Path, saved_by: set[int], shard: dict | None) -> None:
    world = shard["world"] if shard else 1
    if world not in saved_by:
        saved = " and ".join(describe_world(w) for w in sorted(saved_by))
        raise UsageError(
            f"{flag}: {path} was written by {saved}, this run has "
            f"{describe_world(world)}: resume with the number of processes that wrote it"
        )


def _read(path: Path, shard: dict | None) -> Found:
    where = existing_checkpoint(shard_path(path, shard) if shard else path, shard)
    try:
        state = json.loads((where / "state.json").read_text())
        extra = state.get("extra") or {}
        position, options = Position(**extra["position"]), dict(extra["options"])
        save_id = int(state["shard"]["save_id"]) if shard else 0
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{where / 'state.json'} is damaged ({error!r})") from error
    _check_tensor_files(where)
    return Found(path, position, options, save_id)


def _check_tensor_files(where: Path) -> None:
    """Every tensor file's header reads and fits its file: a checkpoint cut short is
    skipped here, before anything loads (and, sharded, before the ranks load together:
    one failing half-way would leave the others waiting)."""
    from ..hf.safetensors_io import read_header

    for name in ("weights", "masters", "rng", "optimizer"):  # a run saves all four
        read_header(where / f"{name}.safetensors")


def common_checkpoints(mine: list[Found], every_rank: list[list[tuple[int, int]]]) -> list[Found]:
    """Of this rank's ``mine``, those every rank has, from the same save (the ``(step,
    save_id)`` each rank found), newest first."""
    shared = set.intersection(*(set(found) for found in every_rank))
    return [found for found in mine if (found.position.step, found.save_id) in shared]


def check_compatible(found: Found, options: TrainOptions) -> None:
    """A :class:`UsageError` unless ``found`` trains the parameters ``options`` would,
    with an optimizer state and weights of the same types (:data:`STATE_KEYS`)."""
    path, saved, now = found.path, found.options, options.run_record()
    keys = [key for key in SHAPE_KEYS if not (now["full"] and key.startswith("lora_"))]
    differ = [key for key in keys if saved.get(key) != now.get(key)]
    if differ:
        raise UsageError(
            f"--resume: {path} is a checkpoint of another model or adapter shape "
            f"({_differences(differ, saved, now)}); resume with the same options or use "
            "another --output"
        )
    saved = saved_state_options(saved)
    differ = [key for key in STATE_KEYS if key in now and saved.get(key) != now[key]]
    if saved.get("precision") not in (None, now.get("precision")):
        differ.append("precision")  # the dtype of the weights the checkpoint holds
    if differ:
        raise UsageError(
            f"--resume: {path} holds an optimizer state or weights of other types "
            f"({_differences(differ, saved, now)}), which a resumed run cannot change; "
            "resume with the same options or use another --output"
        )


def _differences(keys: list[str], saved: dict, now: dict) -> str:
    return "; ".join(
        f"--{key.replace('_', '-')} {saved.get(key)!r} there, {now.get(key)!r} here" for key in keys
    )


def remove_checkpoint(path: Path, shard: dict | None = None) -> list[Path]:
    """Delete checkpoint ``path`` (``step-N``; with ``shard``, this rank's shard of it,
    then ``step-N`` itself once no rank's shard is left); returns what was deleted."""
    deleted = []
    target = shard_path(path, shard) if shard else path
    for directory in (target, _old(target)):
        if directory.exists():
            shutil.rmtree(directory, ignore_errors=True)
            deleted.append(directory)
    if shard:
        with contextlib.suppress(OSError):  # only when empty: other ranks' shards may stay
            os.rmdir(path)
    return deleted


def prune_checkpoints(output: Path, keep: int, shard: dict | None = None) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints (with ``shard``, of this
    rank's shards); returns what was deleted. Called after a save completed (on every
    rank), so the newest is never at risk."""
    deleted = []
    for _, path in complete_checkpoints(output, shard)[keep:]:
        deleted += remove_checkpoint(path, shard)
    return deleted


def _old(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def changed_options(saved: Mapping[str, Any], now: TrainOptions) -> dict[str, tuple[Any, Any]]:
    """Options whose value differs from ``saved`` (a :meth:`TrainOptions.run_record`; an
    option newer than it counts as its default there): ``{name: (saved, now)}``."""
    current, before = now.run_record(), saved_state_options(saved)
    before = {k: before.get(k, BY_KEY[k].default) for k in current}  # older: the defaults
    return {k: (before[k], v) for k, v in current.items() if before[k] != v}


def saved_state_options(saved: Mapping[str, Any]) -> dict[str, Any]:
    """``saved`` (a :meth:`TrainOptions.run_record`) with the :data:`STATE_KEYS` of its
    mode that it lacks (an older roundpipe's, which had only the defaults) filled."""
    skip = LORA_ONLY if saved.get("full") else FULL_ONLY
    filled = {k: BY_KEY[k].default for k in STATE_KEYS if k not in skip}
    return {**filled, **saved}
