"""The run's record in ``--output``: ``metrics.jsonl`` (one JSON object per step) and
``loss.png`` (training and evaluation loss against the step, and the learning rate)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class MetricsLog:
    """``metrics.jsonl``: appended one line per step, flushed at once, so a reader (or a
    crash) sees whole lines only."""

    def __init__(self, path: Path, write: bool = True) -> None:
        self.path = Path(path)
        self.write = write
        """False: reading only, every write skipped (the ranks other than 0)."""

    def records(self) -> list[dict[str, Any]]:
        """Every complete line (a torn last line, left by a kill, is skipped)."""
        if not self.path.exists():
            return []
        records = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
        return records

    def keep_until(self, step: int) -> list[dict[str, Any]]:
        """Drop the lines after ``step`` (written after the checkpoint a run resumes from)
        and return the rest; rewritten atomically."""
        kept = [r for r in self.records() if r["step"] <= step]
        self._write(kept)
        return kept

    def start_fresh(self) -> None:
        self._write([])

    def append(self, record: dict[str, Any]) -> None:
        if not self.write:
            return
        with open(self.path, "a") as file:
            file.write(json.dumps(record) + "\n")
            file.flush()

    def _write(self, records: Iterable[dict[str, Any]]) -> None:
        if not self.write:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, self.path)


class PendingRows:
    """Rows of ``metrics.jsonl`` waiting for their step's gradient norm: asynchronous
    steps run behind the loop, so step N's row is complete only once step N's step
    function has measured it (``norm_of(N)``, None until then). Rows leave in order."""

    def __init__(self, norm_of: Callable[[int], float | None]) -> None:
        self.norm_of = norm_of
        self.rows: list[dict[str, Any]] = []

    def add(self, record: dict[str, Any]) -> None:
        self.rows.append(record)

    def ready(self, every: bool = False) -> list[dict[str, Any]]:
        """The rows whose norm is in, each with its ``grad_norm`` after ``lr``; with
        ``every``, all of them (``grad_norm`` None where a norm is missing)."""
        done = []
        while self.rows:
            norm = self.norm_of(self.rows[0]["step"])
            if norm is None and not every:
                break
            row = self.rows.pop(0)
            position = list(row).index("lr") + 1
            items = list(row.items())
            done.append(dict([*items[:position], ("grad_norm", norm), *items[position:]]))
        return done


def plot_available() -> bool:
    """Whether matplotlib is installed: without it no ``loss.png`` is drawn (the run
    says so once, at its start)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_losses(records: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """:func:`loss_figure` as a PNG (matplotlib's Agg backend; written atomically); nothing
    without matplotlib (:func:`plot_available`)."""
    if not plot_available():
        return
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure = loss_figure(records, title)
    try:
        tmp = Path(path).with_name(Path(path).name + ".tmp.png")
        figure.savefig(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(figure)


def loss_figure(records: list[dict[str, Any]], title: str = ""):
    """Training loss (and evaluation loss where measured) against the step on a log
    scale, titled ``title`` (the run), and the learning rate below it."""
    from matplotlib import pyplot as plt

    figure, (losses, rates) = plt.subplots(
        2, 1, figsize=(7, 5), dpi=100, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    steps = [r["step"] for r in records]
    losses.plot(steps, [r["loss"] for r in records], label="training loss", linewidth=1)
    evaluated = [r for r in records if r.get("eval_loss") is not None]
    if evaluated:
        eval_steps = [r["step"] for r in evaluated]
        eval_losses = [r["eval_loss"] for r in evaluated]
        losses.plot(eval_steps, eval_losses, "o-", label="eval loss")
    if all(r["loss"] > 0 for r in records) and all(r["eval_loss"] > 0 for r in evaluated):
        losses.set_yscale("log")
    losses.set_ylabel("loss (mean per token)")
    losses.set_title(title)
    losses.grid(alpha=0.3, which="both")
    losses.legend()
    rates.plot(steps, [r.get("lr", float("nan")) for r in records], linewidth=1, color="C2")
    rates.set_xlabel("step")
    rates.set_ylabel("learning rate")
    rates.grid(alpha=0.3)
    figure.tight_layout()
    return figure
