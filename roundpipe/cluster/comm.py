"""The collectives one RoundPipe model issues between nodes, on ``torch.distributed``.

The caller's thread and the host optimizer thread each issue theirs on a gloo group of
its own, since two threads issuing on one group could pair different collectives
across ranks; with NCCL the buckets travel on a third group. Every exchange of small
values first exchanges a fixed-size header naming what this rank is doing, so ranks
that fell out of step raise on every rank, naming what each did, instead of pairing
unrelated data. A failed collective raises :class:`PeerFailure` naming this rank, what
it was doing and what the others were doing or that they did not answer, after the
group's timeout at the latest (docs/design.md#several-nodes).
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable
from typing import TypedDict

import torch
import torch.distributed as dist

from ..errors import RoundPipeError
from ..runtime.operation import OPERATION

# torch 2.13 renamed the single-tensor collectives; older releases have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

HEADER_BYTES = 512
"""The fixed size of the header before each exchange: what the rank does, and how much
data it exchanges (a longer name is cut; gloo aborts the process on a size mismatch)."""


class PeerFailure(RoundPipeError):
    """Work on another node failed, or a collective with the other nodes did."""

    cause: str = ""
    """For a failed collective: what went wrong, and which ranks did not answer or what
    each was doing; for ranks out of step, what each was doing."""


class _GroupOptions(TypedDict, total=False):
    """``dist.new_group``'s options of this node's groups."""

    backend: str
    use_local_synchronization: bool
    timeout: datetime.timedelta


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
        kwargs: _GroupOptions = {"backend": "gloo", "use_local_synchronization": True}
        if timeout is not None:
            kwargs["timeout"] = timeout
        self._caller = dist.new_group(ranks, **kwargs)
        self._optimizer = dist.new_group(ranks, **kwargs)
        self.backend = backend
        self._staging = staging_device if backend == "nccl" else None
        self._buckets = self._optimizer
        if backend == "nccl":
            nccl: _GroupOptions = {**kwargs, "backend": "nccl"}
            self._buckets = dist.new_group(ranks, **nccl)
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
        gather = lambda: _all_gather(out, mine, group=self._caller)  # noqa: E731
        self._exchange(self._caller, what, gather, mine, out)
        return out.view(self.world, len(values)).tolist()

    # -- the optimizer thread -----------------------------------------------------------

    def gather_status(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's int32 ``values``, one row per rank."""
        out = torch.empty(self.world * values.numel(), dtype=values.dtype)
        gather = lambda: _all_gather(out, values, group=self._optimizer)  # noqa: E731
        self._exchange(self._optimizer, what, gather, values, out)
        return out.view(self.world, -1)

    def all_reduce(self, tensor: torch.Tensor, what: str, op=dist.ReduceOp.SUM) -> None:
        reduce = lambda: dist.all_reduce(tensor, op=op, group=self._optimizer)  # noqa: E731
        self._exchange(self._optimizer, what, reduce, tensor)

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
            released(lambda: collective(tensor), tensor)
            return
        staged = tensor.to(self._staging)
        collective(staged)
        tensor.copy_(staged)  # on the current stream, after the collective: host waits

    def _staged(self, collective, out: torch.Tensor, source: torch.Tensor) -> None:
        """``collective(out, source)`` on host tensors, or on device copies (NCCL)."""
        if self._staging is None:
            released(lambda: collective(out, source), out, source)
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

    def _exchange(self, group, what: str, collective, payload: torch.Tensor, *more) -> None:
        """``collective`` (of ``payload`` and ``more`` tensors, on the gloo ``group``), once
        every rank's header says it is at the same collective with as much data; else
        every rank raises here, since every rank sees every header
        (docs/design.md#several-nodes)."""

        def checked() -> None:
            header = _header(f"{payload.numel()} x {payload.dtype}\n{_label(what)}")
            out = torch.empty(self.world * HEADER_BYTES, dtype=torch.uint8)
            released(lambda: _all_gather(out, header, group=group), out, header)
            headers = [_text(row) for row in out.view(self.world, -1)]
            if len(set(headers)) > 1:
                raise self._out_of_step(headers)
            released(collective, payload, *more)

        self._run(what, checked)

    def _out_of_step(self, headers: list[str]) -> PeerFailure:
        labels = [header.partition("\n")[2] for header in headers]
        if len(set(labels)) == 1:  # the same collective with different sizes: show them
            labels = [header.replace("\n", " of ") for header in headers]
        cause = out_of_step(labels)
        failure = PeerFailure(f"rank {self.rank} of {self.world}: {cause}")
        failure.cause = cause
        return failure

    def _run(self, what: str, fn: Callable[[], object]) -> None:
        label = _label(what)
        if self.broken is not None:
            raise PeerFailure(
                f"rank {self.rank} of {self.world}: {label} was not attempted: an earlier "
                f"collective failed ({self.broken})"
            )
        try:
            fn()
        except PeerFailure as failure:  # out of step: every rank raises it here
            self.broken = failure.cause
            # For a peer that times out on another group waiting for this rank.
            check_in(self._global_ranks, self.rank, label, wait_s=0)
            raise
        except Exception as exc:
            error = peer_failure(label, self.rank, self._global_ranks, exc)
            self.broken = f"{label}: {error.cause}"
            raise error from exc


RELEASE_WAIT_S = 1.0
"""How long :func:`released` waits at most for gloo to let go of a collective's tensors."""


def released(collective: Callable[[], object], *tensors: torch.Tensor) -> None:
    """Run the gloo ``collective`` of ``tensors``, and return once gloo holds none of them.

    A gloo worker thread drops its references to a collective's tensors just after the
    collective returns, and must take the GIL to do so; a process that exits in between
    aborts ("terminate called without an active exception": a thread that asks for the
    GIL during interpreter shutdown is ended inside C++). So wait, yielding the GIL,
    until the tensors' reference counts are back to what they were (a second at most:
    never a hang, at worst the old race)."""
    before = _references(tensors)
    collective()
    deadline = time.monotonic() + RELEASE_WAIT_S
    while _references(tensors) > before and time.monotonic() < deadline:
        time.sleep(0)  # lets the worker thread take the GIL


def gather_objects(value, group=None) -> list:
    """Every rank's picklable ``value``, by rank: ``dist.all_gather_object``, whose
    tensors are its own, through :func:`released` (a size exchange, then the padded
    pickles)."""
    import pickle

    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    world = dist.get_world_size(group)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = torch.empty(world, dtype=torch.int64)
    released(lambda: _all_gather(sizes, size, group=group), sizes, size)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    rows = torch.empty(world * longest, dtype=torch.uint8)
    released(lambda: _all_gather(rows, padded, group=group), rows, padded)
    table = rows.view(world, longest)
    return [pickle.loads(table[r, : int(sizes[r])].numpy().tobytes()) for r in range(world)]


def _references(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(sys.getrefcount(tensor) for tensor in tensors)


def _label(what: str) -> str:
    """``what`` with the operation this thread is in: "save_checkpoint (the checkpoint
    save id)" (:mod:`roundpipe.runtime.operation`)."""
    operation = OPERATION.get()
    return what if operation is None else f"{operation} ({what})"


def _header(text: str) -> torch.Tensor:
    encoded = text.encode()[:HEADER_BYTES].ljust(HEADER_BYTES, b"\0")
    return torch.frombuffer(bytearray(encoded), dtype=torch.uint8)


def _text(header: torch.Tensor) -> str:
    return header.numpy().tobytes().rstrip(b"\0").decode(errors="replace")


def out_of_step(labels: list[str]) -> str:
    """What each rank was doing (``labels``, by rank), when they did not all do the same."""
    by_rank = ", ".join(f"rank {rank}: {label}" for rank, label in enumerate(labels))
    return (
        f"the ranks are out of step ({by_rank}); every rank must call the same collective "
        "RoundPipe methods (forward_backward, step, save_checkpoint, ...) in the same "
        "order, and its step_fn the same collectives (clip_grad_norm_)"
    )


def peer_failure(what: str, rank: int, global_ranks: list[int], exc: BaseException) -> PeerFailure:
    """The error of a failed collective ``what`` on ``rank`` of the group whose ranks
    are ``global_ranks``: the ranks that did not answer, or what each was doing if they
    were not all doing the same (see :func:`check_in`)."""
    doing = check_in(global_ranks, rank, what)
    silent = None if doing is None else [r for r in range(len(global_ranks)) if r not in doing]
    if silent:
        cause = f"rank(s) {silent} did not answer: exited, hung or busy elsewhere"
    elif doing and len(set(doing.values())) > 1:
        cause = out_of_step([doing[r] for r in range(len(global_ranks))])
    else:
        cause = "another rank probably failed, exited or timed out"
    failure = PeerFailure(
        f"rank {rank} of {len(global_ranks)}: {what} failed ({type(exc).__name__}: {exc}); {cause}"
    )
    failure.cause = f"{type(exc).__name__}: {exc}; {cause}"
    return failure


def check_in(
    global_ranks: list[int], rank: int, what: str, wait_s: float = 3.0
) -> dict[int, str] | None:
    """After a failed collective: what each rank (of the group ``global_ranks``) that
    checks in on the rendezvous store within ``wait_s`` was doing, by rank (None: the
    store could not be asked). Every process that saw a collective fail, or its ranks
    out of step, checks in once, under its global rank, with what it was doing."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"roundpipe/alive/{global_ranks[rank]}", what)
        keys = {r: f"roundpipe/alive/{g}" for r, g in enumerate(global_ranks)}
        deadline = time.monotonic() + wait_s
        while True:
            answered = [r for r, key in keys.items() if store.check([key])]
            if len(answered) == len(keys) or time.monotonic() >= deadline:
                return {r: store.get(keys[r]).decode(errors="replace") for r in answered}
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - naming the culprit is best effort
        return None
