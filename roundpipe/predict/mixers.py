"""Token mixers with softmax attention, priced per token: parameters, the linear layers
(what LoRA adapts and NF4 quantizes), and the terms :mod:`.unit_costs` charges.

Every mixer answers the same questions (:class:`Mixer`); the linear-in-the-sequence
ones (Gated DeltaNet, Mamba2) are in :mod:`.recurrent_mixers`. Per-token byte counts
are what one layer's forward reads and writes in memory-bound ops
(``elementwise_bytes``), what autograd keeps for its backward (``saved_bytes``), the
gradient buffers its backward holds at once (``grad_bytes``) and the per-token part of
the tiled long-context law (``tiled_bytes``, docs/design.md#long-context).
:class:`Attention`'s terms are the calibrated ones of docs/design.md#unit-costs;
:class:`LatentAttention`'s and the variants' extra terms (an output gate, per-layer
head sizes) are first-order estimates by the same rules, not calibrated on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.tiling import SINK_DIMS
from .op_bytes import FP32, HALF, LAYOUT_BYTES, NORM_BYTES, ROTARY_BYTES, SWIGLU_BYTES

Linears = tuple[tuple[int, int], ...]
"""A mixer's linear layers as (in, out) features."""


def context(seq_len: int, window: int | None) -> float:
    """Average number of keys a query attends to (causal, maybe windowed)."""
    full = (seq_len + 1) / 2
    if window is None or window >= seq_len:
        return full
    return window * (1 - window / (2 * seq_len))


class Mixer:
    """A layer's token mixer; this base is the empty one (a layer without a mixer)."""

    attends = False
    """Softmax attention: the tiled path recomputes its pieces (windows, sinks)."""
    sinks = False

    @property
    def linears(self) -> Linears:
        return ()

    @property
    def adapted(self) -> Linears:
        """The linear layers LoRA adapts (PEFT's ``all-linear``)."""
        return self.linears

    @property
    def params(self) -> int:
        return 0

    @property
    def linear_params(self) -> int:
        return sum(a * b for a, b in self.linears)

    def sequence_flops(self, tokens: int, seq_len: int, window: int | None) -> float:
        """Forward FLOPs of mixing ``tokens`` along the sequence (beyond the
        projections), charged at the attention kernels' speed."""
        return 0.0

    @property
    def elementwise_bytes(self) -> int:
        return 0

    def saved_bytes(self, inputs: bool) -> int:
        """``inputs``: its linear layers keep their inputs (trained or adapted)."""
        return 0

    @property
    def grad_bytes(self) -> int:
        return 0

    @property
    def tiled_bytes(self) -> int:
        return 0

    @property
    def norm_widths(self) -> int:
        """Per-head norms' width per token, tiled in chunks (Qwen3's q/k norms)."""
        return 0


@dataclass(frozen=True)
class Attention(Mixer):
    """Grouped-query softmax attention: q, k, v, o projections. Variants: biases on all
    four (``attention_bias``; gpt-oss's ``biases`` add sinks), on q, k and v only
    (``qkv_bias``: Qwen2, GLM-4.5), RMSNorm per query and key head (``qk_norm``), a
    sigmoid output gate from a doubled q projection (``output_gate``: Qwen3-Next,
    Qwen3.5, arXiv 2505.06708), keys that are also the values (``k_eq_v``: Gemma 4's
    global layers, no v projection)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool = False
    biases: bool = False
    attention_bias: bool = False
    qkv_bias: bool = False
    sinks: bool = False
    output_gate: bool = False
    k_eq_v: bool = False
    attends = True

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def linears(self) -> Linears:
        h, q, kv = self.hidden, self.q, self.kv
        values = () if self.k_eq_v else ((h, kv),)
        return ((h, 2 * q if self.output_gate else q), (h, kv), *values, (q, h))

    @property
    def params(self) -> int:
        h, q, kv = self.hidden, self.q, self.kv
        params = self.linear_params
        if self.biases:  # every projection, and a sink per head
            params += q + 2 * kv + h + self.heads
        if self.attention_bias or self.qkv_bias:
            params += (2 * q if self.output_gate else q) + kv * (1 if self.k_eq_v else 2)
            params += h if self.attention_bias else 0
        if self.qk_norm:
            params += 2 * self.head_dim
        return params

    def sequence_flops(self, tokens: int, seq_len: int, window: int | None) -> float:
        # q.k over the keys, then the weights times the values: 2 FLOPs a multiply-add
        return 2 * tokens * context(seq_len, window) * (self.q + self.q)

    @property
    def elementwise_bytes(self) -> int:
        q, kv = self.q, self.kv
        total = ROTARY_BYTES * (q + kv) + LAYOUT_BYTES * (2 * q + 2 * kv)
        if self.qk_norm:
            total += NORM_BYTES * (q + kv)
        if self.output_gate:  # split off the gate; sigmoid(gate) * output
            total += (LAYOUT_BYTES + SWIGLU_BYTES) * q
        if self.k_eq_v:  # the values' own (weightless) norm
            total += NORM_BYTES * kv
        return total

    def saved_bytes(self, inputs: bool) -> int:
        q, kv = self.q, self.kv
        # rotated q and k, v, the output (and o's input when it keeps it)
        saved = HALF * (2 * q + 2 * kv) + (HALF * q if inputs else 0)
        if self.qk_norm:
            saved += (FP32 + HALF) * (q + kv)
        if self.output_gate:  # the gate and its sigmoid
            saved += 2 * HALF * q
        return saved

    @property
    def grad_bytes(self) -> int:
        return HALF * (2 * self.q + 2 * self.kv) + (HALF * self.q if self.output_gate else 0)

    @property
    def tiled_bytes(self) -> int:
        # four query-size and four key/value-size tensors (q, k, v, the output and
        # their gradients), the log-sum-exp, the rotary tables; with per-head norms
        # their inputs; with sinks an example's recompute with the sink dimensions
        q, kv, d = self.q, self.kv, self.head_dim
        total = HALF * (4 * q + 4 * kv) + FP32 * self.heads + 2 * HALF * d
        if self.qk_norm:
            total += HALF * (q + kv)
        if self.sinks:
            total += HALF * 3 * (q + kv) * (d + SINK_DIMS) // d
        if self.output_gate:  # the gate and its gradient
            total += 2 * HALF * q
        return total

    @property
    def norm_widths(self) -> int:
        return self.q + self.kv if self.qk_norm else 0


@dataclass(frozen=True)
class LatentAttention(Mixer):
    """Multi-head latent attention (MLA; DeepSeek-V2 arXiv 2405.04434 §2.1, DeepSeek-V3,
    Kimi K2): queries through a low-rank ``q_a`` (``q_lora_rank``, RMSNorm) and
    ``q_b``, or one ``q_proj`` without it; keys and values from a shared latent
    ``kv_a`` (``kv_lora_rank``, RMSNorm) plus one rotary key of ``qk_rope_head_dim``
    shared by the heads, expanded by ``kv_b``. Attention runs as Hugging Face runs it:
    per head, queries and keys of ``qk_nope_head_dim + qk_rope_head_dim``, values of
    ``v_head_dim``. First-order estimates, not calibrated on a GPU."""

    hidden: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    attends = True

    @property
    def qk_width(self) -> int:
        return self.heads * (self.nope_dim + self.rope_dim)

    @property
    def v_width(self) -> int:
        return self.heads * self.v_dim

    @property
    def linears(self) -> Linears:
        h, qr, kvr = self.hidden, self.q_lora_rank, self.kv_lora_rank
        queries = ((h, qr), (qr, self.qk_width)) if qr else ((h, self.qk_width),)
        kv_b = (kvr, self.heads * (self.nope_dim + self.v_dim))
        return (*queries, (h, kvr + self.rope_dim), kv_b, (self.v_width, h))

    @property
    def params(self) -> int:
        return self.linear_params + self.q_lora_rank + self.kv_lora_rank  # + the two norms

    def sequence_flops(self, tokens: int, seq_len: int, window: int | None) -> float:
        return 2 * tokens * context(seq_len, window) * (self.qk_width + self.v_width)

    @property
    def _widths(self) -> int:
        """q, k (the rotary key expanded to every head), v and the output."""
        return 2 * self.qk_width + 2 * self.v_width

    @property
    def elementwise_bytes(self) -> int:
        latents = NORM_BYTES * (self.q_lora_rank + self.kv_lora_rank)
        rotary = ROTARY_BYTES * (self.heads + 1) * self.rope_dim
        return latents + rotary + LAYOUT_BYTES * self._widths

    def saved_bytes(self, inputs: bool) -> int:
        latents = self.q_lora_rank + self.kv_lora_rank
        saved = FP32 * latents + HALF * self._widths  # the latent norms' inputs
        if inputs:  # q_b's and kv_b's inputs (the normed latents), o's input
            saved += HALF * (latents + self.v_width)
        return saved

    @property
    def grad_bytes(self) -> int:
        latents = self.q_lora_rank + self.kv_lora_rank + self.rope_dim
        return HALF * (self._widths + latents)

    @property
    def tiled_bytes(self) -> int:
        latents = self.q_lora_rank + self.kv_lora_rank + self.rope_dim
        attention = HALF * 2 * self._widths + FP32 * self.heads + 2 * HALF * self.rope_dim
        return attention + 2 * HALF * latents  # the latents and their gradients
