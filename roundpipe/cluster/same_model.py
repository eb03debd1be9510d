"""Every rank starts from rank 0's model, as with DDP: a model that differs in shape is
refused, then rank 0's parameters and buffers overwrite every other rank's (before any
master is made from them), so ranks initialised differently train one model
(docs/design.md#several-nodes).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from ..runtime.layers import LayerBinding
from ..runtime.params import ParameterStore
from .comm import Comm

CHUNK_BYTES = 32 * 2**20
"""Bytes broadcast at a time: memory stays bounded whatever the tensor sizes, and each
message is large enough for the network's bandwidth, not its latency, to count."""


def start_from_rank0(comm: Comm, store: ParameterStore, layers: list[LayerBinding]) -> None:
    """Refuse ranks whose model differs in shape from rank 0's, then give every rank
    rank 0's parameters and buffers. Collective."""
    buffers = _buffers(layers)
    _check_same_shapes(comm, store, buffers)
    tensors = [entry.param for entry in store.entries.values()] + [t for _, t in buffers]
    with torch.no_grad():
        broadcast_rank0_values(comm, tensors, CHUNK_BYTES)
    for entry in store.entries.values():
        entry.mark_seen()  # written by us, not by the user: nothing to adopt


def _buffers(layers: list[LayerBinding]) -> list[tuple[str, torch.Tensor]]:
    """Every buffer of the layers once, named within its layer, in layer order."""
    seen: set[int] = set()
    found = []
    for layer in layers:
        for name, buffer in layer.module.named_buffers():
            if id(buffer) not in seen:
                seen.add(id(buffer))
                found.append((f"{layer.name}.{name}", buffer))
    return found


def _check_same_shapes(comm: Comm, store: ParameterStore, buffers) -> None:
    names = [
        f"{e.name}:{tuple(e.param.shape)}:{e.param.dtype}:{e.optim_dtype}:{e.trainable}"
        for e in store.entries.values()
    ]
    names += [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in buffers]
    mine = zlib.crc32("|".join(names).encode())
    rows = comm.gather_ints([mine], "the model check at construction")
    differ = [rank for rank, row in enumerate(rows) if row[0] != rows[0][0]]
    if differ:
        raise ValueError(
            f"rank {comm.rank}: ranks {differ} wrap a model different from rank 0's "
            "(parameter or buffer names, shapes or dtypes, requires_grad or optim_dtype "
            "differ); every rank must wrap the same model"
        )


def broadcast_rank0_values(comm: Comm, tensors: list[torch.Tensor], chunk_bytes: int) -> None:
    """Every rank's ``tensors`` take rank 0's values, as one stream of bytes cut into
    chunks of at most ``chunk_bytes``. A rank writes only the bytes that differ, so a
    tensor that is already rank 0's (a copy-on-write mapped file) stays untouched."""
    contiguous = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    versions = [t._version for t in contiguous]
    streams = [t.reshape(-1).view(torch.uint8) for t in contiguous if t.numel()]
    for number, chunk in enumerate(_chunks(streams, chunk_bytes)):
        flat = torch.empty(sum(end - start for _, start, end in chunk), dtype=torch.uint8)
        if comm.rank == 0:
            torch.cat([stream[start:end] for stream, start, end in chunk], out=flat)
        comm.broadcast(flat, 0, f"the broadcast of rank 0's weights (chunk {number})")
        if comm.rank == 0:
            continue
        offset = 0
        for stream, start, end in chunk:
            theirs = flat[offset : offset + end - start]
            if not torch.equal(stream[start:end], theirs):
                stream[start:end].copy_(theirs)
            offset += end - start
    for tensor, copy, version in zip(tensors, contiguous, versions, strict=True):
        if copy is not tensor and copy._version != version:  # written: back into place
            tensor.copy_(copy)


def _chunks(
    streams: list[torch.Tensor], chunk_bytes: int
) -> Iterator[list[tuple[torch.Tensor, int, int]]]:
    """The byte ranges ``(stream, start, end)`` of ``streams``, in order, grouped into
    chunks of at most ``chunk_bytes`` (a long stream spans several)."""
    chunk: list[tuple[torch.Tensor, int, int]] = []
    room = chunk_bytes
    for stream in streams:
        start = 0
        while start < stream.numel():
            end = min(stream.numel(), start + room)
            chunk.append((stream, start, end))
            room -= end - start
            start = end
            if room == 0:
                yield chunk
                chunk, room = [], chunk_bytes
    if chunk:
        yield chunk
