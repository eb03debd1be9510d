"""Token mixers linear in the sequence length: Gated DeltaNet and Mamba2 (and Falcon-H1's
attention beside Mamba2), priced per token like :mod:`.mixers`.

Their sequence mixing is a chunked scan: quadratic within chunks of a fixed length, a
recurrent state carried between chunks. Per token that costs a constant, so their
FLOPs and activation bytes grow linearly with the sequence (no S x S term, no window);
the chunk states the scan materialises are counted per token too (a layer's backward
holds the states and their gradients). The formulas are first-order counts from the
papers' chunked algorithms, assuming the fused kernels (flash-linear-attention's
``chunk_gated_delta_rule``, ``mamba_ssm``'s ``mamba_chunk_scan_combined`` and
``causal_conv1d``; Hugging Face's pure-PyTorch fallbacks are slower and hold more):
estimates, not calibrated on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from .mixers import Linears, Mixer
from .op_bytes import (
    CONV_BYTES,
    FP32,
    GATE_MATH_BYTES,
    HALF,
    LAYOUT_BYTES,
    NORM_BYTES,
    SWIGLU_BYTES,
)

DELTANET_CHUNK = 64
"""flash-linear-attention's chunk length for the gated delta rule."""


@dataclass(frozen=True)
class GatedDeltaNet(Mixer):
    """Gated DeltaNet (Yang, Kautz, Hatamizadeh, arXiv 2412.06464; chunked as in Yang et
    al., arXiv 2406.06484 §3), as Qwen3-Next and Qwen3.5 build it from their config's
    ``linear_num_key_heads`` (n_k), ``linear_num_value_heads`` (n_v),
    ``linear_key_head_dim`` (d_k), ``linear_value_head_dim`` (d_v) and
    ``linear_conv_kernel_dim`` (K): projections to q, k (n_k d_k each), v and the output
    gate z (n_v d_v each), and per value head a decay ``a`` and a step ``b``; a causal
    depthwise conv1d (K taps) with SiLU over q, k and v; q and k repeated to the n_v
    value heads; the gated delta rule; a gated RMSNorm (d_v weights); ``out_proj``.
    Per value head ``dt_bias`` and ``A_log``.

    Sequence FLOPs per token and value head, chunk C = 64: within a chunk
    ``2C(3 d_k + 2 d_v)`` (q k^T, k k^T for the UT transform, the transform applied to
    k and v, the weights times the values; causal halves counted whole) plus ``C^2/3``
    for the triangular inverse; between chunks ``6 d_k d_v`` (q S, w S and the state
    update). The chunk states S (d_k x d_v per value head and chunk) and their
    gradients, 2 + 4 bytes, are in the backward's working set."""

    hidden: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    fused_inputs: bool = False
    """Qwen3-Next's in_proj_qkvz and in_proj_ba (Qwen3.5 splits them): LoRA adapts
    each as one linear."""

    @property
    def keys(self) -> int:
        return self.key_heads * self.key_dim

    @property
    def values(self) -> int:
        return self.value_heads * self.value_dim

    @property
    def conv_width(self) -> int:
        return 2 * self.keys + self.values

    @property
    def _kernel_width(self) -> int:
        """q and k repeated to the value heads, and v: what the scan reads."""
        return 2 * self.value_heads * self.key_dim + self.values

    @property
    def _states(self) -> int:
        return self.value_heads * self.key_dim * self.value_dim // DELTANET_CHUNK

    @property
    def linears(self) -> Linears:
        h, nv = self.hidden, self.value_heads
        return ((h, self.conv_width), (h, self.values), (h, nv), (h, nv), (self.values, h))

    @property
    def adapted(self) -> Linears:
        if not self.fused_inputs:
            return self.linears
        h, values = self.hidden, self.values
        return ((h, self.conv_width + values), (h, 2 * self.value_heads), (values, h))

    @property
    def params(self) -> int:
        conv = self.conv_width * self.conv_kernel
        return self.linear_params + conv + 2 * self.value_heads + self.value_dim

    def sequence_flops(self, tokens: int, seq_len: int, window: int | None) -> float:
        c, dk, dv = DELTANET_CHUNK, self.key_dim, self.value_dim
        per_head = 2 * c * (3 * dk + 2 * dv) + c * c // 3 + 6 * dk * dv
        return float(tokens * self.value_heads * per_head)

    @property
    def elementwise_bytes(self) -> int:
        conv = CONV_BYTES * self.conv_width
        repeat = LAYOUT_BYTES * 2 * self.value_heads * self.key_dim
        gates = GATE_MATH_BYTES * self.value_heads
        norm = (NORM_BYTES + SWIGLU_BYTES) * self.values
        return conv + repeat + gates + norm + LAYOUT_BYTES * (self.conv_width + self.values)

    def saved_bytes(self, inputs: bool) -> int:
        # the conv's input, the scan's q, k, v, the gates, z, the gated norm's float32
        # input, and out_proj's input when it keeps it
        saved = HALF * (self.conv_width + self._kernel_width + self.values)
        saved += FP32 * (2 * self.value_heads + self.values)
        return saved + (HALF * self.values if inputs else 0)

    @property
    def grad_bytes(self) -> int:
        grads = HALF * (self.conv_width + self._kernel_width + self.values)
        return grads + (HALF + FP32) * self._states

    @property
    def tiled_bytes(self) -> int:
        tensors = 2 * HALF * (self.conv_width + self._kernel_width + self.values)
        return tensors + FP32 * (2 * self.value_heads + self.values) + (HALF + FP32) * self._states


@dataclass(frozen=True)
class Mamba2(Mixer):
    """Mamba2's SSD mixer (Dao & Gu, arXiv 2405.21060 §6-7), as Nemotron-H and Falcon-H1
    build it: ``in_proj`` to z and x (d_inner = n_heads x d_head each, else ``expand`` x
    hidden), B and C (n_groups x d_state each) and dt (n_heads); a causal depthwise
    conv1d (d_conv taps, a bias) over x, B, C; the scan; ``D`` skip; the gate silu(z)
    with a gated RMSNorm (d_inner weights; Falcon-H1 without it unless
    ``mamba_rms_norm``); ``out_proj``. Per head ``dt_bias``, ``A_log`` and ``D``.

    Sequence FLOPs per token, chunk length Q (``chunk_size``), state N, head dim P:
    ``n_groups 2QN`` (C B^T within the chunk) + ``n_heads (2QP + 4NP)`` (the masked
    weights times x within the chunk; the chunk states B^T x and their read-out C h).
    The chunk states (P x N per head and chunk) and their gradients, 2 + 4 bytes, are in
    the backward's working set."""

    hidden: int
    heads: int
    head_dim: int
    state: int
    groups: int
    conv_kernel: int
    chunk: int = 256
    conv_bias: bool = True
    norm: bool = True

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_width(self) -> int:
        return self.inner + 2 * self.groups * self.state

    @property
    def in_width(self) -> int:
        return 2 * self.inner + 2 * self.groups * self.state + self.heads

    @property
    def _states(self) -> int:
        return self.heads * self.head_dim * self.state // max(self.chunk, 1)

    @property
    def linears(self) -> Linears:
        return ((self.hidden, self.in_width), (self.inner, self.hidden))

    @property
    def adapted(self) -> Linears:
        """``in_proj`` only: PEFT refuses adapters on a Mamba model's ``out_proj``."""
        return self.linears[:1]

    @property
    def params(self) -> int:
        conv = self.conv_width * (self.conv_kernel + (1 if self.conv_bias else 0))
        return self.linear_params + conv + 3 * self.heads + (self.inner if self.norm else 0)

    def sequence_flops(self, tokens: int, seq_len: int, window: int | None) -> float:
        q, n, p = self.chunk, self.state, self.head_dim
        per_token = self.groups * 2 * q * n + self.heads * (2 * q * p + 4 * n * p)
        return float(tokens * per_token)

    @property
    def elementwise_bytes(self) -> int:
        gate = ((NORM_BYTES if self.norm else 0) + SWIGLU_BYTES) * self.inner
        skip = 3 * HALF * self.inner  # y + D x
        steps = GATE_MATH_BYTES * self.heads
        layout = LAYOUT_BYTES * (self.in_width + self.inner)
        return CONV_BYTES * self.conv_width + gate + skip + steps + layout

    def saved_bytes(self, inputs: bool) -> int:
        # in_proj's output (the fused kernel's input), the scan's output, dt; the
        # norm's float32 input; out_proj's input when it keeps it
        saved = HALF * (self.in_width + self.inner) + FP32 * self.heads
        saved += FP32 * self.inner if self.norm else 0
        return saved + (HALF * self.inner if inputs else 0)

    @property
    def grad_bytes(self) -> int:
        grads = HALF * (self.in_width + self.conv_width + self.inner)
        return grads + (HALF + FP32) * self._states

    @property
    def tiled_bytes(self) -> int:
        tensors = 2 * HALF * (self.in_width + self.inner)
        return tensors + FP32 * (2 * self.heads + self.inner) + (HALF + FP32) * self._states


@dataclass(frozen=True)
class Parallel(Mixer):
    """Two mixers on the same normed input, their outputs summed (Falcon-H1's attention
    beside Mamba2, arXiv 2507.22448): their parameters, FLOPs, bytes and saved tensors
    add up; their backwards run one after the other, so the larger gradient working set
    counts."""

    first: Mixer
    second: Mixer

    @property
    def attends(self) -> bool:  # type: ignore[override]
        return self.first.attends or self.second.attends

    @property
    def linears(self) -> Linears:
        return (*self.first.linears, *self.second.linears)

    @property
    def adapted(self) -> Linears:
        return (*self.first.adapted, *self.second.adapted)

    @property
    def params(self) -> int:
        return self.first.params + self.second.params

    def sequence_flops(self, tokens: int, seq_len: int, window: int | None) -> float:
        first = self.first.sequence_flops(tokens, seq_len, window)
        return first + self.second.sequence_flops(tokens, seq_len, window)

    @property
    def elementwise_bytes(self) -> int:
        return self.first.elementwise_bytes + self.second.elementwise_bytes + 3 * HALF * self.hidden

    @property
    def hidden(self) -> int:
        return getattr(self.first, "hidden", 0)

    def saved_bytes(self, inputs: bool) -> int:
        return self.first.saved_bytes(inputs) + self.second.saved_bytes(inputs)

    @property
    def grad_bytes(self) -> int:
        return max(self.first.grad_bytes, self.second.grad_bytes)

    @property
    def tiled_bytes(self) -> int:
        return self.first.tiled_bytes + self.second.tiled_bytes

    @property
    def norm_widths(self) -> int:
        return self.first.norm_widths + self.second.norm_widths
