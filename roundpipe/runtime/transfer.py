"""Moving pytrees of tensors between host and device, and pairing them with gradients.

Run inside stream ops. Tensors that appear several times in a tree are moved once,
so aliasing survives the trip (a gradient is then not counted twice).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..devices import Device, Stream


def _plain_tensors(tree: Any) -> bool:
    """``tree`` is ``((tensor, ...), {})``, what crosses most stage boundaries."""
    return (
        type(tree) is tuple
        and len(tree) == 2
        and type(tree[0]) is tuple
        and type(tree[1]) is dict
        and not tree[1]
        and all(isinstance(t, torch.Tensor) for t in tree[0])
    )


def _map_unique(tree: Any, fn) -> Any:
    if _plain_tensors(tree):  # fast path, same result as below
        moved: dict[int, torch.Tensor] = {}
        for t in tree[0]:
            if id(t) not in moved:
                moved[id(t)] = fn(t)
        return tuple(moved[id(t)] for t in tree[0]), {}
    leaves, spec = tree_flatten(tree)
    moved: dict[int, torch.Tensor] = {}
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if id(leaf) not in moved:
                moved[id(leaf)] = fn(leaf)
            out.append(moved[id(leaf)])
        else:
            out.append(leaf)
    return tree_unflatten(out, spec)


def upload_tree(device: Device, stream: Stream, tree: Any, requires_grad: bool) -> Any:
    """Copy every tensor of ``tree`` to ``device``; floating ones become grad leaves if asked."""

    def move(host: torch.Tensor) -> torch.Tensor:
        tensor = device.to_device(host.detach(), stream)
        device.keep_alive(tensor, device.compute)
        if requires_grad and tensor.is_floating_point():
            tensor.requires_grad_(True)
        return tensor

    return _map_unique(tree, move)


def download_tree(device: Device, stream: Stream, tree: Any) -> Any:
    def move(tensor: torch.Tensor) -> torch.Tensor:
        device.keep_alive(tensor, stream)
        return device.to_host(tensor.detach(), stream)

    return _map_unique(tree, move)


def inplace_safe(tree: Any, clone_all: bool = False) -> Any:
    """``tree`` with tensors a layer may modify in place replaced by copies.

    Autograd forbids in-place ops on leaves that require grad, so those become
    (differentiable) clones; with ``clone_all`` every tensor is copied, for values
    that must survive a later layer modifying its input.
    """
    return _map_unique(tree, lambda t: t.clone() if clone_all or t.requires_grad else t)


def _unique_tensors(tree: Any) -> list[torch.Tensor]:
    leaves = list(tree[0]) if _plain_tensors(tree) else tree_flatten(tree)[0]
    seen: dict[int, torch.Tensor] = {}
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            seen.setdefault(id(leaf), leaf)
    return list(seen.values())


def tree_bytes(tree: Any) -> int:
    """Bytes of the unique tensors of ``tree`` (from their metadata: no device sync)."""
    return sum(t.numel() * t.element_size() for t in _unique_tensors(tree))


def grads_of_inputs(inputs: Any) -> list[torch.Tensor | None]:
    """Gradients of the unique tensors of ``inputs`` (None where there is none)."""
    return [t.grad if t.requires_grad else None for t in _unique_tensors(inputs)]


def pair_outputs_with_grads(
    outputs: Any, grads: list[torch.Tensor | None]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Output tensors that need a backward, with their incoming gradients."""
    tensors = _unique_tensors(outputs)
    if len(tensors) != len(grads):
        raise RuntimeError(
            f"recompute produced {len(tensors)} tensors but {len(grads)} gradients came back; "
            "a layer's output structure differs between forward and recompute"
        )
    pairs = [
        (t, g) for t, g in zip(tensors, grads, strict=True) if t.requires_grad and g is not None
    ]
    return [t for t, _ in pairs], [g for _, g in pairs]
