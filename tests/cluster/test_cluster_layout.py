"""The pure parts of multi-node training: who owns what, buckets, option checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.oracle import mlp

from roundpipe import CommOptions, RoundPipe
from roundpipe.cluster import choose_backend
from roundpipe.cluster.layout import TensorSpec, shard_layout

F32, BF16 = torch.float32, torch.bfloat16


def spec(index, numel, layers, grad=F32, weight=BF16):
    return TensorSpec(index, numel, grad, weight, tuple(layers))


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 10_000), min_size=1, max_size=40),
    world=st.integers(1, 5),
    bucket=st.integers(1, 30_000),
)
def test_every_tensor_has_one_owner_and_buckets_run_from_the_last_layer(sizes, world, bucket):
    specs = [spec(i, n, [i // 2]) for i, n in enumerate(sizes)]
    layout = shard_layout(specs, world, bucket)
    seen = [index for b in layout.buckets for share in b.shares for index in share]
    assert sorted(seen) == list(range(len(sizes)))
    assert layout.owner == {
        index: rank
        for b in layout.buckets
        for rank, share in enumerate(b.shares)
        for index in share
    }
    for b in layout.buckets:
        assert b.share_numel == tuple(sum(sizes[i] for i in share) for share in b.shares)
        assert b.segment == max(b.share_numel)
    firsts = [min(b.layers) for b in layout.buckets]
    assert firsts == sorted(firsts, reverse=True)
    short = [b for b in layout.buckets if sum(b.share_numel) < bucket]
    assert len(short) <= 1  # only the last one of the dtype kind closes short
    for b in layout.buckets:  # big tensors travel alone
        if any(sizes[i] >= bucket for s in b.shares for i in s) and world > 1:
            assert sum(len(s) for s in b.shares) == 1
    assert layout == shard_layout(list(reversed(specs)), world, bucket)  # order-free


def test_ownership_is_balanced_when_tensors_are_alike():
    specs = [spec(i, 1000, [i]) for i in range(12)]
    for bucket in (1, 10**9):
        layout = shard_layout(specs, 3, bucket)
        loads = [sum(1000 for i, r in layout.owner.items() if r == rank) for rank in range(3)]
        assert loads == [4000, 4000, 4000]


def test_a_tied_tensor_is_final_only_after_every_layer_using_it():
    specs = [spec(0, 10, [0, 5]), spec(1, 10, [5]), spec(2, 10, [3])]
    layout = shard_layout(specs, 2, 1)
    bucket_of_tied = next(b for b in layout.buckets if any(0 in s for s in b.shares))
    assert bucket_of_tied.layers == {0, 5}
    assert layout.buckets[-1] is bucket_of_tied  # reduced last: layer 0 runs last


def test_dtypes_travel_in_separate_buckets():
    specs = [spec(0, 10, [1]), spec(1, 10, [1], weight=F32), spec(2, 10, [0])]
    layout = shard_layout(specs, 2, 10**9)
    for b in layout.buckets:
        kinds = {(specs[i].grad_dtype, specs[i].weight_dtype) for s in b.shares for i in s}
        assert kinds == {(b.grad_dtype, b.weight_dtype)}


def test_bad_layout_arguments():
    with pytest.raises(ValueError, match="world"):
        shard_layout([], 0, 1)
    with pytest.raises(ValueError, match="bucket_numel"):
        shard_layout([], 1, 0)


def test_backend_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert choose_backend("auto", cpu) == "gloo"
    assert choose_backend("gloo", cuda) == "gloo"
    with pytest.raises(ValueError, match="nccl"):
        choose_backend("nccl", cpu)
    if not torch.distributed.is_nccl_available():
        assert choose_backend("auto", cuda) == "gloo"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"grad_reduction": "avg"}, ValueError, "grad_reduction"),
        ({"comm_options": CommOptions(timeout_s=0)}, ValueError, "timeout_s"),
        ({"comm_options": CommOptions(bucket_bytes=0)}, ValueError, "bucket_bytes"),
        ({"comm_options": CommOptions(backend="mpi")}, ValueError, "backend"),
        ({"comm_options": {"timeout_s": 5}}, TypeError, "CommOptions"),
    ],
)
def test_bad_options_are_refused_even_on_one_node(kwargs, error, match):
    with pytest.raises(error, match=match):
        RoundPipe(mlp(), devices="emulated:1", **kwargs)


def test_one_process_without_torch_distributed_is_a_single_node():
    with RoundPipe(mlp(), devices="emulated:1") as pipe:
        assert pipe.node is None


def test_a_tensor_as_big_as_a_bucket_travels_alone_to_its_owner():
    """An LM head next to its small norm: the head gets a bucket of its own (reduced to
    its owner, no rank pads a segment to its size); the norm another."""
    specs = [spec(0, 10, [0]), spec(1, 10_000, [3]), spec(2, 64, [3])]
    layout = shard_layout(specs, 4, 1000)
    head = next(b for b in layout.buckets if 1 in sum(b.shares, ()))
    assert sum(head.shares, ()) == (1,)
    assert head.single_owner == layout.owner[1]
    assert all(b.segment < 10_000 for b in layout.buckets if b is not head)
    assert layout.buckets[0] is head or min(layout.buckets[0].layers) == 3
