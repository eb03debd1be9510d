"""What keeps a decoder layer's device memory linear in the sequence, with a small slope.

- **Tiled MLP and norms**: with ``seq_chunk_tokens`` set (:mod:`roundpipe.core.tiling`),
  a decoder layer's MLP and its two RMSNorms run over chunks of the sequence; with
  autograd each chunk is a checkpoint recomputed in the backward, so the
  ``S x intermediate`` activations of the MLP, and the float32 copies a norm keeps,
  never exist for the whole sequence at once, only for one chunk.
- **Segmented attention**: packed sequences (``position_ids`` restarting per example)
  attend within each example through one memory-efficient SDPA call per example
  instead of an ``S x S`` block-diagonal mask.

docs/design.md#long-context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..core.tiling import TILED_LOSS_LOGITS, seq_chunk_tokens

SEGMENTED_SDPA = "roundpipe_segmented_sdpa"
"""The attention implementation (registered with ``transformers.AttentionInterface``
on first use) that runs SDPA per packed example."""


TOKENWISE = (
    "input_layernorm",
    "post_attention_layernorm",
    "mlp",
    "self_attn.q_norm",
    "self_attn.k_norm",
)
"""The submodules of a decoder layer that map ``(batch, S, ...)`` token by token (the
per-head norms of Qwen3 see ``(batch, S, heads, head_dim)``)."""


# -- tiled token-wise modules -------------------------------------------------------------


def tile_tokenwise(layer: nn.Module) -> None:
    """:func:`tile` the :data:`TOKENWISE` submodules of a decoder layer."""
    for name in TOKENWISE:
        module = layer
        for part in name.split("."):
            module = getattr(module, part, None)
        if isinstance(module, nn.Module):
            tile(module)


def tile(module: nn.Module) -> None:
    """Make ``module`` (mapping ``(batch, S, ...)`` to the same shape, token by token)
    follow :func:`seq_chunk_tokens`; without it, or for a sequence no longer than one
    chunk, it runs as before. Its state dict and parameters do not change."""
    if "forward" not in module.__dict__:
        module.forward = TiledForward(module)


class TiledForward:
    """A module's ``forward`` over chunks of the sequence (an object, not a bound
    method, so the module still pickles; ``deepcopy`` copies it with its module)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        module, chunk = self.module, seq_chunk_tokens()
        plain = type(module).forward
        if chunk is None or hidden.dim() < 3 or hidden.shape[1] <= chunk:
            return plain(module, hidden)
        pieces = hidden.split(chunk, dim=1)
        if not torch.is_grad_enabled():
            return torch.cat([plain(module, piece) for piece in pieces], dim=1)
        # The recompute runs in the backward, when RoundPipe has unbound the layer's
        # device tensors: they are passed in, not read from the module then.
        names, tensors = _state(module)
        return torch.cat(
            [
                checkpoint(_run_piece, module, names, piece, *tensors, use_reentrant=False)
                for piece in pieces
            ],
            dim=1,
        )


def _state(module: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return list(state), list(state.values())


def _run_piece(module: nn.Module, names: list[str], piece: torch.Tensor, *tensors):
    return torch.func.functional_call(module, dict(zip(names, tensors, strict=True)), (piece,))


# -- the loss ----------------------------------------------------------------------------


def loss_chunk_tokens(tokens: int, vocab_size: int) -> int:
    """Tokens per chunk of the head's loss: ``tokens``, or, with sequence tiling on,
    no more than keeps one chunk's logits to ``TILED_LOSS_LOGITS`` (a large vocabulary's
    logits of a few thousand tokens would outweigh a long sequence's activations)."""
    if seq_chunk_tokens() is None:
        return tokens
    return max(1, min(tokens, TILED_LOSS_LOGITS // max(vocab_size, 1)))


# -- segmented attention ------------------------------------------------------------------


@dataclass(frozen=True)
class Segments:
    """Passed as the attention mask: the ``(start, stop)`` of each packed example of a
    batch of one sequence; each attends causally to itself only."""

    bounds: tuple[tuple[int, int], ...]


def packed_segments(position_ids: torch.Tensor) -> Segments | None:
    """The examples of a one-sequence batch whose positions restart (as transformers
    finds packed sequences: a position not one more than the one before starts an
    example), or ``None`` when it holds one example (plain causal attention)."""
    if position_ids.shape[0] != 1:
        return None
    positions = position_ids[0]
    starts = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    if starts.numel() == 0:
        return None
    edges = [0, *starts.tolist(), positions.numel()]
    return Segments(tuple(zip(edges[:-1], edges[1:], strict=True)))


@contextlib.contextmanager
def segmented_attention(config) -> Iterator[None]:
    """Run the layers reading ``config`` with :data:`SEGMENTED_SDPA` (``config`` is a
    RoundPipe layer shell's own copy while it runs on a device)."""
    _register()
    before = config._attn_implementation
    config._attn_implementation = SEGMENTED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = before


def _segmented_sdpa(module, query, key, value, attention_mask, **kwargs):
    """SDPA over each example of a :class:`Segments` mask (``(B, S, heads, dim)``
    out, as transformers' SDPA returns); any other mask: transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(attention_mask, Segments):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def attend(q, k, v):
        return sdpa_attention_forward(module, q, k, v, None, **kwargs)[0]

    return _PerExample.apply(attend, attention_mask.bounds, query, key, value), None


class _PerExample(torch.autograd.Function):
    """``attend`` run on each example's slice of ``(B, heads, S, dim)`` queries, keys and
    values; out ``(B, S, heads, dim)``. Each example's graph is kept; the backward writes
    each example's gradients into one tensor per input (slicing under autograd would
    make a whole-sequence gradient per example and add them up)."""

    @staticmethod
    def forward(ctx, attend, bounds, query, key, value):
        graphs, outputs = [], []
        with torch.enable_grad():
            for a, b in bounds:
                ins = [
                    t.detach()[:, :, a:b].requires_grad_(t.requires_grad)
                    for t in (query, key, value)
                ]
                out = attend(*ins)
                graphs.append((ins, out))
                outputs.append(out.detach())
        ctx.graphs, ctx.bounds = graphs, bounds
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in (query, key, value)]
        return torch.cat(outputs, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grads = [
            torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes
        ]
        for (a, b), (ins, out) in zip(ctx.bounds, ctx.graphs, strict=True):
            wanted = [t for t in ins if t.requires_grad]
            pieces = iter(torch.autograd.grad(out, wanted, grad[:, a:b]))
            for whole, t in zip(grads, ins, strict=True):
                if t.requires_grad:
                    whole[:, :, a:b] = next(pieces)
        ctx.graphs = None
        return (
            None,
            None,
            *(g if ctx.needs_input_grad[i + 2] else None for i, g in enumerate(grads)),
        )


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SEGMENTED_SDPA, _segmented_sdpa)  # idempotent
    AttentionMaskInterface.register(SEGMENTED_SDPA, sdpa_mask)
