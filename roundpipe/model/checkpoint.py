"""Full training-state checkpoints: ``RoundPipe.save_checkpoint`` / ``load_checkpoint``.

A run continues from a checkpoint exactly as the saved one would have. A save is all
or nothing: the previous checkpoint stays until the new one is complete (on several
nodes: on every rank, a two-phase commit); a load checks everything before it changes
anything. The files are :mod:`.checkpoint_files`, their directories
:mod:`.checkpoint_swap` (docs/design.md#checkpoints).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cluster.comm import PeerFailure
from . import checkpoint_files as files
from . import checkpoint_swap as swap
from .checkpoint_swap import existing_checkpoint
from .parts import PipeParts


class Checkpoints(PipeParts):
    """``save_checkpoint`` / ``load_checkpoint`` of :class:`~roundpipe.RoundPipe`."""

    def save_checkpoint(
        self, path, optimizer=None, lr_scheduler=None, grad_scaler=None, extra=None
    ) -> None:
        """Wait for queued work, then write everything a run needs to continue: weights,
        masters (and accumulated gradients), the state of ``optimizer``,
        ``lr_scheduler`` and ``grad_scaler``, the RNG states, and ``extra`` (anything
        JSON can hold, e.g. the data position). All or nothing (see
        :mod:`roundpipe.model.checkpoint`)."""
        with self.runtime.drained("save_checkpoint"):
            live = self._live_state()
            ranks = _Ranks.of(self.node)
            save(ranks, _absolute(path), live, optimizer, lr_scheduler, grad_scaler, extra)

    def load_checkpoint(self, path, optimizer=None, lr_scheduler=None, grad_scaler=None) -> Any:
        """Restore a :meth:`save_checkpoint` of this model (and the given optimizer,
        scheduler and scaler, built as when it was saved); returns its ``extra``. The run
        continues exactly as the saved one would have. A checkpoint that does not fit
        is refused before anything changes."""
        with self.runtime.drained("load_checkpoint"):
            live, ranks = self._live_state(), _Ranks.of(self.node)
            staged = load(ranks, _absolute(path), live, optimizer, lr_scheduler, grad_scaler)
            files.put(staged, live)
            self.runtime.adopt_written(staged.masters)  # the weights, then the masters' bits
        return staged.extra

    def _live_state(self) -> files.LiveState:
        buffers = list(self.model.named_buffers())
        return files.LiveState(self.runtime.store, self.pool, buffers, self.runtime.seeds)


def _absolute(path) -> Path:
    """``path`` made absolute, ``..`` and ``.`` resolved but not symbolic links: the
    directory beside which its temporary and previous copies go."""
    return Path(os.path.abspath(path))


def shard_path(path, shard: dict) -> Path:
    """Where rank ``shard["rank"]`` of ``shard["world"]`` keeps its part of ``path``."""
    return Path(path) / f"rank{shard['rank']}-of-{shard['world']}"


@dataclass(frozen=True)
class _Ranks:
    """The processes that save and load together: this one alone, or every rank."""

    comm: Any = None
    rank: int = 0
    world: int = 1

    @classmethod
    def of(cls, node) -> _Ranks:
        return cls() if node is None else cls(node.comm, node.rank, node.world)

    @property
    def shard(self) -> dict | None:
        return None if self.comm is None else {"rank": self.rank, "world": self.world}

    def place(self, path: Path) -> Path:
        shard = self.shard
        return path if shard is None else shard_path(path, shard)

    def gather(self, values: list[int], what: str) -> list[list[int]]:
        return [values] if self.comm is None else self.comm.gather_ints(values, what)

    def agree(self, error: Exception | None, what: str, doing: str) -> None:
        """Go on only if no rank failed: raise ``error`` here, and on the other ranks a
        :class:`PeerFailure` naming those that failed."""
        rows = self.gather([int(error is not None)], what)
        if error is not None:
            raise error
        failed = [rank for rank, row in enumerate(rows) if row[0]]
        if failed:
            raise PeerFailure(f"{doing} failed on rank(s) {failed}")


def save(
    ranks: _Ranks, path: Path, live: files.LiveState, optimizer, lr_scheduler, grad_scaler, extra
) -> None:
    """Write a checkpoint of ``live`` to ``path``: every rank writes its part into a
    temporary directory, all agree, all swap it in (the previous complete checkpoint
    kept), all agree, the previous goes."""
    target = ranks.place(path)
    rows = ranks.gather(
        [files.new_save_id(), *swap.held_ids(target)],
        "the checkpoint save: its id and the saves each rank holds",
    )
    save_id, keep = rows[0][0], _newest_common([row[1:] for row in rows])
    written: list[Path] = []

    def write() -> None:
        contents = files.contents(
            live, optimizer, lr_scheduler, grad_scaler, extra, save_id, ranks.shard
        )
        swap.check_replaceable(target)
        written.append(swap.temporary(target))
        files.write(written[0], contents)

    try:
        error = _attempt(write)
        ranks.agree(error, "the checkpoint save: every part written", "saving the checkpoint")
        error = _attempt(lambda: swap.swap_in(written[0], target, keep))
        ranks.agree(error, "the checkpoint save: every part swapped in", "saving the checkpoint")
    finally:
        for tmp in written:  # gone once swapped in
            swap.discard(tmp)
    swap.commit(target)


def load(
    ranks: _Ranks, path: Path, live: files.LiveState, optimizer, lr_scheduler, grad_scaler
) -> files.Staged:
    """Read and check the newest checkpoint every rank holds at ``path`` and load the
    optimizer, scheduler and scaler states (put back if any rank fails); the caller
    puts the rest of what it returns in place."""
    target = ranks.place(path)
    held = swap.held_ids(target)
    rows = ranks.gather(list(held), "the checkpoint load: the saves each rank holds")
    chosen = _newest_common(rows)
    if not chosen:
        if not any(held):  # say what is wrong here: nothing there, or a damaged state.json
            files.read_state(existing_checkpoint(target, ranks.shard))
        empty = [rank for rank, row in enumerate(rows) if not any(row)]
        raise ValueError(
            f"no save at {path} is complete on every rank: "
            + (
                f"rank(s) {empty} hold none"
                if empty
                else "the shards come from different saves (a save was interrupted on some rank)"
            )
            + "; load an earlier checkpoint"
        )
    if rows[0][0] not in (0, chosen):
        lacking = [rank for rank, row in enumerate(rows) if rows[0][0] not in row]
        warnings.warn(
            f"the newest save at {path} did not complete on every rank (rank(s) {lacking} "
            "lack it): loading the previous one, which every rank holds",
            RuntimeWarning,
            stacklevel=3,
        )
    directory = target if held[0] == chosen else swap.old(target)
    loaded: list[tuple[files.Staged, Callable[[], None]]] = []

    def check() -> None:
        staged = files.read(
            directory, chosen, ranks.shard, live, optimizer, lr_scheduler, grad_scaler
        )
        undo = files.load_objects(
            staged, optimizer=optimizer, lr_scheduler=lr_scheduler, grad_scaler=grad_scaler
        )
        loaded.append((staged, undo))

    error = _attempt(check)
    try:
        ranks.agree(error, "the checkpoint load", "loading the checkpoint")
    except BaseException:
        for _, undo in loaded:
            undo()
        raise
    return loaded[0][0]


def _newest_common(rows: list[list[int]]) -> int:
    """Of the saves rank 0 holds (newest first), the first every rank holds; 0: none."""
    return next((i for i in rows[0] if i and all(i in row for row in rows)), 0)


def _attempt(fn: Callable[[], None]) -> Exception | None:
    """``fn()``'s exception, to be agreed on by every rank before any raises it."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - raised by Ranks.agree
        return error
    return None
