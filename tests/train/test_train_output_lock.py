"""``roundpipe train`` holds ``--output`` for the whole run: a second run into the same
directory exits 2 naming the first (its pid) and changes nothing there; the lock is
the kernel's, so it goes with its process, however that ends."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from support.train_cli import COMMON, RUN_LIMIT_S, metrics, run_train, train_process  # noqa: E402


def args(train_files, output: Path, steps: int) -> list:
    return ["--model", train_files["model"], "--data", train_files["text"], "--output", output,
            *COMMON, "--steps", steps]  # fmt: skip


def start_a_long_run(train_files, output: Path):
    """A run of many steps into ``output``, once it logged 3 of them."""
    process = train_process(*args(train_files, output, 5000))
    deadline = time.monotonic() + RUN_LIMIT_S
    while not ((output / "metrics.jsonl").exists() and len(metrics(output)) >= 3):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    return process


def test_a_second_run_into_the_same_output_exits_2_naming_the_first(train_files, tmp_path):
    first = start_a_long_run(train_files, tmp_path)
    try:
        logged = len(metrics(tmp_path))
        second = run_train(*args(train_files, tmp_path, 2))
        assert second.returncode == 2, second.stderr
        assert f"in use by another roundpipe train (pid {first.pid}" in second.stderr
        assert len(second.stderr.splitlines()) == 1, second.stderr
        records = metrics(tmp_path)
        assert [r["step"] for r in records] == list(range(1, len(records) + 1))
        assert len(records) >= logged  # the first run's lines, kept and continued
    finally:
        first.kill()
        first.communicate()


def test_the_lock_goes_with_a_killed_run(train_files, tmp_path):
    first = start_a_long_run(train_files, tmp_path)
    os.kill(first.pid, signal.SIGKILL)
    first.communicate()
    second = run_train(*args(train_files, tmp_path, 2))
    assert second.returncode == 0, second.stderr
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]
