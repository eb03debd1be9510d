"""Host gradient accumulation (``ParameterStore.accumulate_grad``) is bit-identical to
the plain formula ``master.grad += grad.to(optim_dtype) / scale``.

The fused paths avoid full-size temporaries (a chunked, cache-resident scratch for
half-precision gradients) and turn the division into ``add_``'s ``alpha=1/scale``
only where that is exact. Every result here is compared bit for bit with the plain
formula, which is what ``accumulate_grad`` computed before.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from roundpipe.runtime import params as params_mod
from roundpipe.runtime.layers import LayerBinding
from roundpipe.runtime.params import ParameterStore

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SCALES = [None, 1.0, 2.0**16, 2.0**20, 3.0, 0.5, 1000.0]
SIZES = [1, 7, 7777, 1_000_003]  # 1_000_003: several chunks of the real size on <= 2 threads
INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64}


def reference(acc: torch.Tensor | None, grad: torch.Tensor, dtype, scale) -> torch.Tensor:
    """The formula accumulate_grad used before it was fused (the oracle)."""
    grad = grad.to(dtype, copy=True)
    if scale is not None:
        grad.div_(scale)
    return grad if acc is None else acc.clone().add_(grad)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    ints = INT_VIEW[expected.dtype]
    a = actual.contiguous().view(ints)[~nan]
    e = expected.contiguous().view(ints)[~nan]
    mismatches = int((a != e).sum())
    assert mismatches == 0, f"{mismatches} of {expected.numel()} elements differ in their bits"


def wide_values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over the whole exponent range of ``dtype`` (subnormals, zeros of both
    signs, infinities where they overflow) and ordinary ones."""
    gen = torch.Generator().manual_seed(seed)
    finfo = torch.finfo(dtype)
    low = int(torch.log2(torch.tensor(finfo.tiny * finfo.eps, dtype=torch.float64)))
    high = int(torch.log2(torch.tensor(finfo.max, dtype=torch.float64))) + 2
    exps = torch.randint(low, high, (n,), generator=gen).to(torch.float64)
    values = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp2(exps)
    ordinary = torch.randn(n, generator=gen, dtype=torch.float64) * 1e-2
    values = torch.where(torch.rand(n, generator=gen) < 0.5, values, ordinary)
    values[::97] = 0.0
    values[1::97] = -0.0
    return values.to(dtype)


def store_for(*shapes, dtype=torch.bfloat16, optim_dtype=None) -> ParameterStore:
    """A store over one layer with one parameter per shape."""
    layer = nn.Module()
    for i, shape in enumerate(shapes):
        layer.register_parameter(f"p{i}", nn.Parameter(torch.zeros(shape, dtype=dtype)))
    store = ParameterStore([LayerBinding(0, "layer", layer)], {}, optim_dtype, pin=lambda t: t)
    store.ensure_masters()
    return store


def master_of(store: ParameterStore, uid: int) -> nn.Parameter:
    master = store.entries[uid].master
    assert master is not None
    return master


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", SCALES, ids=repr)
@pytest.mark.parametrize("n", SIZES)
def test_first_and_later_accumulations_match_the_plain_formula(dtype, scale, n):
    store = store_for((n,), dtype=dtype)
    (uid,) = store.entries
    master = master_of(store, uid)
    optim_dtype = store.entries[uid].optim_dtype
    expected = None
    for k in range(3):
        grad = wide_values(n, dtype, seed=100 * n + k)
        expected = reference(expected, grad, optim_dtype, scale)
        store.accumulate_grad(uid, grad, scale)
        assert master.grad is not None
        assert_bits_equal(master.grad, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [None, 2.0**16, 3.0], ids=repr)
def test_many_uneven_chunks(monkeypatch, dtype, scale):
    monkeypatch.setattr(params_mod, "_CHUNK_PER_THREAD", 1000)
    n = 7777  # not a multiple of the chunk size
    store = store_for((n // 7, 7), dtype=dtype)
    (uid,) = store.entries
    optim_dtype = store.entries[uid].optim_dtype
    expected = None
    for k in range(2):
        grad = wide_values(n, dtype, seed=k).view(n // 7, 7)
        expected = reference(expected, grad, optim_dtype, scale)
        store.accumulate_grad(uid, grad, scale)
        assert_bits_equal(master_of(store, uid).grad, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scale", [None, 2.0**16, 3.0], ids=repr)
def test_tied_parameter_accumulates_from_both_layers(dtype, scale):
    first, second = nn.Linear(64, 32).to(dtype), nn.Linear(32, 64).to(dtype)
    with torch.no_grad():
        second.weight = nn.Parameter(first.weight.data.t().contiguous())
    shared = nn.Parameter(first.weight.data.clone())
    first.weight = shared
    second.weight = shared  # the same tensor in two layers (like tied embeddings)
    layers = [LayerBinding(0, "first", first), LayerBinding(1, "second", second)]
    store = ParameterStore(layers, {}, None, pin=lambda t: t)
    store.ensure_masters()
    assert len(store.entries) == 3  # one entry for the tied weight
    uid = id(shared)
    expected = None
    for k in range(4):  # both layers' gradients, two calls
        grad = wide_values(shared.numel(), dtype, seed=k).view(shared.shape)
        expected = reference(expected, grad, torch.float32, scale)
        store.accumulate_grad(uid, grad, scale)
        assert_bits_equal(master_of(store, uid).grad, expected)


@pytest.mark.parametrize("scale", [None, 2.0**16, 3.0], ids=repr)
def test_layouts_the_fused_paths_do_not_take(scale):
    """Non-contiguous gradients and accumulators fall back to the plain formula."""
    store = store_for((48, 40), dtype=torch.bfloat16)
    (uid,) = store.entries
    master = master_of(store, uid)
    grad = wide_values(48 * 40, torch.bfloat16, seed=1).view(40, 48).t()
    assert not grad.is_contiguous()
    store.accumulate_grad(uid, grad, scale)
    expected = reference(None, grad, torch.float32, scale)
    assert_bits_equal(master.grad, expected)
    master.grad = torch.zeros(40, 48).t()  # e.g. written by the user
    master.grad.copy_(expected)
    grad2 = wide_values(48 * 40, torch.bfloat16, seed=2).view(48, 40)
    store.accumulate_grad(uid, grad2, scale)
    assert_bits_equal(master.grad, reference(expected, grad2, torch.float32, scale))


@pytest.mark.parametrize("scale", [None, 2.0**16], ids=repr)
def test_first_accumulation_never_aliases_the_downloaded_gradient(scale):
    store = store_for((1000,), dtype=torch.float32)
    (uid,) = store.entries
    grad = torch.randn(1000)
    store.accumulate_grad(uid, grad, scale)
    accumulated = master_of(store, uid).grad.clone()
    grad.fill_(123.0)  # the download buffer is reused
    assert_bits_equal(master_of(store, uid).grad, accumulated)


def test_optim_dtype_float64():
    store = store_for((5000,), dtype=torch.bfloat16, optim_dtype=torch.float64)
    (uid,) = store.entries
    expected = None
    for k, scale in enumerate([2.0**16, 3.0, None]):
        grad = wide_values(5000, torch.bfloat16, seed=k)
        expected = reference(expected, grad, torch.float64, scale)
        store.accumulate_grad(uid, grad, scale)
        assert_bits_equal(master_of(store, uid).grad, expected)


EXACT_ALPHA_CASES = [(torch.bfloat16, k) for k in (0, 1, 8, 16)]
EXACT_ALPHA_CASES += [(torch.float16, k) for k in (0, 1, 16, 24, 60, 125)]
EXACT_ALPHA_CASES += [(torch.float32, 0)]


@pytest.mark.parametrize(("grad_dtype", "k"), EXACT_ALPHA_CASES, ids=str)
def test_exact_alpha_is_exact_for_every_value(grad_dtype, k):
    """Where ``_exact_alpha`` allows the multiply-add, ``acc + x * alpha`` equals
    ``acc + x / scale`` bit for bit: for every bf16 / fp16 value ``x`` (for fp32, on
    its subnormals and smallest normals), with accumulators over fp32's whole range."""
    scale = 2.0**k
    if grad_dtype == torch.float32:
        bits = torch.arange(0, 1 << 16, dtype=torch.int32)
        values = torch.cat([bits, bits | -(1 << 31)]).view(torch.float32)
    else:
        values = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16).view(grad_dtype)
    x = values[~torch.isnan(values)].to(torch.float32)
    alpha = params_mod._exact_alpha(grad_dtype, torch.float32, scale)
    assert alpha == 1.0 / scale
    divided = x / scale
    assert_bits_equal(x * alpha, divided)
    for seed in range(3):
        acc = wide_values(x.numel(), torch.float32, seed=seed)
        acc = torch.where(torch.isinf(acc), 1.0, acc)
        acc[::3] = acc[::3] * 2.0**-100  # many accumulators near the subnormal range
        assert_bits_equal(acc.clone().add_(x, alpha=alpha), acc.clone().add_(divided))


@pytest.mark.parametrize("k", [-126, -60, -1, 0, 1, 16, 17, 60, 100, 126])
def test_exact_reciprocal_is_division_for_every_value(k):
    """Where ``_exact_reciprocal`` allows it, ``x * (1 / scale)`` is ``x / scale`` bit for
    bit: every value a bf16 / fp16 gradient converts to, fp32's subnormals and smallest
    normals, and random fp32 values over its whole range."""
    scale = 2.0**k
    recip = params_mod._exact_reciprocal(torch.float32, scale)
    assert recip == 1.0 / scale
    halves = [
        torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16).view(dtype).to(torch.float32)
        for dtype in (torch.bfloat16, torch.float16)
    ]
    bits = torch.arange(0, 1 << 16, dtype=torch.int32)
    smallest = torch.cat([bits, bits | -(1 << 31)]).view(torch.float32)
    x = torch.cat([*halves, smallest, wide_values(1 << 17, torch.float32, seed=k + 200)])
    x = x[~torch.isnan(x)]
    out = torch.empty_like(x)
    params_mod._unscale(x, out, scale, recip)
    assert_bits_equal(out, x / scale)


def test_non_power_of_two_scales_keep_the_division():
    for scale in (3.0, 1000.0, 0.5, 0.0, float("inf"), float("nan"), -2.0):
        assert params_mod._exact_alpha(torch.bfloat16, torch.float32, scale) is None
    assert params_mod._exact_alpha(torch.bfloat16, torch.float32, 2.0**16) == 2.0**-16
    assert params_mod._exact_alpha(torch.bfloat16, torch.float32, 2.0**17) is None
    assert params_mod._exact_alpha(torch.float16, torch.float32, 2.0**24) == 2.0**-24
    assert params_mod._exact_alpha(torch.float16, torch.float32, 2.0**126) is None
    assert params_mod._exact_alpha(torch.float32, torch.float32, 2.0) is None
    assert params_mod._exact_alpha(torch.float32, torch.float32, None) == 1.0
    for scale in (3.0, 1000.0, 0.0, float("inf"), float("nan"), -2.0, 2.0**127, 2.0**-127):
        assert params_mod._exact_reciprocal(torch.float32, scale) is None


@pytest.mark.parametrize("scale", [None, 2.0**16, 3.0], ids=repr)
def test_concurrent_completers_lose_no_gradient(scale):
    """Several threads accumulating into the same masters: every gradient lands once.
    Integer-valued gradients make the sum independent of the order."""
    store = store_for((300_000,), (7,), dtype=torch.bfloat16)
    uids = list(store.entries)
    threads, rounds = 4, 5
    unit = 1.0 if scale is None else scale  # grad / scale is exactly 1, 2, 3 or 4
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(rounds):
                for uid in uids:
                    shape = store.entries[uid].param.shape
                    grad = torch.full(shape, float(i + 1) * unit, dtype=torch.bfloat16)
                    store.accumulate_grad(uid, grad, scale)
        except BaseException as exc:  # noqa: BLE001 - reported on the test's thread
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not errors
    total = float(rounds * sum(range(1, threads + 1)))
    for uid in uids:
        master = master_of(store, uid)
        assert torch.equal(master.grad, torch.full_like(master, total))
