"""What ``roundpipe train`` shows while it runs: one live bar on a terminal, plain lines
elsewhere.

On a terminal the bar is tqdm's (or rich's where tqdm is missing); when stdout is not a
terminal a plain line every few steps keeps a log to about a hundred lines per run.
Messages printed through :meth:`Progress.message` never tear the bar.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

PLAIN_LINES_PER_RUN = 100


@dataclass(frozen=True)
class StepReport:
    """What the bar shows after one step."""

    step: int
    loss: float
    lr: float
    tokens_per_s: float
    eval_loss: float | None = None
    epoch: float | None = None  # shown for an --epochs run
    extra: str = ""  # a preference step's reward margin and accuracy, or KL


def describe(report: StepReport, total: int) -> str:
    """``step 12/100  loss 2.3456  lr 2.00e-04  1234 tok/s`` (after ``epoch 0.25`` in an
    epoch run, and with the eval loss)."""
    epoch = "" if report.epoch is None else f"epoch {report.epoch:.2f}  "
    text = (
        f"{epoch}step {report.step}/{total}  loss {report.loss:.4f}  lr {report.lr:.2e}  "
        f"{report.tokens_per_s:.0f} tok/s"
    )
    if report.extra:
        text += f"  {report.extra}"
    if report.eval_loss is not None:
        text += f"  eval loss {report.eval_loss:.4f}"
    return text


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Steps ``initial + 1 .. total`` as they finish (plain lines; see :func:`open_progress`)."""

    def __init__(self, total: int, initial: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.initial = initial
        self.stream = stream or sys.stdout
        self.every = max(1, (total - initial) // PLAIN_LINES_PER_RUN)
        self.started = time.monotonic()

    def update(self, report: StepReport) -> None:
        due = report.step % self.every == 0 or report.step in (self.initial + 1, self.total)
        if due or report.eval_loss is not None:
            self.message(
                f"{describe(report, self.total)}  eta {format_duration(self.eta(report.step))}"
            )

    def eta(self, step: int) -> float:
        done = step - self.initial
        elapsed = time.monotonic() - self.started
        return elapsed / done * (self.total - step) if done > 0 else 0.0

    def message(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        pass


class Silent(Progress):
    """No output (the ranks other than 0 under ``torchrun``)."""

    def __init__(self) -> None:
        super().__init__(total=0, initial=0)

    def update(self, report: StepReport) -> None:
        pass

    def message(self, text: str) -> None:
        pass


class TqdmProgress(Progress):
    def __init__(self, total: int, initial: int, stream: TextIO | None = None) -> None:
        from tqdm import tqdm

        super().__init__(total, initial, stream)
        self._bar = tqdm(
            total=total, initial=initial, unit="step", dynamic_ncols=True, file=self.stream
        )

    def update(self, report: StepReport) -> None:
        postfix = {"loss": f"{report.loss:.4f}", "tok/s": f"{report.tokens_per_s:.0f}"}
        if report.epoch is not None:
            postfix = {"epoch": f"{report.epoch:.2f}", **postfix}
        if report.eval_loss is not None:
            postfix["eval"] = f"{report.eval_loss:.4f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(report.step - self._bar.n)
        if report.eval_loss is not None:  # kept above the bar
            self.message(describe(report, self.total))

    def message(self, text: str) -> None:
        self._bar.write(text, file=self.stream)

    def close(self) -> None:
        self._bar.close()


class RichProgress(Progress):
    def __init__(self, total: int, initial: int, stream: TextIO | None = None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichBar

        super().__init__(total, initial, stream)
        self._bar = RichBar(
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
            console=Console(file=self.stream),
        )
        self._task = self._bar.add_task("train", total=total, completed=initial, status="")
        self._bar.start()

    def update(self, report: StepReport) -> None:
        status = f"loss {report.loss:.4f}  {report.tokens_per_s:.0f} tok/s"
        if report.epoch is not None:
            status = f"epoch {report.epoch:.2f}  {status}"
        if report.eval_loss is not None:
            status += f"  eval {report.eval_loss:.4f}"
        self._bar.update(self._task, completed=report.step, status=status)
        if report.eval_loss is not None:
            self.message(describe(report, self.total))

    def message(self, text: str) -> None:
        self._bar.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        self._bar.stop()


def open_progress(total: int, initial: int, stream: TextIO | None = None) -> Progress:
    """A live bar when ``stream`` (stdout) is a terminal and tqdm or rich is installed,
    else plain lines."""
    stream = stream or sys.stdout
    if stream.isatty():
        for kind in (TqdmProgress, RichProgress):
            try:
                return kind(total, initial, stream)
            except ImportError:
                continue
    return Progress(total, initial, stream)
