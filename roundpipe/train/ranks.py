"""``roundpipe train`` under ``torchrun``: which process this is, and the few collectives
the command itself needs (the model's own go through RoundPipe's ``process_group``).

With ``WORLD_SIZE`` > 1, :func:`joined` initialises ``torch.distributed`` with gloo from
``torchrun``'s environment; otherwise :class:`Ranks` is one process and every method a
no-op. Each collective waits at most ``--dist-timeout`` seconds, then raises
:class:`~roundpipe.cluster.PeerFailure` (docs/design.md#training-across-nodes).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..cluster import PeerFailure
from ..cluster.comm import gather_objects, peer_failure, released
from .options import UsageError

LAUNCH_HINT = "torchrun --nnodes K --nproc-per-node 1 ... -m roundpipe train ..."
T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ``world`` processes of a run (see the module doc)."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """Rank 0 prints, and writes the metrics, the plot, run.yaml and the tokenizer."""
        return self.rank == 0

    @property
    def shard(self) -> dict[str, int] | None:
        """``{"rank", "world"}`` as sharded checkpoints name it (None: one process)."""
        return None if self.world == 1 else {"rank": self.rank, "world": self.world}

    def share(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's rows of a global batch: ``torch.tensor_split`` by rank."""
        if self.world == 1:
            return dict(batch)
        return {k: torch.tensor_split(v, self.world)[self.rank] for k, v in batch.items()}

    def max(self, value: int, what: str) -> int:
        """The largest of the ranks' ``value``."""
        if self.world == 1:
            return int(value)
        import torch.distributed as dist

        largest = torch.tensor([int(value)], dtype=torch.int64)
        reduce = lambda: dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # noqa: E731
        self._run(what, lambda: released(reduce, largest))
        return int(largest.item())

    def sum(self, values: list[float], what: str) -> list[float]:
        """The sums over the ranks of ``values`` (float64)."""
        if self.world == 1:
            return [float(v) for v in values]
        import torch.distributed as dist

        total = torch.tensor(values, dtype=torch.float64)
        self._run(what, lambda: released(lambda: dist.all_reduce(total), total))
        return total.tolist()

    def gather(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value`` (anything picklable), by rank."""
        if self.world == 1:
            return [value]
        rows: list[Any] = []
        self._run(what, lambda: rows.extend(gather_objects(value)))
        return rows

    def agree(self, work: Callable[[], T], what: str) -> T:
        """``work()`` on every rank, then every rank learns whether it failed anywhere:
        a rank whose ``work`` raised raises its error; the others raise a
        :class:`UsageError` (exit code 2) naming the rank if it was bad input, else a
        :class:`PeerFailure`. So no rank goes on to wait for one that gave up."""
        if self.world == 1:
            return work()
        try:
            result, error = work(), None
        except Exception as exc:
            result, error = None, exc
        summary = None
        if error is not None:
            summary = (isinstance(error, UsageError), str(error) or type(error).__name__)
        rows = self.gather(summary, what)
        if error is not None:
            raise error
        failed = [(rank, row) for rank, row in enumerate(rows) if row is not None]
        if failed:
            rank, (usage, message) = failed[0]
            if usage:
                raise UsageError(f"on rank {rank}: {message}")
            raise PeerFailure(f"rank {self.rank} of {self.world}: {what} failed on rank {rank}: "
                              f"{message}")  # fmt: skip
        return result  # type: ignore[return-value]

    def _run(self, what: str, collective: Callable[[], object]) -> None:
        try:
            collective()
        except Exception as exc:
            raise peer_failure(what, self.rank, list(range(self.world)), exc) from exc


def from_environment(env: Mapping[str, str] | None = None) -> Ranks:
    """This process's rank and world size from ``torchrun``'s variables; a
    :class:`UsageError` when they are incomplete."""
    env = os.environ if env is None else env
    world = _integer(env, "WORLD_SIZE", "1")
    if world < 1:
        raise UsageError(f"WORLD_SIZE={world}: must be at least 1")
    if world == 1:
        return Ranks()
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise UsageError(
            f"WORLD_SIZE={world} but {', '.join(missing)} not set: start the processes with "
            f"torchrun ({LAUNCH_HINT})"
        )
    rank = _integer(env, "RANK", "0")
    if not 0 <= rank < world:
        raise UsageError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world})")
    return Ranks(rank, world)


def _integer(env: Mapping[str, str], name: str, default: str) -> int:
    value = (env.get(name) or default).strip() or default
    try:
        return int(value)
    except ValueError as error:
        raise UsageError(f"{name}={value!r} is not an integer") from error


def check_several(ranks: Ranks, precision: str | None, demo: bool) -> None:
    """What several processes cannot do (checked before they meet, the same on each)."""
    if ranks.world == 1:
        return
    if precision == "fp16":
        raise UsageError(
            f"--precision fp16 is not supported across {ranks.world} processes (its "
            "GradScaler would skip steps on one node's overflow alone): use bf16 or fp32"
        )
    if demo:
        raise UsageError(
            f"--demo runs in one process, not under torchrun (WORLD_SIZE={ranks.world})"
        )


@contextmanager
def joined(ranks: Ranks, timeout_s: float) -> Iterator[Ranks]:
    """Inside, the ``torch.distributed`` default group of the ``ranks.world`` processes
    (gloo, collectives time out after ``timeout_s``); destroyed on the way out unless it
    was initialised already."""
    if ranks.world == 1:
        yield ranks
        return
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        try:
            dist.init_process_group(
                "gloo",
                timeout=datetime.timedelta(seconds=timeout_s),
                rank=ranks.rank,
                world_size=ranks.world,
            )
        except Exception as exc:
            raise PeerFailure(
                f"rank {ranks.rank} of {ranks.world}: could not join the other processes at "
                f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                f"({type(exc).__name__}: {exc})"
            ) from exc
    elif (dist.get_rank(), dist.get_world_size()) != (ranks.rank, ranks.world):
        raise UsageError(
            f"torch.distributed is initialised as rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, the environment says {ranks.rank} of {ranks.world}"
        )
    try:
        yield ranks
    finally:
        if started:  # a lost peer may have left the group unusable: best effort
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
