"""Data parallelism across RoundPipe nodes on ``torch.distributed`` (one process per node).

:func:`connect` turns it on for a model whose ``process_group`` spans more than one
rank; nothing changes on one node. See :mod:`.same_model` for how the ranks start
alike, :mod:`.node` for what a step does, :mod:`.layout` for who owns what and
:mod:`.comm` for the collectives.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..devices.base import DevicePool
from ..runtime.layers import LayerBinding
from ..runtime.params import ParameterStore
from .comm import Comm, PeerFailure
from .node import GRAD_REDUCTIONS, NodeSync
from .same_model import start_from_rank0

BACKENDS = ("auto", "gloo", "nccl")

__all__ = ["CommOptions", "NodeSync", "PeerFailure", "connect"]


@dataclass(frozen=True)
class CommOptions:
    """How a model talks to the other nodes."""

    timeout_s: float | None = None
    """Seconds a collective may wait for the other nodes before every rank raises
    (None: the timeout ``process_group`` was created with, where PyTorch tells,
    else its default of 30 min)."""
    bucket_bytes: int = 32 * 2**20
    """Gradients of consecutive layers travel together until a bucket holds this many
    bytes (fewer, larger messages for small layers)."""
    backend: str = "auto"
    """``"gloo"`` (host tensors, works everywhere), ``"nccl"`` (buckets staged through
    the first device of the pool, a CUDA device) or ``"auto"``: NCCL where this
    PyTorch build has it and the devices are CUDA devices, else gloo."""


def connect(
    store: ParameterStore,
    pool: DevicePool,
    layers: list[LayerBinding],
    process_group,
    grad_reduction: str,
    options: CommOptions | None,
    grad_scaler=None,
) -> NodeSync | None:
    """This node's side of the model whose parameters ``store`` holds, across the ranks
    of ``process_group`` (None: the world group when ``torch.distributed`` is
    initialised); None on a single node. Collective: every rank of the group
    constructs its model at the same point. Gives every rank rank 0's parameters and
    buffers, and keeps only this node's share of the masters in ``store``."""
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction must be one of {GRAD_REDUCTIONS}, got {grad_reduction!r}")
    options = options or CommOptions()
    if not isinstance(options, CommOptions):
        raise TypeError(f"comm_options must be a CommOptions, got {type(options).__name__}")
    if options.timeout_s is not None and not options.timeout_s > 0:
        raise ValueError(f"CommOptions.timeout_s must be > 0, got {options.timeout_s}")
    if options.bucket_bytes < 1:
        raise ValueError(f"CommOptions.bucket_bytes must be >= 1, got {options.bucket_bytes}")
    if options.backend not in BACKENDS:
        raise ValueError(f"CommOptions.backend must be one of {BACKENDS}, got {options.backend!r}")
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    if dist.get_world_size(process_group) == 1:
        return None
    if grad_scaler is not None:
        raise NotImplementedError(
            "a GradScaler with several nodes is not supported yet (each node would skip "
            "steps on its own share's overflow); train in bf16 or fp32 across nodes"
        )
    timeout = (
        _group_timeout(process_group)
        if options.timeout_s is None
        else datetime.timedelta(seconds=options.timeout_s)
    )
    device = pool.devices[0].torch_device
    backend = choose_backend(options.backend, device)
    comm = Comm(process_group, timeout, backend, device)
    start_from_rank0(comm, store, layers)
    itemsize = max((e.optim_dtype.itemsize for e in store.entries.values()), default=4)
    bucket_numel = max(1, options.bucket_bytes // itemsize)
    return NodeSync(comm, store, _layers_of(layers), grad_reduction, bucket_numel)


def choose_backend(requested: str, device: torch.device) -> str:
    """The bucket backend for ``requested`` with the pool's first device ``device``."""
    nccl = dist.is_nccl_available() and device.type == "cuda"
    if requested == "nccl" and not nccl:
        why = (
            "this PyTorch build has no NCCL"
            if not dist.is_nccl_available()
            else (f"the devices are {device.type} devices, not CUDA devices")
        )
        raise ValueError(f"CommOptions(backend='nccl'): {why}; use 'gloo' or 'auto'")
    if requested == "auto":
        return "nccl" if nccl else "gloo"
    return requested


def _group_timeout(group) -> datetime.timedelta | None:
    """The timeout ``group`` was created with (a private attribute: best effort)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - then the torch.distributed default applies
        return None


def _layers_of(layers: list[LayerBinding]) -> dict[int, tuple[int, ...]]:
    """For each parameter uid, the indices of the layers that use it."""
    uses: dict[int, list[int]] = {}
    for layer in layers:
        for uid in layer.param_uids:
            uses.setdefault(uid, []).append(layer.index)
    return {uid: tuple(indices) for uid, indices in uses.items()}
