"""Transformers and peft without the output a ``roundpipe train`` user can do nothing
about: progress bars while loading or writing weights, the FutureWarnings peft
triggers by calling APIs transformers deprecates, and what torchao logs when peft
imports it (its CUDA-only extensions failing to load on a CPU machine)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes")
"""Loggers whose warnings at import time only say that torchao's CUDA extensions are
absent here, that torch deprecates a registration torchao makes, or that bitsandbytes
found no optional CPU kernel package (peft imports bitsandbytes when it is installed)."""


def quiet_imports() -> None:
    """For the commands' processes (they own their logging): only errors from
    :data:`QUIET_LOGGERS`. peft imports torchao whenever it is installed."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
