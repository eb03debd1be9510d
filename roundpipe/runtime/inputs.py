"""A call's inputs and labels: checked, copied into runtime-owned buffers, split.

Backward stages re-read a call's inputs long after ``forward_backward`` returned,
so the caller's tensors are copied once, at call start, into host buffers the
runtime owns (page-locked where the backend supports it). Buffers come back to a
small pool when the call has finished, so a training loop of equal-shaped batches
allocates them once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core.config import RoundPipeRunConfig
from .microbatch import batch_size, split_inputs, split_tree, tensor_leaves
from .transfer import register_dataclasses

_Key = tuple[torch.dtype, tuple[int, ...]]


class HostBufferPool:
    """Reusable host buffers keyed by dtype and shape (the least recently used shapes
    are forgotten beyond ``max_shapes``). Used by the driving thread only, so it
    takes no lock an interrupt could leave held."""

    def __init__(
        self,
        pin: Callable[[torch.Tensor], torch.Tensor],
        max_shapes: int = 16,
        max_free_per_shape: int = 4,
    ) -> None:
        self._pin = pin
        self._max_shapes = max_shapes
        self._max_free = max_free_per_shape
        self._free: OrderedDict[_Key, list[torch.Tensor]] = OrderedDict()

    def take(self, tree: Any) -> tuple[Any, list[torch.Tensor]]:
        """A copy of ``tree`` whose tensors live in pool buffers, and those buffers.

        A tensor appearing several times is copied once, so aliasing survives.
        """
        leaves, spec = tree_flatten(tree)
        copies: dict[int, torch.Tensor] = {}
        buffers: list[torch.Tensor] = []
        out = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                out.append(leaf)
                continue
            if id(leaf) not in copies:
                copies[id(leaf)] = self._copy(leaf, buffers)
            out.append(copies[id(leaf)])
        return tree_unflatten(out, spec), buffers

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        for buffer in buffers:
            key = (buffer.dtype, tuple(buffer.shape))
            free = self._free.setdefault(key, [])
            self._free.move_to_end(key)
            if len(free) < self._max_free:
                free.append(buffer)
        while len(self._free) > self._max_shapes:
            self._free.popitem(last=False)

    def _copy(self, tensor: torch.Tensor, buffers: list[torch.Tensor]) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.layout is not torch.strided:
            return tensor.clone()
        buffer = self._buffer((tensor.dtype, tuple(tensor.shape)))
        buffer.copy_(tensor)
        buffers.append(buffer)
        return buffer

    def _buffer(self, key: _Key) -> torch.Tensor:
        free = self._free.get(key)
        if free:
            return free.pop()
        dtype, shape = key
        return self._pin(torch.empty(shape, dtype=dtype))


def check_on_host(tree: Any, what: str) -> None:
    for tensor in tensor_leaves(tree):
        if tensor.device.type != "cpu":
            raise ValueError(
                f"{what} must be in host memory, but a tensor is on {tensor.device}; "
                "RoundPipe keeps inputs on the host and uploads them itself: pass CPU tensors"
            )


def split_call_inputs(config: RoundPipeRunConfig, args: tuple, kwargs: dict, num: int) -> list:
    """The inputs of each of ``num`` microbatches, as ``(args, kwargs)`` pairs."""
    if config.split_input is not None:
        pieces = config.split_input(args, kwargs, num)
        if len(pieces) != num:
            raise ValueError(f"split_input returned {len(pieces)} microbatches, expected {num}")
        return pieces
    size = batch_size((args, kwargs), "the inputs")
    if size is None:
        raise ValueError(
            "the inputs hold no tensor to split into microbatches; pass a tensor batch "
            "or a custom split_input in RoundPipeRunConfig"
        )
    if size == 0:
        raise ValueError("the batch is empty (its tensors have 0 samples along dim 0)")
    if size < num:
        raise ValueError(
            f"the batch has {size} samples but each call splits it into {num} "
            f"microbatches; pass a batch of at least {num} samples or set "
            f"RoundPipeRunConfig(num_microbatch={size}) (or fewer)"
        )
    return split_inputs(args, kwargs, num)


def split_call_label(
    config: RoundPipeRunConfig, label: Any, num: int, args: tuple, kwargs: dict
) -> list:
    """The label of each of ``num`` microbatches (``None`` for each if there is none)."""
    if label is None:
        return [None] * num
    if config.split_label is not None:
        pieces = config.split_label(label, num)
        if len(pieces) != num:
            raise ValueError(f"split_label returned {len(pieces)} microbatches, expected {num}")
        return pieces
    size = batch_size(label, "the label")
    if config.split_input is None and size is not None:
        input_size = batch_size((args, kwargs), "the inputs")
        if size != input_size:
            raise ValueError(
                f"the label's batch size ({size}) does not match the inputs' ({input_size})"
            )
    return split_tree(label, num)


def own_and_split(
    pool: HostBufferPool,
    config: RoundPipeRunConfig,
    args: tuple,
    kwargs: dict,
    label: Any,
    num: int,
) -> tuple[list, list, list[torch.Tensor]]:
    """Per-microbatch ``(args, kwargs)`` and labels, copied into ``pool`` buffers, and
    the buffers (to give back once the call has finished)."""
    register_dataclasses((args, kwargs, label))
    check_on_host((args, kwargs), "the inputs")
    check_on_host(label, "the label")
    (args, kwargs, label), owned = pool.take((args, kwargs, label))
    inputs = split_call_inputs(config, args, kwargs, num)
    labels = split_call_label(config, label, num, args, kwargs)
    return inputs, labels, owned
