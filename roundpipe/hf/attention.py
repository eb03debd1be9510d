"""Attention without an ``S x S`` tensor for the layers of ``from_hf`` models.

transformers' SDPA path needs an ``S x S`` mask for packed examples and sliding
windows, and GPT-OSS (attention sinks) has no SDPA path at all: its eager attention
holds ``S x S`` scores per head. Here a :class:`Segments` descriptor is passed as the
attention mask instead, and :func:`attention` (registered with transformers as
``SEGMENTED_SDPA``, selected on a layer shell's own config copy while it runs) runs
memory-efficient SDPA over *pieces*: each packed example whole (causal), or, under a
sliding window, blocks of queries with the keys their window reaches (a block-sized
mask). Sinks join as one more key whose score is the head's sink: queries and keys get
``SINK_DIMS`` more dimensions, a query's first extra one ``sink / scaling`` and the
sink key's 1 (the other keys' 0), and the sink's value is zero.

docs/design.md#long-context.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..core.tiling import SINK_DIMS

SEGMENTED_SDPA = "roundpipe_segmented_sdpa"
WINDOW_BLOCK = 1024
"""Queries per piece under a sliding window (the mask of a piece is block x (block +
window))."""


@dataclass(frozen=True)
class Segments:
    """Passed as the attention mask: the ``(start, stop)`` of each example (every row
    of the batch alike), each attending causally to itself only, within ``window``
    tokens when given."""

    bounds: tuple[tuple[int, int], ...]
    window: int | None = None

    def pieces(self) -> list[tuple[int, int, int]]:
        """``(query start, query stop, key start)``; keys stop where queries do."""
        if self.window is None:
            return [(a, b, a) for a, b in self.bounds]
        return [
            (qa, min(b, qa + WINDOW_BLOCK), max(a, qa - self.window + 1))
            for a, b in self.bounds
            for qa in range(a, b, WINDOW_BLOCK)
        ]


def segments_of(position_ids: torch.Tensor | None, length: int, window: int | None):
    """The examples of a batch: one per row when there are no ``position_ids`` (or they
    count up without restarting), else those of a one-row batch whose positions restart
    (as transformers finds packed sequences: a position not one more than the one before
    starts an example); ``None`` for several rows of packed examples."""
    if position_ids is None:
        return Segments(((0, length),), window)
    if position_ids.shape[0] != 1:
        restarts = (position_ids[:, 1:] != position_ids[:, :-1] + 1).any()
        return None if bool(restarts) else Segments(((0, length),), window)
    positions = position_ids[0]
    starts = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    edges = [0, *starts.tolist(), positions.numel()]
    return Segments(tuple(zip(edges[:-1], edges[1:], strict=True)), window)


@contextlib.contextmanager
def segmented_attention(config) -> Iterator[None]:
    """Layers reading ``config`` attend through :func:`attention` meanwhile (``config`` is
    a RoundPipe layer shell's own copy while it runs on a device)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SEGMENTED_SDPA, attention)  # idempotent
    AttentionMaskInterface.register(SEGMENTED_SDPA, sdpa_mask)
    before = config._attn_implementation
    config._attn_implementation = SEGMENTED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = before


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: ``(B, heads, S, dim)`` in, ``(B, S, heads, dim)``
    out. A :class:`Segments` mask runs piece by piece; anything else goes to the model's
    own implementation (SDPA, or GPT-OSS's eager one)."""
    sinks = kwargs.get("s_aux")
    if not isinstance(attention_mask, Segments):
        return _fallback(module, sinks)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if dropout:  # DecoderLayer passes no Segments under attention dropout
        raise ValueError("attention dropout is not drawn by roundpipe's segmented attention")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    shape = _Shape(query.shape[1] // key.shape[1], scale, attention_mask.window)
    extra = () if sinks is None else (sinks,)
    out = _Pieces.apply(attention_mask.pieces(), shape, query, key, value, *extra)
    return out.transpose(1, 2).contiguous(), None


def _fallback(module, sinks):
    if sinks is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    return sys.modules[type(module).__module__].eager_attention_forward


@dataclass(frozen=True)
class _Shape:
    groups: int
    """Query heads per key/value head."""
    scale: float
    window: int | None


def _attend(shape: _Shape, qa: int, ka: int, q, k, v, sinks=None) -> torch.Tensor:
    """One piece: queries from absolute position ``qa``, keys from ``ka`` to where the
    queries stop; ``(B, heads, queries, dim)`` out."""
    mask = None
    if shape.window is not None:  # query i sees keys j with i - window < j <= i
        rows = torch.arange(qa, qa + q.shape[2], device=q.device).unsqueeze(1)
        cols = torch.arange(ka, ka + k.shape[2], device=q.device).unsqueeze(0)
        mask = (cols <= rows) & (rows - cols < shape.window)
    if sinks is None:
        return _sdpa(q, k, v, mask, shape)
    # The sink rides on the queries: each query head's extra dimension holds
    # sink / scale, the one sink key (shared by every head) holds 1 there, the keys 0;
    # its score is then the head's sink, and its value is zero.
    b, h, lq, d = q.shape
    sink = (sinks.to(q.dtype) / shape.scale).view(1, h, 1, 1).expand(b, h, lq, 1)
    q = torch.cat([q, sink, q.new_zeros(b, h, lq, SINK_DIMS - 1)], dim=-1)
    hk = k.shape[1]
    sink_key = F.pad(k.new_ones(b, hk, 1, 1), (d, SINK_DIMS - 1))
    k = torch.cat([sink_key, F.pad(k, (0, SINK_DIMS))], dim=2)
    v = torch.cat([v.new_zeros(b, hk, 1, d + SINK_DIMS), F.pad(v, (0, SINK_DIMS))], dim=2)
    if mask is None:  # a query in front sees only the sink; then query i sees it and keys <= i
        q = torch.cat([q.new_zeros(b, h, 1, d + SINK_DIMS), q], dim=2)
        return _sdpa(q, k, v, None, shape)[:, :, 1:, :d]
    mask = torch.cat([mask.new_ones(lq, 1), mask], dim=1)
    return _sdpa(q, k, v, mask, shape)[..., :d]


def _sdpa(q, k, v, mask, shape: _Shape) -> torch.Tensor:
    """SDPA, causal without a mask; keys and values shared by ``groups`` query heads
    (``enable_gqa`` where PyTorch has it, else repeated)."""
    causal = mask is None
    if shape.groups > 1:
        try:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=shape.scale, enable_gqa=True
            )
        except TypeError:  # torch < 2.5
            k, v = (t.repeat_interleave(shape.groups, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=shape.scale
    )


class _Pieces(torch.autograd.Function):
    """:func:`_attend` over each piece; out ``(B, heads, S, dim)``. Nothing of a piece is
    kept: the backward recomputes each piece and adds its gradients into one tensor per
    input (slicing under autograd would make a whole-sequence gradient per piece)."""

    @staticmethod
    def forward(ctx, pieces, shape, query, key, value, *extra):
        out = query.new_empty(query.shape)
        for qa, qb, ka in pieces:
            kv = (key[:, :, ka:qb], value[:, :, ka:qb])
            out[:, :, qa:qb] = _attend(shape, qa, ka, query[:, :, qa:qb], *kv, *extra)
        ctx.save_for_backward(query, key, value, *extra)
        ctx.pieces, ctx.shape = pieces, shape
        return out

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        needed = ctx.needs_input_grad[2:]
        grads = [
            torch.zeros_like(t) if need else None for t, need in zip(saved, needed, strict=True)
        ]
        for qa, qb, ka in ctx.pieces:
            starts = (qa, ka, ka) + (None,) * (len(saved) - 3)
            ins = [
                (t if a is None else t[:, :, a:qb]).detach().requires_grad_(need)
                for t, a, need in zip(saved, starts, needed, strict=True)
            ]
            with torch.enable_grad():
                out = _attend(ctx.shape, qa, ka, *ins)
                wanted = [t for t in ins if t.requires_grad]
                found = iter(torch.autograd.grad(out, wanted, grad[:, :, qa:qb]))
            for g, a in zip(grads, starts, strict=True):
                if g is None:
                    continue
                if a is None:
                    g += next(found)
                else:
                    g[:, :, a:qb] += next(found)
        return (None, None, *grads)
