"""Splitting a batch into microbatches and merging microbatch outputs back.

By default every tensor in the inputs (and label) is split along dim 0 with
``torch.tensor_split`` (so a batch need not divide evenly) and every non-tensor
value is passed to each microbatch unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def batch_size(tree: Any, what: str) -> int | None:
    """The common dim-0 size of the tensors in ``tree`` (None if it holds no tensors)."""
    sizes: dict[int, int] = {}
    leaves, _ = tree_flatten(tree)
    for position, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise ValueError(
                    f"{what} holds a 0-dimensional tensor (leaf {position}), which cannot be "
                    "split into microbatches; give it a batch dimension or pass a custom splitter"
                )
            sizes.setdefault(leaf.shape[0], position)
    if len(sizes) > 1:
        raise ValueError(
            f"the tensors in {what} disagree on the batch size (dim 0): {sorted(sizes)}; "
            "pass a custom split function in RoundPipeRunConfig"
        )
    size = next(iter(sizes), None)
    if size == 0:
        raise ValueError(
            f"the batch in {what} is empty (dim 0 has size 0): there is nothing to split into "
            "microbatches; pass at least one sample"
        )
    return size


def split_tree(tree: Any, num: int) -> list[Any]:
    leaves, spec = tree_flatten(tree)
    columns = [
        torch.tensor_split(leaf, num) if isinstance(leaf, torch.Tensor) else [leaf] * num
        for leaf in leaves
    ]
    return [tree_unflatten([column[m] for column in columns], spec) for m in range(num)]


def split_inputs(args: tuple, kwargs: dict, num: int) -> list[tuple[tuple, dict]]:
    return [(a, k) for a, k in split_tree((tuple(args), dict(kwargs)), num)]


def microbatch_rows(inputs: list[Any]) -> list[int]:
    """The rows of each microbatch (``inputs``: one tree per microbatch): the dim-0 size
    its tensors share. Where some microbatch has none (a custom ``split_input``), every
    microbatch counts as one row."""
    rows = [_shared_rows(tree) for tree in inputs]
    known = [r for r in rows if r is not None]
    return known if len(known) == len(rows) else [1] * len(rows)


def weights_by_rows(rows: list[int], total: float) -> tuple[float, ...] | None:
    """Each microbatch's loss weight under ``scale_grads``: its share of the ``total``
    rows its loss is a mean over; None where that is one (a single microbatch)."""
    if rows == [total]:
        return None
    return tuple(r / total for r in rows)


def _shared_rows(tree: Any) -> int | None:
    sizes = {t.shape[0] for t in tensor_leaves(tree) if t.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def merge_outputs(outputs: list[Any]) -> Any:
    """Concatenate per-microbatch outputs along dim 0, leaf by leaf."""
    flat = [tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    merged = []
    for position in range(len(flat[0][0])):
        column = [leaves[position] for leaves, _ in flat]
        first = column[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            merged.append(torch.cat(column))
        elif isinstance(first, torch.Tensor):
            merged.append(torch.stack(column))
        else:
            merged.append(first)
    return tree_unflatten(merged, spec)


def map_tensors(fn, tree: Any) -> Any:
    """Apply ``fn`` to every tensor leaf of ``tree``; other leaves are kept."""
    return tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)
