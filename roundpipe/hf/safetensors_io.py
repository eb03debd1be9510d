"""Reading safetensors checkpoints one tensor at a time, or as views of a file mapping.

Every header of a model directory is checked against the file sizes before anything
is loaded; then a tensor is read straight into its host tensor (:func:`read_into`) or
viewed in a copy-on-write mapping of its file (:class:`FileMappings`), so the weights
are never held twice (docs/design.md#hugging-face-models).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from ..devices.base import MAPPED_FILE_ATTR

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

_MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, truncated or does not fit the model."""


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lies in a safetensors file."""

    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Of its first byte, from the start of the file."""
    nbytes: int


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, checked against its size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: it has only {size} bytes")
        header_len = int.from_bytes(prefix, "little")
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise CheckpointError(
                f"{path} is truncated or not a safetensors file: its header claims "
                f"{header_len} bytes but the file has {size}"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path} has a corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header (not a JSON object)")
    data_start = 8 + header_len
    return {
        name: _stored(path, name, entry, data_start, size)
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _stored(path: Path, name: str, entry, data_start: int, size: int) -> StoredTensor:
    where = f"tensor {name!r} in {path}"
    try:
        dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        shape = tuple(int(d) for d in shape)
        begin, end = int(begin), int(end)
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"{where} has a corrupt header entry: {entry!r}") from None
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
        raise CheckpointError(f"{where} has the unsupported dtype {dtype_name!r}")
    expected = math.prod(shape) * dtype.itemsize
    if min(shape, default=0) < 0 or begin < 0 or end - begin != expected:
        raise CheckpointError(
            f"{where} is corrupt: shape {list(shape)} of {dtype_name} needs {expected} bytes, "
            f"its data offsets [{begin}, {end}] hold {end - begin}"
        )
    if data_start + end > size:
        raise CheckpointError(
            f"{path} is truncated: tensor {name!r} ends at byte {data_start + end} but the "
            f"file has {size} bytes"
        )
    return StoredTensor(name, path, dtype, shape, data_start + begin, expected)


def checkpoint_tensors(directory: Path) -> dict[str, StoredTensor]:
    """Every tensor of the model checkpoint in ``directory``, by name."""
    if sys.byteorder != "little":
        raise CheckpointError("safetensors files are little-endian; this host is not")
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.is_file():
        return read_header(single)
    if not index.is_file():
        raise CheckpointError(
            f"{directory} has no {SINGLE_FILE} and no {INDEX_FILE}; roundpipe.from_pretrained "
            "loads safetensors checkpoints only (convert a .bin checkpoint with "
            "transformers: from_pretrained, then save_pretrained)"
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shard_of = {str(name): str(shard) for name, shard in weight_map.items()}
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index} is corrupt (no valid weight_map): {exc!r}") from None
    tensors: dict[str, StoredTensor] = {}
    for shard in sorted(set(shard_of.values())):
        path = directory / shard
        if not path.is_file():
            raise CheckpointError(f"{index} names the shard {shard}, which is missing")
        for name, stored in read_header(path).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is in both {tensors[name].path} and {path}")
            tensors[name] = stored
    for name, shard in shard_of.items():
        if name not in tensors or tensors[name].path.name != shard:
            raise CheckpointError(f"{index} places tensor {name!r} in {shard}, which lacks it")
    return tensors


def read_into(stored: StoredTensor, out: torch.Tensor) -> None:
    """Read ``stored`` into the host tensor ``out`` (same shape), converting its dtype."""
    if tuple(out.shape) != stored.shape:
        raise CheckpointError(
            f"tensor {stored.name!r} in {stored.path} has shape {list(stored.shape)}, the "
            f"model expects {list(out.shape)}"
        )
    if out.dtype == stored.dtype and out.is_contiguous():
        _read_bytes(stored, out)
        return
    buffer = torch.empty(stored.shape, dtype=stored.dtype)
    _read_bytes(stored, buffer)
    out.copy_(buffer)


def _read_bytes(stored: StoredTensor, out: torch.Tensor) -> None:
    if stored.nbytes == 0:
        return
    # numpy's stubs give arrays the buffer protocol from Python 3.12 only
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    with open(stored.path, "rb", buffering=0) as f:
        f.seek(stored.offset)
        done = 0
        while done < stored.nbytes:
            count = f.readinto(view[done:])
            if not count:
                raise CheckpointError(
                    f"{stored.path} ended while reading tensor {stored.name!r} (was the file "
                    "changed while loading?)"
                )
            done += count


class FileMappings:
    """Copy-on-write mappings of checkpoint files, one per file, made on first use."""

    def __init__(self) -> None:
        self._storages: dict[Path, torch.UntypedStorage] = {}

    def view(self, stored: StoredTensor) -> torch.Tensor | None:
        """``stored`` as a view of its file's mapping, or None where its bytes are not
        aligned to its element size (a tensor cannot start there; read a copy instead)."""
        if stored.offset % stored.dtype.itemsize:
            return None
        storage = self._storages.get(stored.path)
        if storage is None:
            nbytes = os.path.getsize(stored.path)
            storage = cast(
                torch.UntypedStorage,  # the stubs type from_file as any storage class's
                torch.UntypedStorage.from_file(str(stored.path), shared=False, nbytes=nbytes),
            )
            setattr(storage, MAPPED_FILE_ATTR, str(stored.path))
            self._storages[stored.path] = storage
        tensor = torch.empty(0, dtype=stored.dtype)
        strides = _contiguous_strides(stored.shape)
        return tensor.set_(storage, stored.offset // stored.dtype.itemsize, stored.shape, strides)


def is_mapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of a file mapping made by :class:`FileMappings`."""
    return getattr(tensor.untyped_storage(), MAPPED_FILE_ATTR, None) is not None


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
