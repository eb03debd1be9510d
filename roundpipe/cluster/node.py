"""One model's work across nodes: gradients reduced, weights gathered, calls agreed.

Each node trains on its share of the global batch with its own devices. A step
(on the host optimizer thread) reduce-scatters the gradients bucket by bucket as
soon as every call of the step has run the backward of the bucket's layers (so the
reduction overlaps the rest of the backward), lets the user's ``step_fn`` update
the masters this node owns, and all-gathers the updated weights in the model dtype
into the buffer the step publishes (:mod:`roundpipe.runtime.versions`). Every node
takes the same decision about a step: if a call failed on any node, every node
skips it and discards the gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..core.schedule import JobKind
from ..runtime.call import Call
from ..runtime.params import ParameterStore
from .comm import Comm, PeerFailure
from .layout import Bucket, ShardLayout, TensorSpec, shard_layout

GRAD_REDUCTIONS = ("sum", "mean")


class NodeSync:
    """This node's side of a model's work across nodes (docs/design.md#several-nodes)."""

    def __init__(
        self,
        comm: Comm,
        store: ParameterStore,
        layers_of: dict[int, tuple[int, ...]],
        grad_reduction: str,
        bucket_numel: int,
    ) -> None:
        self.comm = comm
        self.rank, self.world = comm.rank, comm.world
        self.store = store
        self.grad_reduction = grad_reduction
        self.uids = [uid for uid, entry in store.entries.items() if entry.trainable]
        specs = [
            TensorSpec(
                index,
                store.entries[uid].param.numel(),
                store.entries[uid].optim_dtype,
                store.entries[uid].param.dtype,
                layers_of[uid],
            )
            for index, uid in enumerate(self.uids)
        ]
        self.layout: ShardLayout = shard_layout(specs, self.world, bucket_numel)
        store.shard(frozenset(self.uids[i] for i in self.layout.owned_by(self.rank)))

    # -- the caller's thread ---------------------------------------------------------

    def check_call(self, num_microbatches: int, rows: int) -> float:
        """Check at call start that every rank splits its batch alike; returns the rows
        a rank's loss is the mean over under ``scale_grads`` (``rows``: this rank's):
        the global batch's, so the sum over the ranks is the global batch's mean; with
        ``grad_reduction="mean"``, which then averages the ranks, their mean."""
        gathered = self.comm.gather_ints([num_microbatches, rows], "the call-start check")
        counts = [row[0] for row in gathered]
        if len(set(counts)) > 1:
            raise ValueError(
                f"every rank must split its batch into the same number of microbatches; "
                f"by rank they are {counts} (set RoundPipeRunConfig(num_microbatch=...) "
                "alike on every rank)"
            )
        total = sum(row[1] for row in gathered)
        return total / self.world if self.grad_reduction == "mean" else total

    def sum_over_nodes(self, value: int, what: str) -> int:
        return sum(row[0] for row in self.comm.gather_ints([int(value)], what))

    def global_loss(self, local: torch.Tensor | None, error: BaseException | None):
        """The loss over every node's batch (``local`` None: the call failed here), and
        the error to raise: this node's, or one naming the ranks where the call failed."""
        mine = [0.0, 1.0] if local is None else [float(local), 0.0]
        rows = self.comm.gather_floats(mine, "the loss exchange")
        failed = [r for r, row in enumerate(rows) if row[1]]
        total = sum(row[0] for row in rows)
        if self.grad_reduction == "mean":
            total /= self.world
        if error is None and failed:
            error = PeerFailure(f"the call failed on rank(s) {failed}")
        dtype = torch.float32 if local is None else local.dtype  # as loss_fn returned it
        return torch.tensor(total, dtype=dtype), error

    # -- the optimizer thread -----------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op) -> None:
        """Inside ``step_fn`` (e.g. the global gradient norm)."""
        self.comm.all_reduce(tensor, "an all-reduce inside step_fn", op)

    def step(
        self,
        calls: Iterable[Call],
        step_fn: Callable[[], BaseException | None],
        discard: Callable[..., None],
    ):
        """Reduce, agree, run ``step_fn`` (returns its error), agree again; returns the
        error to report for this step (None also for a step skipped because a call
        failed here: the calls' own errors reach the caller). If a call failed on any
        node, ``discard(calls, reduced=True)`` applies the gradient rule instead."""
        calls = tuple(calls)
        reduced, present = self._reduce(calls)
        failed_here = any(call.latch.wait() is not None for call in calls)
        failed, anywhere = self._agree(failed_here, present, "the step's status exchange")
        if failed:
            discard(calls, reduced=True)
            if failed_here:
                return None
            return PeerFailure(f"a call failed on rank(s) {failed}: the step was skipped")
        self._install(reduced, anywhere)
        error = step_fn()
        failed, _ = self._agree(error is not None, None, "the step_fn status exchange")
        if error is None and failed:
            error = PeerFailure(
                f"step_fn failed on rank(s) {failed}; this rank's step ran (the weights "
                "stay the same on every rank: each publishes what its step left)"
            )
        return error

    def _reduce(self, calls: tuple[Call, ...]) -> tuple[list[torch.Tensor | None], list[int]]:
        present = [0] * len(self.uids)
        reduced = []
        for number, bucket in enumerate(self.layout.buckets):
            _wait_final(bucket, calls)
            segment = bucket.segment
            owner = bucket.single_owner
            if owner is not None:  # one rank owns it all: a reduce to it, no padding
                flat = torch.zeros(segment, dtype=bucket.grad_dtype)
                self._pack_grads(flat, bucket.shares[owner], present)
                self.comm.reduce(flat, owner, _describe("gradient reduce", number, bucket))
                reduced.append(flat if owner == self.rank else None)  # only the owner's
                continue
            flat = torch.zeros(self.world * segment, dtype=bucket.grad_dtype)
            for rank, share in enumerate(bucket.shares):
                self._pack_grads(flat[rank * segment :], share, present)
            out = torch.empty(segment, dtype=bucket.grad_dtype)
            what = _describe("gradient reduce-scatter", number, bucket)
            self.comm.reduce_scatter(out, flat, what)
            reduced.append(out)
        return reduced, present

    def _pack_grads(self, flat: torch.Tensor, share: tuple[int, ...], present: list[int]):
        """This node's gradients of the tensors ``share`` into ``flat``, one after another
        (zeros where it has none); marks the ones it has in ``present``."""
        offset = 0
        for index in share:
            grad = self.store.take_local_grad(self.uids[index])
            numel = self.store.entries[self.uids[index]].param.numel()
            if grad is not None:
                flat[offset : offset + numel].copy_(grad.reshape(-1))
                present[index] = 1
            offset += numel

    def _agree(self, failed: bool, present: list[int] | None, what: str):
        values = torch.tensor([int(failed), *(present or [])], dtype=torch.int32)
        rows = self.comm.gather_status(values, what)
        failed_ranks = [r for r in range(self.world) if rows[r, 0]]
        anywhere = None
        if present is not None:
            anywhere = rows[:, 1:].amax(dim=0).tolist() if present else []
        return failed_ranks, anywhere

    def _install(self, reduced: list[torch.Tensor | None], present: list[int]) -> None:
        """Add the reduced gradients of this node's tensors into their masters' ``.grad``."""
        with torch.no_grad():
            for bucket, out in zip(self.layout.buckets, reduced, strict=True):
                if out is None:
                    continue
                if self.grad_reduction == "mean":
                    out.div_(self.world)
                offset = 0
                for index in bucket.shares[self.rank]:
                    entry = self.store.entries[self.uids[index]]
                    numel = entry.param.numel()
                    if present[index]:
                        grad = out[offset : offset + numel].view(entry.param.shape)
                        self.store.add_reduced_grad(self.uids[index], grad)
                    offset += numel

    def gather(self, buffer_of: Callable[[int], torch.Tensor]) -> None:
        """Fill every tensor other nodes own from them, in ``buffer_of(uid)``."""
        for number, bucket in enumerate(self.layout.buckets):
            segment = bucket.segment
            owner = bucket.single_owner
            if owner is not None:  # a broadcast from the one owner
                flat = torch.empty(segment, dtype=bucket.weight_dtype)
                if owner == self.rank:
                    self._pack_weights(flat, bucket.shares[owner], buffer_of)
                self.comm.broadcast(flat, owner, _describe("weight broadcast", number, bucket))
                if owner != self.rank:
                    self._unpack_weights(flat, bucket.shares[owner], buffer_of)
                continue
            mine = torch.zeros(segment, dtype=bucket.weight_dtype)
            self._pack_weights(mine, bucket.shares[self.rank], buffer_of)
            out = torch.empty(self.world * segment, dtype=bucket.weight_dtype)
            self.comm.all_gather(out, mine, _describe("weight all-gather", number, bucket))
            for rank, share in enumerate(bucket.shares):
                if rank != self.rank:
                    self._unpack_weights(out[rank * segment :], share, buffer_of)

    def _pack_weights(self, flat: torch.Tensor, share, buffer_of) -> None:
        offset = 0
        for index in share:
            source = buffer_of(self.uids[index]).reshape(-1)
            flat[offset : offset + source.numel()].copy_(source)
            offset += source.numel()

    def _unpack_weights(self, flat: torch.Tensor, share, buffer_of) -> None:
        offset = 0
        for index in share:
            target = buffer_of(self.uids[index])
            numel = target.numel()
            target.copy_(flat[offset : offset + numel].view(target.shape))
            offset += numel


def _wait_final(bucket: Bucket, calls: tuple[Call, ...]) -> None:
    """Until every dispatched backward job of ``calls`` touching the bucket finished
    (then its gradients were accumulated: a job finishes after its follow-ups)."""
    for call in calls:
        jobs = [
            job.index
            for job in call.schedule.jobs
            if job.kind is not JobKind.FORWARD and not bucket.layers.isdisjoint(job.layers)
        ]
        call.latch.wait_jobs(jobs)


def _describe(what: str, number: int, bucket: Bucket) -> str:
    return f"the {what} of bucket {number} (layers {min(bucket.layers)}-{max(bucket.layers)})"
