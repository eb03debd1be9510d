"""The NF4 format of ``bitsandbytes`` in plain torch ops (pure math, any device).

A weight is flattened and cut into blocks of 64 elements; each block keeps its fp32
absolute maximum (``absmax``, no double quantization) and each element the index of
the nearest of the 16 NF4 levels to ``value / absmax``, two indices a byte, the first
element in the high nibble. That is ``bitsandbytes.functional.quantize_4bit(w,
blocksize=64, quant_type="nf4", compress_statistics=False)``, computed the way its
reference (CPU) implementation computes it, so the bytes, the scales and the
dequantized weights are bit-identical to it (docs/design.md#4-bit-bases): 0.5625 bytes
per parameter.
"""

from __future__ import annotations

import functools
import math

import torch

BLOCK = 64
"""Elements sharing one absmax."""

CHUNK = 1 << 22
"""Elements quantized or dequantized at a time (a multiple of ``BLOCK``): the temporary
fp32 and index tensors stay a few tens of MB, whatever the size of the weight."""

NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
"""The 16 NF4 levels, as ``bitsandbytes.functional.get_4bit_type("nf4")`` has them
(quantiles of the standard normal, scaled to [-1, 1]; index 7 is exactly 0)."""

_TINY_ABSMAX = 1e-38
"""bitsandbytes divides by ``max(absmax, 1e-38)``, so an all-zero block quantizes to 0."""


def packed_numel(numel: int) -> int:
    """Bytes of the packed indices of a weight of ``numel`` elements (an odd count gets
    a zero nibble of padding)."""
    return (numel + 1) // 2


def absmax_numel(numel: int) -> int:
    """Blocks of a weight of ``numel`` elements (the last one may be partial)."""
    return -(-numel // BLOCK)


def quantized_nbytes(numel: int) -> int:
    """Host bytes of a weight of ``numel`` elements in NF4 with its fp32 scales."""
    return packed_numel(numel) + 4 * absmax_numel(numel)


def quantize_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (floating point, any shape) as ``(packed, absmax)``: uint8 of
    ``packed_numel(n)`` bytes and fp32 of ``absmax_numel(n)`` scales, on its device.
    Raises ValueError for a weight holding inf or NaN (no scale represents it)."""
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(
            "quantize_nf4 takes a floating point tensor, got "
            + (f"{weight.dtype}" if isinstance(weight, torch.Tensor) else repr(type(weight)))
        )
    flat = weight.detach().reshape(-1)
    numel = flat.numel()
    packed = torch.empty(packed_numel(numel), dtype=torch.uint8, device=flat.device)
    absmax = torch.empty(absmax_numel(numel), dtype=torch.float32, device=flat.device)
    for start in range(0, numel, CHUNK):
        quantize_nf4_into(flat[start : start + CHUNK], packed, absmax, start)
    return packed, absmax


def quantize_nf4_into(
    values: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, start: int
) -> None:
    """Quantize ``values``, the flat elements ``start …`` of a weight (``start`` a
    multiple of ``CHUNK``; only the weight's last piece may hold a partial block or an
    odd count), into its ``packed`` bytes and ``absmax`` scales.

    The arithmetic is bitsandbytes' reference implementation, step for step: fp32
    values; full blocks multiplied by ``1 / max(absmax, 1e-38)``, a last partial block
    divided by its clamped absmax (which is also what it stores); clamped to [-1, 1];
    each element's level is the first whose upper midpoint it does not exceed (the
    clamp bitsandbytes applies first changes no level, so it is left out)."""
    if start % CHUNK:
        raise ValueError(f"a piece must start at a multiple of {CHUNK} elements, got {start}")
    flat = values.reshape(-1).float()
    numel = flat.numel()
    rem = numel % BLOCK
    full = numel - rem
    blocks = flat[:full].view(-1, BLOCK)
    scales = blocks.abs().amax(dim=-1)
    scaled = (blocks * (1.0 / scales.clamp(min=_TINY_ABSMAX).view(-1, 1))).reshape(-1)
    if rem:
        last = flat[full:].abs().max().clamp(min=_TINY_ABSMAX)
        scales = torch.cat([scales, last.unsqueeze(0)])
        scaled = torch.cat([scaled, flat[full:] / last])
    if not bool(torch.isfinite(scales).all()):
        raise ValueError(
            "cannot quantize a weight holding inf or NaN to NF4 (its block scale would "
            "not be finite); check the checkpoint"
        )
    if numel % 2:
        scaled = torch.nn.functional.pad(scaled, (0, 1))
    levels = nearest_levels(scaled)
    first_block = start // BLOCK
    absmax[first_block : first_block + scales.numel()] = scales
    first_byte = start // 2
    packed[first_byte : first_byte + levels.numel() // 2] = (levels[::2] << 4) | levels[1::2]


def nearest_levels(scaled: torch.Tensor) -> torch.Tensor:
    """uint8: for each fp32 value, the number of level midpoints below it, which is
    ``torch.bucketize(scaled, midpoints)`` (the level bitsandbytes picks), at half its
    cost. The top 16 bits of an fp32 number name an interval of numbers holding at most
    one midpoint; a table gives the midpoints below the interval and the one inside it
    (``inf`` if none), so each value needs two lookups and one comparison."""
    below, inside = _midpoint_tables(scaled.device)
    bins = (scaled.view(torch.int32) >> 16) & 0xFFFF
    return below.index_select(0, bins) + (scaled > inside.index_select(0, bins))


def dequantize_nf4(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The weight of ``shape`` in ``dtype`` that ``(packed, absmax)`` hold, on their
    device: each level times its block's absmax in fp32, rounded once to ``dtype``,
    as bitsandbytes' ``dequantize_4bit`` computes it."""
    numel = math.prod(shape)
    _check_quantized(packed, absmax, numel)
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    pairs = _level_pairs(packed.device)
    packed, absmax = packed.reshape(-1), absmax.reshape(-1)
    for start in range(0, numel, CHUNK):
        count = min(CHUNK, numel - start)
        codes = packed[start // 2 : start // 2 + packed_numel(count)].int()
        values = pairs.index_select(0, codes).view(-1)[:count]
        rem = count % BLOCK
        full = count - rem
        first = start // BLOCK
        values[:full].view(-1, BLOCK).mul_(absmax[first : first + full // BLOCK].view(-1, 1))
        if rem:
            values[full:].mul_(absmax[first + full // BLOCK])
        out[start : start + count] = values
    return out.view(shape)


def _check_quantized(packed: torch.Tensor, absmax: torch.Tensor, numel: int) -> None:
    if packed.dtype != torch.uint8 or absmax.dtype != torch.float32:
        raise TypeError(
            f"NF4 data are uint8 bytes and fp32 scales, got {packed.dtype} and {absmax.dtype}"
        )
    if packed.numel() != packed_numel(numel) or absmax.numel() != absmax_numel(numel):
        raise ValueError(
            f"a weight of {numel} elements needs {packed_numel(numel)} NF4 bytes and "
            f"{absmax_numel(numel)} scales, got {packed.numel()} and {absmax.numel()}"
        )
    if packed.device != absmax.device:
        raise ValueError(f"NF4 bytes on {packed.device}, their scales on {absmax.device}")


_LEVELS = torch.tensor(NF4_LEVELS, dtype=torch.float32)
_MIDPOINTS = (_LEVELS[:-1] + _LEVELS[1:]) / 2
"""The 15 boundaries between neighbouring levels, computed in fp32 as bitsandbytes
computes them (the levels are sorted)."""


def _cpu_midpoint_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the 65536 intervals of fp32 numbers sharing their top 16 bits: how
    many midpoints lie below all of it (uint8), and the midpoint inside it or ``inf``."""
    midpoints = _MIDPOINTS
    bits = torch.arange(1 << 16, dtype=torch.int32) << 16
    ends = torch.stack([bits.view(torch.float32), (bits | 0xFFFF).view(torch.float32)])
    low, high = ends.amin(dim=0, keepdim=True).T, ends.amax(dim=0, keepdim=True).T
    below = (midpoints < low).sum(dim=1)  # a NaN interval counts none: never looked up
    inside = (midpoints >= low) & (midpoints <= high)
    assert int(inside.sum(dim=1).max()) <= 1  # the midpoints are far apart
    value = torch.where(inside.any(dim=1), (midpoints * inside).sum(dim=1), torch.inf)
    return below.to(torch.uint8), value


def _cpu_level_pairs() -> torch.Tensor:
    """256 × 2: the two levels each byte holds (high nibble first), so a dequantize
    gathers once per byte."""
    byte = torch.arange(256)
    return torch.stack([_LEVELS[byte >> 4], _LEVELS[byte & 0xF]], dim=1).contiguous()


@functools.cache
def _midpoint_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    below, inside = _copied_to(device, *_cpu_midpoint_tables())
    return below, inside


@functools.cache
def _level_pairs(device: torch.device) -> torch.Tensor:
    return _copied_to(device, _cpu_level_pairs())[0]


def _copied_to(device: torch.device, *tables: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tables`` on ``device``, their copies finished: a table is made on whichever
    stream first needs it and then read from every stream of the device."""
    copies = tuple(table.to(device) for table in tables)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return copies
