"""The checkpoints of a run: ``<output>/checkpoints/step-N``, which one ``--resume``
continues from, and which old ones to delete.

Each checkpoint is a :meth:`RoundPipe.save_checkpoint` directory whose ``extra`` holds
the run's position (:class:`Position`) and its options (``run.yaml``'s record). The
options that decide which parameters exist (:data:`~roundpipe.train.options.SHAPE_KEYS`)
must match for ``--resume``; others may change and are reported.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..checkpoint import existing_checkpoint
from .options import SHAPE_KEYS, TrainOptions, UsageError

CHECKPOINTS_DIR = "checkpoints"
_NAME = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class Position:
    """Where a run stands after ``step`` optimizer steps: the data order is a function
    of the step, so this is all a resumed run needs besides the weights."""

    step: int
    tokens: int
    elapsed_s: float


@dataclass(frozen=True)
class Found:
    """A checkpoint ``--resume`` can continue from."""

    path: Path
    position: Position
    options: dict[str, Any]


def checkpoint_path(output: Path, step: int) -> Path:
    return Path(output) / CHECKPOINTS_DIR / f"step-{step}"


def extra_record(position: Position, options: TrainOptions) -> dict[str, Any]:
    """The ``extra`` a checkpoint of this run carries."""
    return {"position": asdict(position), "options": options.run_record()}


def complete_checkpoints(output: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint directory in ``output`` with a ``state.json``
    (at ``step-N`` or, for a save killed between its renames, ``step-N.old``), newest
    first."""
    found: dict[int, Path] = {}
    root = Path(output) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    for entry in root.iterdir():
        name = entry.name.removesuffix(".old")
        match = _NAME.fullmatch(name)
        if match and (entry / "state.json").is_file():
            step = int(match.group(1))
            if step not in found or not entry.name.endswith(".old"):
                found[step] = root / name
    return sorted(found.items(), reverse=True)


def resumable_checkpoints(output: Path, options: TrainOptions) -> list[Found]:
    """The checkpoints in ``output`` whose state can be read, newest first, the newest
    checked against ``options``; :class:`UsageError` when there is none or it belongs to
    another model or adapter shape. (A checkpoint whose tensors then fail to load gives
    way to the next.)"""
    root = Path(output) / CHECKPOINTS_DIR
    candidates = complete_checkpoints(output)
    if not candidates:
        raise UsageError(
            f"--resume: no checkpoint in {root} to continue from (drop --resume to start a new run)"
        )
    found = []
    for step, path in candidates:
        try:
            state = existing_checkpoint(path) / "state.json"
            extra = json.loads(state.read_text()).get("extra") or {}
            position = Position(**extra["position"])
            saved = extra["options"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable (a damaged disk, a foreign directory): try an older one
        if position.step == step:
            found.append(Found(path, position, saved))
    if not found:
        raise UsageError(
            f"--resume: none of the {len(candidates)} checkpoints in {root} is readable"
        )
    _check_compatible(found[0].path, found[0].options, options)
    return found


def _check_compatible(path: Path, saved: dict[str, Any], options: TrainOptions) -> None:
    now = options.run_record()
    differ = [key for key in SHAPE_KEYS if saved.get(key) != now.get(key)]
    if differ:
        details = "; ".join(
            f"--{key.replace('_', '-')} {saved.get(key)!r} there, {now.get(key)!r} here"
            for key in differ
        )
        raise UsageError(
            f"--resume: {path} is a checkpoint of another model or adapter shape ({details}); "
            "resume with the same options or use another --output"
        )


def prune_checkpoints(output: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints; returns what was deleted.
    Called after a save completed, so the newest is never at risk."""
    deleted = []
    for _, path in complete_checkpoints(output)[keep:]:
        for directory in (path, path.with_name(path.name + ".old")):
            if directory.exists():
                shutil.rmtree(directory, ignore_errors=True)
                deleted.append(directory)
    return deleted
