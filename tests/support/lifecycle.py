"""The small model the lifecycle tests drive (``test_close_and_exit.py``,
``test_concurrency.py``), and the threads roundpipe has started."""

from __future__ import annotations

import threading
from typing import Any

from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig
from support.oracle import mlp

LIMIT_S = 15.0  # for each wait under ``run_within``
DEPTH = 4
NUM_MICROBATCH = 3
CONFIG = RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH)


def architecture() -> nn.Module:
    return mlp(depth=DEPTH)


def new_model(**options: Any) -> RoundPipe:
    """:func:`architecture` on two emulated devices under :data:`CONFIG`."""
    return RoundPipe(architecture(), devices="emulated:2", model_run_config=CONFIG, **options)


def roundpipe_threads(before: set[threading.Thread]) -> list[str]:
    """Names of the live threads started since ``before`` by roundpipe."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t not in before and t.is_alive() and t.name.startswith("roundpipe")
    )
