"""``--report-to``: each step's metrics also go to TensorBoard, Weights & Biases or
Trackio, through the libraries themselves (the optional extras of the same names).

Rank 0 alone logs. The names are those ``transformers``' integrations log a Trainer
run's under, so the curves of both line up: ``train/loss``, ``train/learning_rate``,
``train/grad_norm``, ``eval/loss``, and ``train/<key>`` for the rest of a
``metrics.jsonl`` row. TensorBoard writes into ``<output>/runs`` (a resumed run adds
an event file there: one run to TensorBoard); Weights & Biases into ``WANDB_DIR``, else
``<output>``, in project ``WANDB_PROJECT`` (default ``roundpipe``); Trackio into its own
store, in project ``TRACKIO_PROJECT`` (default ``roundpipe``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from ..errors import install_hint
from .usage import UsageError

TRACKERS = ("tensorboard", "wandb", "trackio")
TRACKER_MODULES = {"tensorboard": "torch.utils.tensorboard"}
"""What each tracker imports (the package's own name where not listed)."""
RUNS_DIR = "runs"
PROJECT = "roundpipe"
_HF_NAMES = {"lr": "learning_rate"}


class Tracker(Protocol):
    def log(self, step: int, metrics: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def check_trackers(names: list[str]) -> None:
    """Refuse an unknown name, then one whose package is not installed, so the answer
    does not depend on what is installed (every process of a torchrun launch checks:
    this runs before they join, though only rank 0 logs)."""
    for name in names:
        if name not in TRACKERS:
            raise UsageError(
                f"--report-to: unknown {name!r}; use none or a comma list of {', '.join(TRACKERS)}"
            )
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise UsageError(
                f"--report-to {name}: the {name} package is not installed: {install_hint(name)}"
            )
        try:
            importlib.import_module(TRACKER_MODULES.get(name, name))
        except Exception as error:  # noqa: BLE001 - a broken install, named in one line
            raise UsageError(
                f"--report-to {name}: the {name} package is installed but fails to import "
                f"({type(error).__name__}: {error}); reinstall it: {install_hint(name)}"
            ) from None


def tracked_names(metrics: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """A ``metrics.jsonl`` row's values under Trainer's names (the step left out)."""
    for key, value in metrics.items():
        if key == "step" or not isinstance(value, (int, float)):
            continue
        if key.startswith("eval_"):
            yield "eval/" + key[len("eval_") :], value
        else:
            yield "train/" + _HF_NAMES.get(key, key), value


class TensorBoard:
    def __init__(self, output: Path, resumed_from: int = 0) -> None:
        """``resumed_from``: the step of the checkpoint a resumed run continues from; the
        points logged after it by the interrupted run are purged (``purge_step``), as
        they are logged again."""
        from torch.utils.tensorboard import SummaryWriter

        purge = resumed_from + 1 if resumed_from else None
        self.writer = SummaryWriter(log_dir=str(Path(output) / RUNS_DIR), purge_step=purge)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for name, value in tracked_names(metrics):
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, output: Path, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            dir=os.environ.get("WANDB_DIR", str(output)),
            name=Path(output).name,
            config=config,
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log(dict(tracked_names(metrics)), step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio:
    def __init__(self, output: Path, config: dict[str, Any]) -> None:
        import trackio

        self.trackio = trackio
        trackio.init(
            project=os.environ.get("TRACKIO_PROJECT", PROJECT),
            name=Path(output).name,
            config=config,
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.trackio.log(dict(tracked_names(metrics)), step=step)

    def close(self) -> None:
        self.trackio.finish()


class Trackers:
    """The trackers of a run as one: each row goes to every one; closing closes all,
    also when one of them fails to (its error raised after)."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def close(self) -> None:
        errors = []
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as error:  # noqa: BLE001 - the others still close; raised below
                errors.append(error)
        self.trackers = []
        if errors:
            raise errors[0]


def open_trackers(
    names: list[str],
    output: Path,
    config: dict[str, Any],
    main: bool = True,
    resumed_from: int = 0,
) -> Trackers:
    """The trackers ``names`` (``--report-to``) of a run into ``output`` with the
    options ``config`` (``run.yaml``'s record); none but on rank 0 (``main``).
    ``resumed_from``: the checkpoint's step a resumed run starts after."""
    if not main:
        return Trackers([])
    check_trackers(names)
    opened: list[Tracker] = []
    try:
        for name in names:
            if name == "tensorboard":
                opened.append(TensorBoard(output, resumed_from))
            elif name == "wandb":
                opened.append(Wandb(output, config))
            else:
                opened.append(Trackio(output, config))
    except BaseException:
        Trackers(opened).close()
        raise
    return Trackers(opened)
