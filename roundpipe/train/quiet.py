"""Transformers and peft without the output a ``roundpipe train`` user can do nothing
about: progress bars while loading or writing weights, and the FutureWarnings peft
triggers by calling APIs transformers deprecates."""

from __future__ import annotations

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
