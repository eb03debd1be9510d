"""The fast paths of ``runtime.transfer``'s tree helpers give what the general pytree
path gives: same structure, Nones kept, an aliased tensor moved once."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_flatten

from roundpipe.runtime.transfer import _map_general, _map_unique, _unique_tensors, tree_bytes

POOL = [torch.full((n + 1,), float(n)) for n in range(4)]


def successor(t: torch.Tensor) -> torch.Tensor:
    """The next tensor of the pool (by identity)."""
    return POOL[(next(i for i, p in enumerate(POOL) if p is t) + 1) % len(POOL)]


leaf = st.one_of(st.none(), st.sampled_from(range(len(POOL))).map(POOL.__getitem__))
tensors = st.lists(st.sampled_from(range(len(POOL))).map(POOL.__getitem__), max_size=5)
trees = st.one_of(
    st.lists(leaf, max_size=5),  # input gradients: a list of tensors and Nones
    tensors.map(lambda ts: (tuple(ts), {})),  # a stage boundary: ((tensor, ...), {})
    st.lists(leaf, max_size=3).map(lambda xs: ((xs, 3), {"k": xs[:1]})),  # anything else
)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=200, deadline=None)
@given(trees)
def test_the_fast_paths_equal_the_general_path(tree):
    calls: list[int] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        calls.append(id(t))
        return successor(t)

    expected = _map_general(tree, successor)
    assert same(_map_unique(tree, fn), expected)
    assert len(calls) == len(set(calls))  # an aliased tensor is moved once
    unique = list({id(t): t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}.values())
    assert [id(t) for t in _unique_tensors(tree)] == [id(t) for t in unique]
    assert tree_bytes(tree) == sum(t.numel() * t.element_size() for t in unique)
