"""The lock a run holds on ``--output`` from its first write to its exit: ``flock`` on
``run.lock`` there (rank r > 0 of a ``torchrun`` launch: ``run.rank<r>.lock``, as the
ranks may share the directory). The kernel releases it when the process ends, however
it ends, so no lock outlives its run; the file holds the holder's pid and host for the
message of a run that finds it taken (docs/design.md#the-output-lock).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .options import UsageError
from .ranks import Ranks

LOCK_FILE = "run.lock"


def lock_path(output: Path, rank: int) -> Path:
    return Path(output) / (LOCK_FILE if rank == 0 else f"run.rank{rank}.lock")


@contextmanager
def holding(output: Path, ranks: Ranks | None = None) -> Iterator[None]:
    """Hold ``output`` (creating it) until the block ends; a :class:`UsageError` naming
    the holder when another run holds it. Under ``torchrun`` the ranks agree: if one
    cannot take its lock, none goes on."""
    ranks = ranks or Ranks()
    taken: list[int] = []
    try:
        ranks.agree(lambda: taken.append(_take(lock_path(output, ranks.rank))), "the lock")
        yield
    finally:
        for fd in taken:
            os.close(fd)  # releases the lock; the file stays (deleting it would race)


def _take(path: Path) -> int:
    output = path.parent
    if output.exists() and not output.is_dir():
        raise UsageError(
            f"--output {output} is a file, not a directory: choose a new directory or "
            "that of an earlier run"
        )
    try:
        output.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise UsageError(
            f"--output {output}: cannot create {path.name} ({error.strerror})"
        ) from error
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "pid not written yet"
        os.close(fd)
        raise UsageError(
            f"--output {output} is in use by another roundpipe train ({holder}): wait for "
            "it to end or stop it, or choose another --output"
        ) from None
    except OSError as error:
        os.close(fd)
        raise UsageError(
            f"--output {output}: cannot lock {path.name} ({error.strerror}); roundpipe train "
            "needs a filesystem with flock there, so that two runs never write one directory"
        ) from error
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode(), 0)
    except OSError as error:  # a full disk
        os.close(fd)
        raise UsageError(
            f"--output {output}: cannot write {path.name} ({error.strerror})"
        ) from error
    return fd
