"""The collectives one RoundPipe model issues between nodes, on ``torch.distributed``.

The caller's thread and the host optimizer thread each issue theirs on a gloo group of
its own, since two threads issuing on one group could pair different collectives
across ranks; with NCCL the buckets travel on a third group. A failed collective raises
:class:`PeerFailure` naming this rank, what it was doing and the ranks that did not
answer, after the group's timeout at the latest (docs/design.md#several-nodes).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import RoundPipeError

# torch 2.13 renamed the single-tensor collectives; older releases have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class PeerFailure(RoundPipeError):
    """Work on another node failed, or a collective with the other nodes did."""

    cause: str = ""
    """For a failed collective: what went wrong, and which ranks did not answer."""


class Comm:
    """This node's side of the collectives of one model (docs/design.md#several-nodes)."""

    def __init__(
        self,
        group,
        timeout: datetime.timedelta | None,
        backend: str = "gloo",
        staging_device: torch.device | None = None,
    ) -> None:
        ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank(group)
        self.world = len(ranks)
        kwargs = {"backend": "gloo", "use_local_synchronization": True}
        if timeout is not None:
            kwargs["timeout"] = timeout
        self._caller = dist.new_group(ranks, **kwargs)
        self._optimizer = dist.new_group(ranks, **kwargs)
        self.backend = backend
        self._staging = staging_device if backend == "nccl" else None
        self._buckets = self._optimizer
        if backend == "nccl":
            self._buckets = dist.new_group(ranks, **{**kwargs, "backend": "nccl"})
        self._rs_supported = True
        self._global_ranks = ranks
        self.broken: str | None = None
        """Set by the first failed collective: the group is unusable after it."""
        self.delay_s = 0.0
        """Testing: seconds each bucket collective sleeps first (a slow network)."""
        self.spans: list[tuple[str, float, float]] | None = None
        """When a list: (what, start, end) of every bucket collective, perf_counter s."""

    # -- the caller's thread ---------------------------------------------------------

    def gather_ints(self, values: list[int], what: str) -> list[list[int]]:
        """Every rank's ``values`` (the same length on all), by rank."""
        return self._gather(values, torch.int64, what)

    def gather_floats(self, values: list[float], what: str) -> list[list[float]]:
        return self._gather(values, torch.float64, what)

    def _gather(self, values: list, dtype: torch.dtype, what: str) -> list[list]:
        mine = torch.tensor(values, dtype=dtype)
        out = torch.empty(self.world * len(values), dtype=dtype)
        self._run(what, lambda: _all_gather(out, mine, group=self._caller))
        return out.view(self.world, len(values)).tolist()

    # -- the optimizer thread -----------------------------------------------------------

    def gather_status(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's int32 ``values``, one row per rank."""
        out = torch.empty(self.world * values.numel(), dtype=values.dtype)
        self._run(what, lambda: _all_gather(out, values, group=self._optimizer))
        return out.view(self.world, -1)

    def all_reduce(self, tensor: torch.Tensor, what: str, op=dist.ReduceOp.SUM) -> None:
        self._run(what, lambda: dist.all_reduce(tensor, op=op, group=self._optimizer))

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, what: str) -> None:
        """``out`` = this rank's segment of the sum over ranks of ``flat``."""
        self._timed(what, lambda: self._staged(self._reduce_scatter, out, flat))

    def all_gather(self, out: torch.Tensor, segment: torch.Tensor, what: str) -> None:
        """``out`` = every rank's ``segment``, by rank."""

        def gather(out: torch.Tensor, segment: torch.Tensor) -> None:
            _all_gather(out, segment, group=self._buckets)

        self._timed(what, lambda: self._staged(gather, out, segment))

    def reduce(self, tensor: torch.Tensor, owner: int, what: str) -> None:
        """``tensor`` on rank ``owner`` becomes the sum over ranks of ``tensor``."""
        dst = dist.get_global_rank(self._buckets, owner)
        self._timed(
            what, lambda: self._in_place(lambda t: dist.reduce(t, dst, group=self._buckets), tensor)
        )

    def broadcast(self, tensor: torch.Tensor, owner: int, what: str) -> None:
        """Every rank's ``tensor`` becomes rank ``owner``'s."""
        src = dist.get_global_rank(self._buckets, owner)
        self._timed(
            what,
            lambda: self._in_place(lambda t: dist.broadcast(t, src, group=self._buckets), tensor),
        )

    def _in_place(self, collective, tensor: torch.Tensor) -> None:
        """``collective(tensor)`` in place, on a device copy of it with NCCL."""
        if self._staging is None:
            collective(tensor)
            return
        staged = tensor.to(self._staging)
        collective(staged)
        tensor.copy_(staged)  # on the current stream, after the collective: host waits

    def _staged(self, collective, out: torch.Tensor, source: torch.Tensor) -> None:
        """``collective(out, source)`` on host tensors, or on device copies (NCCL)."""
        if self._staging is None:
            collective(out, source)
            return
        device_out = torch.empty(out.shape, dtype=out.dtype, device=self._staging)
        collective(device_out, source.to(self._staging))
        out.copy_(device_out)  # on the current stream, after the collective: host waits

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        if self._rs_supported:
            try:
                _reduce_scatter(out, flat, group=self._buckets)
                return
            except (RuntimeError, NotImplementedError) as exc:
                if "support" not in str(exc).lower():
                    raise
                self._rs_supported = False  # an older gloo: all-reduce, keep our segment
        dist.all_reduce(flat, group=self._buckets)
        out.copy_(flat.view(self.world, -1)[self.rank])

    def _timed(self, what: str, fn: Callable[[], None]) -> None:
        start = time.perf_counter()
        if self.delay_s:
            time.sleep(self.delay_s)
        self._run(what, fn)
        if self.spans is not None:
            self.spans.append((what, start, time.perf_counter()))

    def _run(self, what: str, fn: Callable[[], object]) -> None:
        if self.broken is not None:
            raise PeerFailure(
                f"rank {self.rank} of {self.world}: {what} was not attempted: an earlier "
                f"collective failed ({self.broken})"
            )
        try:
            fn()
        except Exception as exc:
            failure = peer_failure(what, self.rank, self._global_ranks, exc)
            self.broken = f"{what}: {failure.cause}"
            raise failure from exc


def peer_failure(what: str, rank: int, global_ranks: list[int], exc: BaseException) -> PeerFailure:
    """The error of a failed collective ``what`` on ``rank`` of the group whose ranks
    are ``global_ranks``, naming the ranks that did not answer (see :func:`silent_ranks`)."""
    silent = silent_ranks(global_ranks, rank)
    cause = (
        f"rank(s) {silent} did not answer: exited, hung or busy elsewhere"
        if silent
        else "another rank probably failed, exited or timed out"
    )
    failure = PeerFailure(
        f"rank {rank} of {len(global_ranks)}: {what} failed ({type(exc).__name__}: {exc}); {cause}"
    )
    failure.cause = f"{type(exc).__name__}: {exc}; {cause}"
    return failure


def silent_ranks(global_ranks: list[int], rank: int, wait_s: float = 3.0) -> list[int] | None:
    """After a failed collective: the ranks (of the group ``global_ranks``) that do not
    check in on the rendezvous store within ``wait_s``. Every process that saw a
    collective fail checks in once, under its global rank, whatever it was doing."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"roundpipe/alive/{global_ranks[rank]}", "1")
        keys = [f"roundpipe/alive/{g}" for g in global_ranks]
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            silent = [r for r, key in enumerate(keys) if not store.check([key])]
            if not silent:
                return []
            time.sleep(0.05)
        return silent
    except Exception:  # noqa: BLE001 - naming the culprit is best effort
        return None
