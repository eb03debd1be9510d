"""The NF4 format (``roundpipe.hf.nf4_format``) and the frozen ``NF4Linear`` layer.

Oracle: bitsandbytes' own ``quantize_4bit`` / ``dequantize_4bit`` on CPU (nf4, blocks
of 64, no double quantization): packed bytes, block scales and dequantized weights are
bit-identical, for every dtype and for shapes with partial blocks and odd counts. The
layer is checked against ``F.linear`` over the dequantized weight.
"""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from support.nf4_cases import (
    DTYPES,
    GOLDEN,
    SHAPES,
    assert_bits_equal,
    bnb_nf4,
    extreme_weight,
    weights,
)
from torch.nn import functional as F

from roundpipe.hf import nf4_format
from roundpipe.hf.nf4 import NF4Linear
from roundpipe.hf.nf4_format import (
    NF4_LEVELS,
    dequantize_nf4,
    nearest_levels,
    quantize_nf4,
    quantized_nbytes,
)


@pytest.fixture
def bnb():
    """bitsandbytes' functional API, its reference path run eagerly: for odd shapes it
    goes through ``torch.compile``, which costs seconds and computes the same."""
    functional = pytest.importorskip("bitsandbytes.functional")
    with torch.compiler.set_stance("force_eager"):
        yield functional


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bytes_scales_and_dequantized_weights_equal_bitsandbytes(bnb, shape, dtype):
    weight = weights(shape, dtype)
    want_packed, want_absmax, want_weight = bnb_nf4(bnb, weight)
    packed, absmax = quantize_nf4(weight)
    assert torch.equal(packed, want_packed)
    assert_bits_equal(absmax, want_absmax)
    assert_bits_equal(dequantize_nf4(packed, absmax, shape, dtype), want_weight)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_blocks_and_extreme_values_equal_bitsandbytes(bnb, dtype):
    weight = extreme_weight(dtype)
    want_packed, want_absmax, want_weight = bnb_nf4(bnb, weight)
    packed, absmax = quantize_nf4(weight)
    assert torch.equal(packed, want_packed)
    assert_bits_equal(absmax, want_absmax)
    assert_bits_equal(dequantize_nf4(packed, absmax, weight.shape, dtype), want_weight)


def test_weights_larger_than_a_chunk_equal_bitsandbytes(bnb, monkeypatch):
    """Quantizing and dequantizing go a chunk at a time (a few MB of temporaries for
    any weight); the chunk seams change nothing."""
    monkeypatch.setattr(nf4_format, "CHUNK", 256)
    weight = weights((37, 29), torch.bfloat16)  # 1073 elements: 4 chunks and a bit, odd
    want_packed, want_absmax, want_weight = bnb_nf4(bnb, weight)
    packed, absmax = quantize_nf4(weight)
    assert torch.equal(packed, want_packed)
    assert_bits_equal(absmax, want_absmax)
    assert_bits_equal(dequantize_nf4(packed, absmax, weight.shape, weight.dtype), want_weight)


def test_bytes_scales_and_weights_equal_those_bitsandbytes_wrote():
    """Without bitsandbytes (the suite does not install it): the same cases as above,
    against bytes bitsandbytes produced (``tests/support/make_nf4_golden.py``)."""
    golden = safetensors.torch.load_file(GOLDEN)
    names = sorted({key.rsplit("/", 1)[0] for key in golden})
    assert len(names) == (len(SHAPES) + 1) * len(DTYPES)
    for name in names:
        weight = golden[f"{name}/weight"]
        packed, absmax = quantize_nf4(weight)
        assert torch.equal(packed, golden[f"{name}/packed"]), name
        assert_bits_equal(absmax, golden[f"{name}/absmax"])
        dense = dequantize_nf4(packed, absmax, weight.shape, weight.dtype)
        assert_bits_equal(dense, golden[f"{name}/dense"])


def test_levels_times_a_block_scale_survive_a_round_trip_exactly():
    """Without bitsandbytes: a block of NF4 levels times its absmax is representable,
    so it comes back exactly (nibble order and scale included)."""
    levels = torch.tensor(NF4_LEVELS)
    index = torch.randint(0, 16, (6, 64), generator=torch.Generator().manual_seed(1))
    index[:, 0] = 15  # each block's absmax is its scale
    scales = torch.tensor([1.0, 0.5, 3.0, 1e-3, 2.0**20, 7.0]).view(-1, 1)
    weight = levels[index] * scales
    packed, absmax = quantize_nf4(weight)
    assert torch.equal(absmax, scales.view(-1))
    assert packed[0] == (index[0, 0] << 4) | index[0, 1]  # the first element is the high nibble
    assert torch.equal(dequantize_nf4(packed, absmax, weight.shape, torch.float32), weight)


def test_values_at_and_beside_each_midpoint_get_the_level_bucketize_gives():
    """The table lookup that picks levels equals ``torch.bucketize`` over the midpoints
    (bitsandbytes' rule), at the midpoints, one ulp either side, at ±0, ±1 and beyond."""
    levels = torch.tensor(NF4_LEVELS)
    midpoints = (levels[:-1] + levels[1:]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    values = torch.cat(
        [
            midpoints,
            torch.nextafter(midpoints, up),
            torch.nextafter(midpoints, down),
            levels,
            torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.0000001, -1.0000001, 3.0, -3.0]),
            torch.linspace(-1.1, 1.1, 100_001),
        ]
    )
    want = torch.bucketize(values, midpoints, out_int32=True).to(torch.uint8)
    assert torch.equal(nearest_levels(values), want)


def test_dequantized_weights_are_within_half_a_level_gap_of_the_weights():
    weight = weights((64, 64), torch.float32, seed=2)
    packed, absmax = quantize_nf4(weight)
    error = (dequantize_nf4(packed, absmax, weight.shape, torch.float32) - weight).abs()
    widest_gap = max(b - a for a, b in zip(NF4_LEVELS, NF4_LEVELS[1:], strict=False))
    bound = absmax.repeat_interleave(64).view(64, 64) * widest_gap / 2
    assert bool((error <= bound * (1 + 1e-6)).all())


def test_a_weight_costs_0_5625_bytes_a_parameter():
    packed, absmax = quantize_nf4(torch.zeros(256, 128))
    assert packed.numel() + 4 * absmax.numel() == quantized_nbytes(256 * 128) == 0.5625 * 256 * 128


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_weight_holding_inf_or_nan_is_refused(bad):
    weight = torch.zeros(3, 64)
    weight[1, 5] = bad
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_nf4(weight)


def test_integer_weights_and_mismatched_nf4_data_are_refused():
    with pytest.raises(TypeError, match="floating point tensor, got torch.int64"):
        quantize_nf4(torch.zeros(4, dtype=torch.long))
    packed, absmax = quantize_nf4(torch.zeros(8, 64))
    with pytest.raises(ValueError, match="needs 256 NF4 bytes and 8 scales, got 256 and 7"):
        dequantize_nf4(packed, absmax[:7], (8, 64), torch.float32)
    with pytest.raises(TypeError, match="uint8 bytes and fp32 scales"):
        dequantize_nf4(packed.float(), absmax, (8, 64), torch.float32)


def quantized_layer(bias: bool, dtype=torch.float32) -> tuple[NF4Linear, torch.nn.Linear]:
    torch.manual_seed(0)
    dense = torch.nn.Linear(96, 48, bias=bias, dtype=dtype)
    return NF4Linear.from_linear(dense), dense


@pytest.mark.parametrize("bias", [False, True])
def test_the_layer_computes_f_linear_over_its_dequantized_weight(bias):
    layer, dense = quantized_layer(bias)
    x = torch.randn(2, 5, 96, requires_grad=True)
    out = layer(x)
    out.backward(torch.ones_like(out))
    weight = layer.dequantized_weight()
    assert weight.shape == (48, 96) and weight.dtype == torch.float32
    x_ref = x.detach().clone().requires_grad_()
    want = F.linear(x_ref, weight, dense.bias)
    want.backward(torch.ones_like(want))
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)


def test_the_layer_keeps_only_frozen_nf4_parameters_and_its_bias():
    layer, dense = quantized_layer(bias=True, dtype=torch.bfloat16)
    params = dict(layer.named_parameters())
    assert set(params) == {"packed_weight", "absmax", "bias"}
    assert not any(p.requires_grad for p in params.values())
    assert params["packed_weight"].dtype == torch.uint8 and params["absmax"].dtype == torch.float32
    assert torch.equal(params["bias"], dense.bias) and layer.compute_dtype == torch.bfloat16
    assert not list(layer.buffers())  # buffers would be written back after each forward


def test_the_backward_keeps_the_nf4_data_not_the_dense_weight():
    """Saved for backward: the input and the quantized data only; the dense weight is
    dequantized again when the input's gradient is computed."""
    layer, _ = quantized_layer(bias=False)
    saved = []

    def pack(tensor):
        saved.append((tensor.dtype, tuple(tensor.shape)))
        return tensor

    x = torch.randn(3, 96, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layer(x)
    out.sum().backward()
    assert (torch.float32, (48, 96)) not in saved
    assert (torch.uint8, (48 * 96 // 2,)) in saved
