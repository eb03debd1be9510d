"""This machine's host RAM, read from the system: what is installed (``roundpipe
simulate``'s default ``--host-ram``) and what this process may still allocate
(``roundpipe train``'s memory check, docs/design.md#the-memory-check).

What a process may still allocate is the least of three rooms: the kernel's estimate of
memory available without swapping (``MemAvailable``), the room under every cgroup
memory limit above the process (v2 ``memory.max`` less what the group uses; v1
``memory.limit_in_bytes`` less ``memory.usage_in_bytes``; page cache the kernel can
drop, ``inactive_file``, not counted as used) and the address space ``RLIMIT_AS``
leaves (the limit less the process's virtual size).
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")

AVAILABLE = "the memory available"
CGROUP = "the cgroup's memory limit"
ADDRESS_SPACE = "the address-space limit, RLIMIT_AS"


@dataclass(frozen=True)
class Room:
    """Bytes this process may still allocate, and what bounds them (one of
    :data:`AVAILABLE`, :data:`CGROUP`, :data:`ADDRESS_SPACE`)."""

    bytes: int
    bound: str


def installed_ram() -> int | None:
    """This machine's physical RAM in bytes (``None`` where neither sysconf nor
    /proc/meminfo tells)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        pass
    return _kilobytes(PROC / "meminfo").get("MemTotal")


def usable_ram(
    proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT, address_limit: int | None = None
) -> Room | None:
    """The least room this process has (see the module docstring); ``None`` where the
    system tells none. ``address_limit`` stands for ``RLIMIT_AS``'s soft limit (read
    from the process when not given; ``resource.RLIM_INFINITY``: none)."""
    if address_limit is None:
        address_limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    rooms = []
    available = _kilobytes(proc / "meminfo").get("MemAvailable")
    if available is not None:
        rooms.append(Room(available, AVAILABLE))
    cgroup = cgroup_room(proc / "self" / "cgroup", cgroup_root)
    if cgroup is not None:
        rooms.append(Room(cgroup, CGROUP))
    if address_limit != resource.RLIM_INFINITY:
        used = _kilobytes(proc / "self" / "status").get("VmSize", 0)
        rooms.append(Room(max(address_limit - used, 0), ADDRESS_SPACE))
    return min(rooms, key=lambda room: room.bytes, default=None)


def cgroup_room(membership: Path, root: Path) -> int | None:
    """The least room under the memory limits of the cgroups ``membership`` (a
    ``/proc/<pid>/cgroup`` file) names, from the process's group up to ``root``;
    ``None`` without a limit."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            rooms += _rooms(root, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own
            rooms += _rooms(
                root / "memory",
                path,
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            )
    return min(rooms, default=None)


def _rooms(root: Path, path: str, limit_file: str, usage_file: str, reclaimable: str) -> list:
    """The room under each limit from the group at ``path`` up to ``root`` (a group's
    usage includes its children's)."""
    group = root / path.strip("/")
    rooms = []
    while True:
        limit, usage = _number(group / limit_file), _number(group / usage_file)
        if limit is not None and usage is not None and limit < 2**62:  # v1 writes ~2**63
            cache = _fields(group / "memory.stat").get(reclaimable, 0)
            rooms.append(max(limit - (usage - cache), 0))
        if group == root or root not in group.parents:
            return rooms
        group = group.parent


def _number(path: Path) -> int | None:
    """A cgroup file's one number (``None`` where it is missing or says ``max``)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _fields(path: Path) -> dict[str, int]:
    """``name value`` lines (``memory.stat``)."""
    found = {}
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if value.strip().isdigit():
                found[name] = int(value)
    except OSError:
        pass
    return found


def _kilobytes(path: Path) -> dict[str, int]:
    """``Name:  123 kB`` lines (``/proc/meminfo``, ``/proc/self/status``), in bytes."""
    found = {}
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(":")
            parts = value.split()
            if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
                found[name] = int(parts[0]) * 1024
    except OSError:
        pass
    return found
