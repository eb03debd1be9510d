"""torchao's 8-bit AdamW step, with a quantizer that runs fast on CPU
(docs/design.md#host-memory).

torchao quantizes a moment by a branchless binary search over its 256-value map
(``quantize_8bit_with_qmap``: eight gathers from the map, then one rounding step with
two more). On CPU, inductor emits each gather as a scalar loop with a bounds check, and
the fused step evaluates the whole update three times (once per block maximum, once to
quantize): about 30 M parameters/s on two cores, whatever the shape, ~35x slower than
fused fp32 AdamW.

The binary search and its rounding step together pick, for a scaled value ``x``, the
number of *thresholds* ``t_k`` (k = 0..254) with ``x >= t_k``, where ``t_k`` is the
smallest fp32 value above ``q_k`` whose fp32 ``x - q_k`` reaches ``(q_{k+1} - q_k) * 0.5``
as torchao computes it (see :func:`thresholds`). Here that count is read from two small
tables indexed by ``x``'s bf16 bucket (sign, exponent, top 7 mantissa bits): the code at
the bucket's low end and the one threshold inside the bucket (the map's values are far
enough apart that no bucket holds two; :func:`tables` checks). Two lookups instead of
ten, and the same codes, bit for bit: ``tests/optim/test_lean_optimizers.py`` compares them
with torchao's own quantizer on every threshold's neighbours and on random values.

The step itself runs in the C kernel of :mod:`roundpipe.optim._kernel` (one pass over
memory). For tensors it does not take (not contiguous fp32/bf16 CPU tensors), or where
no compiler builds it, :func:`compiled_adamw8bit_step` is torchao's ``single_param_adam``
written out over the states' inner tensors (``codes``, ``scale``, ``qmap``), op for op,
with the table quantizer, compiled by inductor. Both equal torchao's ``AdamW8bit``.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor
from torchao.optim.subclass_8bit import OptimState8bit

from . import _kernel

_MANTISSA_BITS = 7  # a bucket per bf16 value
_SMALLEST_EXPONENT = -40  # |x| below 2**-40 shares one bucket (no threshold below ~1e-7)
_LOW = (127 + _SMALLEST_EXPONENT) << _MANTISSA_BITS
_BUCKETS = ((127 << _MANTISSA_BITS) | ((1 << _MANTISSA_BITS) - 1)) - _LOW + 1  # up to 1.99


def thresholds(qmap: np.ndarray) -> np.ndarray:
    """The 255 fp32 values at which torchao's quantizer moves to the next code: the
    smallest ``x >= q[k]`` with ``float32(x - q[k]) >= float32(q[k+1] - q[k]) * 0.5``
    (its rounding rule ``residual >= (val_up - val_down) * 0.5``, all in fp32)."""
    q = qmap.astype(np.float32)
    out = np.empty(len(q) - 1, dtype=np.float32)
    for k in range(len(q) - 1):
        half = np.float32(np.float32(q[k + 1] - q[k]) * np.float32(0.5))

        def reaches(x, k=k, half=half):
            return np.float32(x - q[k]) >= half

        x = np.float32(q[k] + half)
        while x > q[k] and reaches(np.nextafter(x, np.float32(-np.inf))):
            x = np.nextafter(x, np.float32(-np.inf))
        while not reaches(x):
            x = np.nextafter(x, np.float32(np.inf))
        out[k] = x
    return out


@functools.lru_cache(maxsize=4)
def tables(qmap_values: tuple[float, ...]) -> tuple[Tensor, Tensor]:
    """For each bucket (:func:`_bucket`): the code of the bucket's lowest value and the
    threshold inside the bucket (``inf`` for none); raises ``AssertionError`` if a bucket
    holds two thresholds."""
    t = thresholds(np.asarray(qmap_values, dtype=np.float32))
    magnitude = (_LOW + np.arange(_BUCKETS, dtype=np.int64)) << (23 - _MANTISSA_BITS)
    top = magnitude + (1 << (23 - _MANTISSA_BITS)) - 1
    magnitude[0] = 0  # the first bucket takes every smaller magnitude
    as_float = functools.partial(np.frombuffer, dtype=np.float32)
    small = as_float(magnitude.astype(np.uint32).tobytes())
    large = as_float(top.astype(np.uint32).tobytes())
    base, inside = [], []
    for lows, highs in ((small, large), (-large, -small)):  # x >= 0, then x < 0
        base.append(np.searchsorted(t, lows, side="right"))
        count = np.searchsorted(t, highs, side="right") - base[-1]
        assert count.max() <= 1, "two thresholds in one bucket"
        first = t[np.minimum(base[-1], len(t) - 1)]
        inside.append(np.where(count == 1, first, np.float32(np.inf)))
    codes = torch.from_numpy(np.concatenate(base).astype(np.int32))
    return codes, torch.from_numpy(np.concatenate(inside).astype(np.float32))


def _bucket(x: Tensor) -> Tensor:
    bits = x.view(torch.int32)
    magnitude = (bits & 0x7FFFFFFF) >> (23 - _MANTISSA_BITS)
    return (magnitude - _LOW).clamp(0, _BUCKETS - 1) + (bits < 0).to(torch.int32) * _BUCKETS


def quantize(x: Tensor, codes_table: Tensor, inside_table: Tensor) -> Tensor:
    """torchao's ``quantize_8bit_with_qmap(x, qmap)`` for ``x`` in [-1, 1], by table."""
    bucket = _bucket(x)
    return (codes_table[bucket] + (x >= inside_table[bucket]).to(torch.int32)).to(torch.uint8)


def _requantize(value: Tensor, codes: Tensor, scale: Tensor, tables_: tuple) -> None:
    """``OptimState8bit.copy_(value)``: torchao's ``scale_tensor`` and quantizer."""
    blocks = value.view(-1, codes.numel() // scale.numel())
    block_scale = blocks.abs().amax(-1).clip(1e-12)
    scaled = (blocks / block_scale.view(-1, 1)).view(codes.shape)
    codes.copy_(quantize(scaled, *tables_))
    scale.copy_(block_scale)


def _dequantize(codes: Tensor, qmap: Tensor, scale: Tensor) -> Tensor:
    """torchao's ``dequant_with_qmap``."""
    return (qmap[codes.int()].view(scale.shape[0], -1) * scale.view(-1, 1)).view(codes.shape)


def _step(p, grad, step, m, v, m_tables, v_tables, lr, beta1, beta2, weight_decay, eps):
    """torchao's ``single_param_adam`` for AdamW without amsgrad or rounding, ``m`` and
    ``v`` the ``(codes, scale, qmap)`` of its two states."""
    p_f32 = p.float()
    grad_f32 = grad.float()
    p_f32 = p_f32 - lr * weight_decay * p_f32
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    exp_avg_f32 = _dequantize(m[0], m[2], m[1]).lerp(grad_f32, 1 - beta1)
    exp_avg_sq_f32 = _dequantize(v[0], v[2], v[1]).lerp(grad_f32.square(), 1 - beta2)
    _requantize(exp_avg_f32, m[0], m[1], m_tables)
    _requantize(exp_avg_sq_f32, v[0], v[1], v_tables)
    denom = (exp_avg_sq_f32.sqrt() / bias_correction2.sqrt()) + eps
    p_f32 = p_f32 - lr * (exp_avg_f32 / bias_correction1) / denom
    p.copy_(p_f32)


_compiled_step = torch.compile(_step, fullgraph=True, dynamic=False)


def compiled_adamw8bit_step(
    param, grad, step, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, eps
) -> None:
    """torchao's ``AdamW8bit`` step (no stochastic rounding) compiled by inductor, with
    the table quantizer: for tensors the C kernel does not take."""
    pairs = [(s, tables(tuple(s.qmap.tolist()))) for s in (exp_avg, exp_avg_sq)]
    states = [(s.codes, s.scale, s.qmap) for s, _ in pairs]
    state_tables = [t for _, t in pairs]
    # mypy counts positional arguments after two unpacked lists as too many
    _compiled_step(param, grad, step, *states, *state_tables, lr, beta1, beta2, weight_decay, eps)  # type: ignore[call-arg]


def kernel_adamw8bit_step(
    param, grad, step, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, eps, key
) -> bool:
    """One step of ``param`` and its 8-bit states, in place, torchao's ``AdamW8bit`` bit
    for bit, by the C kernel (:mod:`roundpipe.optim._kernel`); a bf16 ``param`` is
    rounded stochastically from the random stream ``key`` (an int), or to nearest
    (``None``). Returns False, having done nothing, where the kernel does not apply
    (not contiguous fp32/bf16 CPU tensors, or no compiler)."""
    kernels = _kernel.load() if _fits_kernel(param, grad, exp_avg, exp_avg_sq) else None
    if kernels is None:
        return False
    args = [param.data_ptr(), _param_mode(param, key)]
    args += [grad.data_ptr(), grad.dtype is torch.bfloat16, param.numel(), exp_avg.block_size]
    for state in (exp_avg, exp_avg_sq):
        codes, inside = tables(tuple(state.qmap.tolist()))
        args += [state.codes.data_ptr(), state.scale.data_ptr(), state.qmap.data_ptr()]
        args += [codes.data_ptr(), inside.data_ptr()]
    args += [23 - _MANTISSA_BITS, _LOW, _BUCKETS]
    kernels.roundpipe_adamw8bit(*args, *_options(lr, beta1, beta2, weight_decay, step, eps, key))
    return True


def kernel_adamw_step(
    param, grad, step, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, eps, key
) -> bool:
    """:func:`kernel_adamw8bit_step` for plain moments (fp32 or bf16 tensors): torchao's
    AdamW step over them, bit for bit."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    fits = (
        all(
            type(t) in (Tensor, torch.nn.Parameter)
            and t.device.type == "cpu"
            and t.is_contiguous()
            and t.dtype in (torch.float32, torch.bfloat16)
            and t.shape == param.shape
            for t in tensors
        )
        and exp_avg.dtype == exp_avg_sq.dtype
    )
    kernels = _kernel.load() if fits else None
    if kernels is None:
        return False
    args = [param.data_ptr(), _param_mode(param, key)]
    args += [grad.data_ptr(), grad.dtype is torch.bfloat16]
    args += [exp_avg.data_ptr(), exp_avg_sq.data_ptr(), exp_avg.dtype is torch.bfloat16]
    args += [param.numel()]
    kernels.roundpipe_adamw(*args, *_options(lr, beta1, beta2, weight_decay, step, eps, key))
    return True


def _param_mode(param: Tensor, key: int | None) -> int:
    """The kernels' parameter mode: 0 fp32, 1 bf16 rounded to nearest, 2 stochastically."""
    if param.dtype is torch.float32:
        return 0
    return 1 if key is None else 2


def _options(lr, beta1, beta2, weight_decay, step, eps, key) -> list:
    options = [float(lr), weight_decay]
    for beta in (beta1, beta2):
        options += _lerp_alpha(1 - beta)
    return [*options, beta1, beta2, float(step), eps, torch.get_num_threads(), key or 0]


def _lerp_alpha(weight: float) -> list:
    """The factor and the base of inductor's ``lerp(start, end, weight)`` (its
    decomposition: ``end + (end - start) * -(1 - weight)`` for ``|weight| >= 0.5``, else
    ``start + (end - start) * weight``)."""
    if weight >= 0.5 or weight <= -0.5:
        return [-(1.0 - weight), True]
    return [weight, False]


def _fits_kernel(param: Tensor, grad: Tensor, *states: OptimState8bit) -> bool:
    tensors = [param, grad] + [t for s in states for t in (s.codes, s.scale, s.qmap)]
    return (
        all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        and param.dtype in (torch.float32, torch.bfloat16)
        and grad.dtype in (torch.float32, torch.bfloat16)
        and grad.shape == param.shape
        and all(s.codes.numel() == param.numel() for s in states)
        and states[0].block_size == states[1].block_size
    )
