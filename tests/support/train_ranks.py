"""Start ``roundpipe train`` as several local processes, as ``torchrun`` would.

:func:`start_ranks` starts one process per rank with the variables ``torchrun`` sets
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``), each with
its own command line, stdout and stderr (so a test can give every rank its own
``--output``: machines that share no filesystem). :func:`torchrun` goes through the
real launcher (``python -m torch.distributed.run``), whose output merges the ranks'.
:func:`start_a_long_run` and :func:`assert_stopped_with_their_shards` serve the tests
that stop a run with a signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from support.multinode import finish, free_port

REPO = Path(__file__).resolve().parents[2]  # tests/support/train_ranks.py
LIMIT_S = 240


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    env.update(extra or {})
    return env


def start_ranks(
    world: int, args_of: Callable[[int], Sequence[object]], **popen
) -> list[subprocess.Popen]:
    """``roundpipe train *args_of(rank)`` on ranks 0..world-1, started together."""
    port = str(free_port())
    processes = []
    for rank in range(world):
        env = _env(
            {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
             "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
        )  # fmt: skip
        command = [sys.executable, "-m", "roundpipe", "train", *map(str, args_of(rank))]
        processes.append(
            subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=REPO,
                **popen,
            )  # fmt: skip
        )
    return processes


def run_ranks(world: int, args_of: Callable[[int], Sequence[object]], timeout: float = 180):
    return finish(start_ranks(world, args_of), timeout)


def single(*args: object) -> subprocess.Popen:
    """``roundpipe train *args`` as one plain process."""
    command = [sys.executable, "-m", "roundpipe", "train", *map(str, args)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=REPO)  # fmt: skip


def torchrun(nproc: int, *args: object) -> subprocess.Popen:
    """``torchrun --nproc-per-node nproc -m roundpipe train *args`` on this machine."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        "-m",
        "roundpipe",
        "train",
        *map(str, args),
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=REPO)  # fmt: skip


def metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def wait_for_steps(output: Path, steps: int, processes) -> None:
    """Until ``output/metrics.jsonl`` holds ``steps`` lines (every process still running)."""
    deadline = time.monotonic() + LIMIT_S
    path = output / "metrics.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) >= steps):
        assert all(p.poll() is None for p in processes), finish(processes, 10)
        assert time.monotonic() < deadline
        time.sleep(0.05)


def start_a_long_run(args: Sequence[object], tmp_path: Path) -> list[subprocess.Popen]:
    """Two ranks on ``args`` (a run of many steps, with a checkpoint only at every
    1000th), each with its own output under ``tmp_path`` and SIGINT left to Python,
    once rank 0 logged 3 steps."""

    def args_of(rank: int) -> list:
        return [*args, "--save-every", 1000, "--output", tmp_path / f"rank{rank}"]

    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    processes = start_ranks(2, args_of, preexec_fn=default_sigint)
    wait_for_steps(tmp_path / "rank0", 3, processes)
    return processes


def assert_stopped_with_their_shards(done, tmp_path: Path, code: int) -> int:
    """Both ranks exited with ``code``, each with only its shard of the last step's
    checkpoint; returns that step."""
    assert [d.returncode for d in done] == [code, code], [d.stderr for d in done]
    step = metrics(tmp_path / "rank0")[-1]["step"]
    for rank in (0, 1):
        shards = sorted((tmp_path / f"rank{rank}" / "checkpoints").glob("step-*/rank*"))
        assert [p.relative_to(tmp_path / f"rank{rank}" / "checkpoints") for p in shards] == [
            Path(f"step-{step}") / f"rank{rank}-of-2"
        ]
    return step
