"""A full disk while ``roundpipe train`` writes: inside :func:`writing`, the error (an
``OSError`` with ENOSPC or EDQUOT, or safetensors' report of one) becomes
:class:`NoSpace`, one line naming the path, about how much it needed and how much is
free (docs/design.md#a-full-disk)."""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import error_chain

SMALL_FILE = 4096  # a small file takes a block of the filesystem
_FULL = (errno.ENOSPC, errno.EDQUOT)
_REPORTED = re.compile(rf"os error ({'|'.join(map(str, _FULL))})\b")  # safetensors' words


class NoSpace(RuntimeError):
    """The disk (or the quota) is full: the message is the line to show."""


@contextmanager
def writing(path: Path, needed: int, then: str) -> Iterator[None]:
    """Raise :class:`NoSpace` if what runs inside fails for want of space at ``path``,
    which needs about ``needed`` bytes; ``then`` says what to do next."""
    try:
        yield
    except Exception as error:
        if not disk_full(error):
            raise
        raise NoSpace(
            f"no space left for {path}: it needs about {_size(needed)} and "
            f"{free_space(path)} are free there; free some space, then {then}"
        ) from error


def disk_full(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from, is a full disk or quota."""
    return any(
        (isinstance(each, OSError) and each.errno in _FULL) or _REPORTED.search(str(each))
        for each in error_chain(error)
    )


def free_space(path: Path) -> str:
    """The free space of the filesystem ``path`` is (or would be) on, in words."""
    return _size(shutil.disk_usage(_existing(Path(path))).free)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _size(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} bytes"
