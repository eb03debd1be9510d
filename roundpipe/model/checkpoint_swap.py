"""Where a checkpoint lives while it is written and replaced.

A save writes into a temporary directory beside its path, then, holding the lock
beside it, swaps it in, keeping the previous checkpoint at ``<path>.old`` until every
rank has swapped (:func:`commit`). Only RoundPipe checkpoints are ever replaced or
removed (docs/design.md#checkpoints).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import socket
import stat
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

from . import checkpoint_files as files

# A filesystem that cannot lock (flock) makes saves take no turns, with a warning.
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}
# In a temporary directory's name, before the pid of the process writing it.
_TEMPORARY = f".tmp-{socket.gethostname()}-"


def old(path: Path) -> Path:
    """Where the previous checkpoint stays while a save replaces ``path``."""
    return path.with_name(f"{path.name}.old")


def held_ids(path: Path) -> tuple[int, int]:
    """The save ids of the complete checkpoints at ``path`` and at ``path.old`` (0:
    none)."""
    return _id(path), _id(old(path))


def check_replaceable(path: Path) -> None:
    """Refuse to save to ``path`` where that would delete something not ours (under the
    lock: other savers change what is there only while holding it)."""
    if not path.parent.is_dir():
        return  # nothing there yet
    with _locked(path):
        _check_replaceable(path)


def _check_replaceable(path: Path) -> None:
    for place in (path, old(path)):
        try:
            mode = os.lstat(place).st_mode
        except FileNotFoundError:
            continue  # nothing there (or another saver just removed it)
        if not stat.S_ISDIR(mode):
            raise FileExistsError(
                f"save_checkpoint: {place} exists and is not a directory; a checkpoint "
                "is a directory that would replace it: save to another path"
            )
        if not _ours(place):
            raise FileExistsError(_foreign(place))


def temporary(path: Path) -> Path:
    """A new directory beside ``path`` to write the next checkpoint into, named for this
    host and process (so that a later save knows it abandoned once they are gone)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=_temporary_prefix(path), dir=path.parent))


def discard(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def swap_in(tmp: Path, path: Path, keep: int) -> None:
    """Rename ``tmp`` to ``path``. The complete checkpoint of save ``keep`` (the newest
    every rank holds; 0, or gone meanwhile: the newest complete one here) stays at
    ``path.old`` until :func:`commit`; whatever else of ours is there goes."""
    previous = old(path)
    with _locked(path):
        at, before = held_ids(path)  # again: another process may have saved meanwhile
        if not keep or keep not in (at, before):
            keep = at or before
        if at and at == keep:
            _remove(previous)
            os.replace(path, previous)
        else:
            _remove(path)
            if before != keep:
                _remove(previous)
        os.replace(tmp, path)
        _sync(path.parent)
        _remove_abandoned(path.parent)


def commit(path: Path) -> None:
    """The save at ``path`` is in place on every rank: the previous checkpoint goes."""
    with _locked(path):
        _remove(old(path))


def existing_checkpoint(path: Path, shard: dict | None = None) -> Path:
    """``path``, or ``path.old`` where a save was killed between its two renames."""
    for place in (path, old(path)):
        if (place / "state.json").is_file():
            return place
    root = path.parent if shard else path
    shards = sorted(p.name for p in root.glob("rank*-of-*")) if root.is_dir() else []
    if shards:
        raise FileNotFoundError(
            f"no checkpoint at {path}: {root} holds shards {shards} of a save by several "
            "nodes; load it with that number of nodes"
        )
    if shard and (root / "state.json").is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: {root} was saved by one node")
    raise FileNotFoundError(f"no checkpoint at {path} (no state.json)")


# -- ours, or not ------------------------------------------------------------------------


def _id(directory: Path) -> int:
    try:
        return files.saved_id(files.read_state(directory))
    except (OSError, ValueError):
        return 0


def _ours(directory: Path) -> bool:
    """A directory of checkpoint files only, with the state of a RoundPipe checkpoint or
    none (a removal cut short; an empty directory): replacing it loses nothing. Checked
    outside the lock it may be going away under another saver: what vanished while it
    was looked at was ours."""
    try:
        entries = set(os.listdir(directory))
    except FileNotFoundError:
        return True
    if not entries <= files.NAMES or "state.json" not in entries:
        return entries <= files.NAMES
    return _id(directory) != 0 or not (directory / "state.json").exists()


def _foreign(directory: Path) -> str:
    entries = sorted(os.listdir(directory))
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    return (
        f"save_checkpoint: {directory} is not a RoundPipe checkpoint (it holds {shown}); "
        "saving there would delete it: save to another path, or move it away"
    )


def _remove(directory: Path) -> None:
    if not directory.exists():
        return
    if not _ours(directory):  # it changed since the save checked it
        raise FileExistsError(_foreign(directory))
    # state.json first: a removal cut short leaves no directory that looks complete
    with contextlib.suppress(FileNotFoundError):
        (directory / "state.json").unlink()
    shutil.rmtree(directory)


def _temporary_prefix(path: Path) -> str:
    return f"{path.name}{_TEMPORARY}{os.getpid()}-"


def _remove_abandoned(parent: Path) -> None:
    """The temporary directories in ``parent`` (of any checkpoint) of saves on this
    host whose process is gone (killed while writing). Another host's are left alone:
    its processes cannot be seen; so is any directory of other files."""
    for name in os.listdir(parent):
        _, found, rest = name.partition(_TEMPORARY)
        pid = rest.split("-", 1)[0]
        if found and pid.isdigit() and not _alive(int(pid)) and _ours_or_gone(parent / name):
            shutil.rmtree(parent / name, ignore_errors=True)


def _ours_or_gone(directory: Path) -> bool:
    try:
        return directory.is_dir() and _ours(directory)
    except FileNotFoundError:  # removed meanwhile by another save's cleanup
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the lock ----------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold ``<path>.lock``: one process at a time swaps at ``path``. The lock (flock) is
    the kernel's: it dies with its process. The file is removed on release; a waiter
    that got the lock of a removed file takes the new one instead."""
    lock = path.with_name(f"{path.name}.lock")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                break
        except FileNotFoundError:
            pass  # removed by the holder we waited for
        except OSError as error:
            if error.errno not in _NO_LOCKS:
                os.close(fd)
                raise
            warnings.warn(
                f"save_checkpoint: cannot lock {lock} ({error.strerror}): this filesystem "
                "has no file locks, so saves to one path at once must be avoided",
                RuntimeWarning,
                stacklevel=4,
            )
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)  # while held: who waits on this file then retries
        os.close(fd)


def _sync(directory: Path) -> None:
    """Make the renames in ``directory`` durable (where the filesystem can)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
