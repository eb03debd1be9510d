"""Bytes per element of the dtypes and of the memory-bound ops the unit costs count
(:mod:`.unit_costs`, :mod:`.mixers`)."""

from __future__ import annotations

HALF, FP32 = 2, 4
NORM_BYTES = 36  # HF RMSNorm per element: upcast, square, mean, scale, downcast, weight
ROTARY_BYTES = 20  # x*cos + rotate_half(x)*sin
SWIGLU_BYTES = 10  # silu(gate) * up (also charged for relu^2 and the output gates)
RESIDUAL_BYTES = 6
CONV_BYTES = 2 * HALF  # a depthwise causal conv1d with its activation fused: read, write
LAYOUT_BYTES = 2 * HALF  # a copy to another layout (transpose, concatenation): read, write
GATE_MATH_BYTES = 6 * FP32  # per head: the float32 gate and step-size math of a linear mixer
