"""The process's resident memory, for the loading-memory children in this folder."""

from __future__ import annotations

import resource


def peak_rss() -> int:
    """The largest resident set so far (``getrusage``), in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    """The resident set now (``/proc/self/statm``), in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
