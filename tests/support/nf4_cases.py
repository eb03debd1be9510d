"""The weights the NF4 format is checked on and bitsandbytes' answer for them: shared by
``test_nf4_format.py`` and ``make_nf4_golden.py`` (which writes ``GOLDEN``)."""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(128, 64), (4, 192), (16, 32), (96, 40), (33, 7), (5,), (3, 65), (1, 1), (0, 8)]
"""Rows of whole blocks; rows shorter than a block; a partial last block; an odd count
(a padding nibble); empty."""
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "nf4_bitsandbytes.safetensors"


def bnb_nf4(functional, weight):
    """bitsandbytes' bytes, scales and dequantized weight. The weight comes from its
    reference implementation (the torch ops every backend without a kernel runs, and
    the CPU backend for odd rows); its CPU kernel agrees where rows are a multiple of
    the block (its AVX-512 path counts blocks per row, wrong for shorter rows)."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    packed, state = functional.quantize_4bit(
        weight, blocksize=64, quant_type="nf4", compress_statistics=False
    )
    code = _get_4bit_code("nf4", weight.device)
    shape, dtype = tuple(weight.shape), weight.dtype
    dense = _dequantize_4bit_compute(packed.reshape(-1), state.absmax, code, 64, shape, dtype)
    if weight.dim() == 2 and weight.shape[-1] % 64 == 0:
        assert_bits_equal(functional.dequantize_4bit(packed, state), dense)
    return packed.reshape(-1), state.absmax, dense.reshape(weight.shape)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.dtype.itemsize]
    assert torch.equal(got.view(bits), want.view(bits))


def weights(shape, dtype, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def extreme_weight(dtype: torch.dtype) -> torch.Tensor:
    """All-zero blocks (a full one and a partial last one) and each dtype's largest
    finite value next to its smallest normal, in one block."""
    info = torch.finfo(dtype)
    weight = weights((4, 50), torch.float32)
    weight[1] = 0.0  # straddles blocks 0 and 1
    weight[3, 42:] = 0.0  # the partial last block (200 = 3 × 64 + 8) is all zero
    weight[2, :3] = torch.tensor([info.max, -info.max, info.tiny])
    weight[0, :2] = torch.tensor([info.tiny, -info.tiny])
    return weight.to(dtype)
