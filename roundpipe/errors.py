"""Errors raised to the caller, naming where in the pipeline something failed
(docs/design.md#errors)."""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Iterator
from typing import Literal

import torch

_OOM_ADVICE = (
    "Try more microbatches (RoundPipeRunConfig(num_microbatch=...)), a plan with smaller "
    "stages (execute_plan=...), recompute_grain='layer', or more device memory."
)


_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")

DISTRIBUTION = "roundpipe-ft"
"""Our name on the package index: ``roundpipe`` there is the RoundPipe paper authors'
library, another API, which installs the same ``roundpipe`` import package."""


def error_chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error``, then the errors it was raised from or while handling (``__cause__``,
    else ``__context__``), each once."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def install_hint(extra: str) -> str:
    """How to install the optional packages of ``extra``, from the package index or from a
    checkout: every "needs X" message ends with it."""
    return f"pip install '{DISTRIBUTION}[{extra}]' (from a checkout: pip install -e '.[{extra}]')"


def one_line_usage_errors(parser: argparse.ArgumentParser) -> None:
    """Make the subcommand ``parser`` report bad usage as ``<prog>: error: <message>``
    and ``see <prog> --help`` (exit code 2) instead of its usage block, arguments it
    does not know included (argparse leaves those to the top-level parser)."""

    def error(message: str):
        parser.exit(2, f"{parser.prog}: error: {message}\nsee {parser.prog} --help\n")

    parse_known_args = parser.parse_known_args

    def checked(args=None, namespace=None):
        namespace, extras = parse_known_args(args, namespace)
        if extras:
            error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    parser.error = error  # type: ignore[method-assign]
    parser.parse_known_args = checked  # type: ignore[method-assign]


def format_bytes(nbytes: float) -> str:
    """``nbytes`` for people: ``"576 B"``, ``"1.50 KiB"``, ``"118 MiB"`` (3 significant digits).

    Every message that prints a size goes through here.
    """
    value = abs(float(nbytes))
    sign = "-" if nbytes < 0 else ""
    if value < 1024:
        return f"{sign}{value:.0f} B"
    for unit in _BYTE_UNITS:
        value /= 1024
        rounded = float(f"{value:.3g}")
        if rounded < 1024 or unit == _BYTE_UNITS[-1]:
            break
    decimals = 2 if rounded < 10 else 1 if rounded < 100 else 0
    return f"{sign}{rounded:.{decimals}f} {unit}"


class RoundPipeError(RuntimeError):
    """Something failed inside the pipeline; the original exception is chained."""


class MixedPoolDropoutError(ValueError):
    """On a pool of different GPUs, a layer drawing random numbers (dropout) would be
    recomputed on another kind of card than the one that ran its forward: CUDA's masks
    depend on the GPU model, so the gradients would be wrong (docs/design.md#mixed-pools)."""


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
    if getattr(exc, "located", False):  # an out-of-memory error is located but no RoundPipeError
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


def release_frames(error: BaseException | None) -> None:
    """Drop the local variables of the finished frames in the tracebacks of ``error``
    and of the exceptions chained to it (the executing ones are left alone).

    A kept error would otherwise keep every tensor those frames referenced alive, the
    device memory of the work that failed too (docs/design.md#errors). The tracebacks
    still say where it happened."""
    pending, seen = [error], set()
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending += [error.__cause__, error.__context__, *getattr(error, "exceptions", ())]


class failure_site:  # noqa: N801 - used like a function: ``with failure_site(...)``
    """Re-raise any exception from the block as one that names ``where``.

    A class, not a generator: a ``StopIteration`` raised in the block would turn
    into "generator raised StopIteration" inside a generator-based context manager.
    """

    def __init__(self, where: str) -> None:
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc: BaseException | None, traceback) -> Literal[False]:
        if exc is None:
            return False
        located = locate(exc, self.where)
        if located is exc:
            return False
        raise located from exc
