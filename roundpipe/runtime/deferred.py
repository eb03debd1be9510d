"""Connecting a pipelined ``model(x)`` forward to autograd, for a later ``.backward()``.

The outputs of a training-mode ``model(x)`` are wired to one autograd node whose
backward hands the output gradients, split per microbatch, to the pipeline's
backward stages (which recompute from the saved stage inputs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class _PipelineBackward(torch.autograd.Function):
    """Connects a pipelined forward's outputs to autograd; its backward runs the pipeline's."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, run_backward, tensors: tuple) -> tuple:
        ctx.run_backward = run_backward
        return tuple(t.detach().clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.run_backward(grads)
        return None, None, None


def attach_backward(merged: Any, outputs: list[Any], run_backward) -> Any:
    """Return ``merged`` with its floating tensors wired to ``run_backward``.

    ``run_backward`` receives, per microbatch, the gradients aligned with that
    microbatch's output tensors (``None`` for non-floating ones).
    """
    leaves, spec = tree_flatten(merged)
    wired = [i for i, leaf in enumerate(leaves) if _differentiable(leaf)]
    shapes = [
        [leaf.shape for leaf in tree_flatten(out)[0] if isinstance(leaf, torch.Tensor)]
        for out in outputs
    ]

    def split_grads(grads: tuple) -> None:
        per_microbatch: list[list] = [[] for _ in outputs]
        by_leaf = dict(zip(wired, grads, strict=True))
        tensor_position = 0
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                continue
            microbatch_shapes = [shape[tensor_position] for shape in shapes]
            sizes = [shape[0] if len(shape) else 1 for shape in microbatch_shapes]
            pieces = torch.split(by_leaf[i], sizes) if i in by_leaf else [None] * len(outputs)
            for m, piece in enumerate(pieces):
                per_microbatch[m].append(
                    None if piece is None else piece.reshape(microbatch_shapes[m])
                )
            tensor_position += 1
        run_backward(per_microbatch)

    anchor = torch.zeros((), requires_grad=True)
    attached = _PipelineBackward.apply(anchor, split_grads, tuple(leaves[i] for i in wired))
    for i, tensor in zip(wired, attached, strict=True):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)


def _differentiable(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim() > 0
