"""Start ``roundpipe train`` as several local processes, as ``torchrun`` would.

:func:`start_ranks` starts one process per rank with the variables ``torchrun`` sets
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``), each with
its own command line, stdout and stderr (so a test can give every rank its own
``--output``: machines that share no filesystem). :func:`torchrun` goes through the
real launcher (``python -m torch.distributed.run``), whose output merges the ranks'.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from support.multinode import finish, free_port

REPO = Path(__file__).resolve().parents[2]  # tests/support/train_ranks.py


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
