"""Errors raised to the caller, naming where in the pipeline something failed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_OOM_ADVICE = (
    "Try more microbatches (RoundPipeRunConfig(num_microbatch=...)), a plan with smaller "
    "stages (execute_plan=...), recompute_grain='layer', or more device memory."
)


class RoundPipeError(RuntimeError):
    """Something failed inside the pipeline; the original exception is chained."""


_subclass_cache: dict[type, type] = {}


def _located_type(original: type[BaseException]) -> type[BaseException]:
    """A subclass of both :class:`RoundPipeError` and ``original``, so ``except`` keeps working."""
    if issubclass(original, RoundPipeError):
        return original
    if original not in _subclass_cache:
        try:
            located = type(f"RoundPipe{original.__name__}", (RoundPipeError, original), {})
            located(  # check it can be built from a message alone
                "probe"
            )
        except TypeError:
            located = RoundPipeError
        _subclass_cache[original] = located
    return _subclass_cache[original]


def locate(exc: BaseException, where: str) -> BaseException:
    """Return an exception that says ``where`` it happened, keeping ``exc``'s type if possible."""
    if isinstance(exc, RoundPipeError) and getattr(exc, "located", False):
        return exc
    if isinstance(exc, torch.OutOfMemoryError):
        located: BaseException = torch.OutOfMemoryError(f"{where}: {exc}. {_OOM_ADVICE}")
    elif isinstance(exc, Exception):
        located = _located_type(type(exc))(f"{where}: {type(exc).__name__}: {exc}")
    else:
        return exc  # KeyboardInterrupt, SystemExit: pass through untouched
    located.located = True  # type: ignore[attr-defined]
    located.__cause__ = exc
    return located


@contextlib.contextmanager
def failure_site(where: str) -> Iterator[None]:
    """Re-raise any exception from the block as one that names ``where``."""
    try:
        yield
    except BaseException as exc:
        located = locate(exc, where)
        if located is exc:
            raise
        raise located from exc
