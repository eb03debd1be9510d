"""What keeps a decoder layer's device memory linear in the sequence, with a small slope.

- **Tiled MLP and norms**: with ``seq_chunk_tokens`` set (:mod:`roundpipe.core.tiling`),
  a decoder layer's MLP and its two RMSNorms run over chunks of the sequence; with
  autograd each chunk is a checkpoint recomputed in the backward, so the
  ``S x intermediate`` activations of the MLP, and the float32 copies a norm keeps,
  never exist for the whole sequence at once, only for one chunk.
- **The loss in chunks** (:func:`chunked_loss`), of at most ``TILED_LOSS_LOGITS``
  logits under tiling.

Attention without ``S x S`` tensors is :mod:`.attention`'s.

docs/design.md#long-context.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ..core.row_losses import row_losses
from ..core.tiling import TILED_LOSS_LOGITS, seq_chunk_tokens

IGNORE_INDEX = -100
"""The label of a position that is not trained (transformers' convention)."""
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
        module: nn.Module | None = layer
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

    def __call__(self, hidden: torch.Tensor):
        module, chunk = self.module, seq_chunk_tokens()
        plain = type(module).forward
        if chunk is None or hidden.dim() < 3 or hidden.shape[1] <= chunk:
            return plain(module, hidden)
        pieces = hidden.split(chunk, dim=1)
        if not torch.is_grad_enabled():
            outputs = [plain(module, piece) for piece in pieces]
        else:
            # The recompute runs in the backward, when RoundPipe has unbound the layer's
            # device tensors: they are passed in, not read from the module then.
            names, tensors = module_state(module)
            outputs = [checkpointed(_run_piece, module, names, piece, *tensors) for piece in pieces]
        return _joined(outputs, hidden.shape[0])


def checkpointed(function, *args, **options):
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
    **options)`` that never raises from inside the checkpoint. Before torch 2.13 an
    exception raised there leaves the checkpoint's saved-tensor hooks pushed on the
    thread, and every later backward of that thread (a worker's, for every later call)
    saves through them; so the forward's exception is caught inside, the checkpoint
    returns normally, and it is raised once the hooks were popped. The recompute (in the
    backward, a later call of ``function``) raises as it would."""
    failures: list[BaseException] = []
    runs: list[None] = []

    def guarded(*inputs):
        runs.append(None)
        if len(runs) > 1:  # the recompute, in the backward
            return function(*inputs)
        try:
            return function(*inputs)
        except BaseException as error:  # noqa: BLE001 - raised below, outside the hooks
            failures.append(error)
            return None

    output = checkpoint(guarded, *args, use_reentrant=False, **options)
    if failures:
        raise failures.pop()  # named by no local: no cycle keeps its frames alive
    return output


def _joined(outputs: list, batch: int):
    """The pieces' outputs as one: tensors along the sequence (dim 1), or, when they are
    per token flattened (``(batch x tokens, ...)``: an MoE block's router scores),
    along the tokens of each row; a tuple element by element."""
    first = outputs[0]
    if isinstance(first, tuple):
        return tuple(_joined([out[i] for out in outputs], batch) for i in range(len(first)))
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"a tiled module returned {type(first).__name__}, not tensors")
    if first.dim() >= 3:
        return torch.cat(outputs, dim=1)
    rows = [out.view(batch, -1, *out.shape[1:]) for out in outputs]
    return torch.cat(rows, dim=1).flatten(0, 1)


def module_state(module: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """The names and tensors of ``module``'s parameters and buffers, to pass into a
    recomputed piece (``torch.func.functional_call``) instead of reading the module."""
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


def chunked_loss(hidden, labels, chunk_tokens: int, vocab_size: int, logits_of, *tensors):
    """The summed cross-entropy of ``labels`` shifted by one (``IGNORE_INDEX`` ignored)
    over ``hidden`` (B x S x H), and how many of those labels are the logits' argmax (an
    int64 scalar, no gradient: TRL's ``mean_token_accuracy`` counts them so), in chunks
    of :func:`loss_chunk_tokens` tokens, each recomputed in the backward under autograd,
    so the fp32 logits of the whole sequence never exist. ``logits_of(chunk, *tensors)``
    gives a chunk's logits; the head's tensors are passed in, not read from its module:
    the recompute runs in the backward, when RoundPipe has already unbound the layer's
    device tensors. Under :func:`~roundpipe.core.row_losses.row_losses`, both per row
    (:func:`chunked_row_losses`)."""
    if row_losses():
        return chunked_row_losses(hidden, labels, chunk_tokens, vocab_size, logits_of, *tensors)
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    correct = torch.zeros((), dtype=torch.int64, device=hidden.device)
    step = loss_chunk_tokens(chunk_tokens, vocab_size)
    pieces = [
        (hidden[i : i + step], targets[i : i + step]) for i in range(0, targets.numel(), step)
    ]
    return _summed(_piece_loss, pieces, logits_of, tensors, total, correct)


def _summed(piece_loss, pieces: list, logits_of, tensors: tuple, total, correct):
    """``total`` and ``correct`` plus each ``(hidden, targets)`` piece's loss and count by
    ``piece_loss``, each recomputed in the backward under autograd."""
    for hidden, targets in pieces:
        args = (logits_of, hidden, targets, *tensors)
        if torch.is_grad_enabled():
            loss, right = checkpointed(piece_loss, *args, preserve_rng_state=False)
        else:
            loss, right = piece_loss(*args)
        total, correct = total + loss, correct + right
    return total, correct


def _piece_loss(logits_of, hidden, targets, *tensors):
    logits = logits_of(hidden, *tensors)
    logits = logits.reshape(-1, logits.shape[-1]).float()
    with torch.no_grad():  # an ignored label (-100) is never an argmax
        correct = (logits.argmax(dim=-1) == targets).sum()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum"), correct


def chunked_row_losses(hidden, labels, chunk_tokens: int, vocab_size: int, logits_of, *tensors):
    """:func:`chunked_loss` per row: each row's summed cross-entropy of its shifted labels
    (float32, B) and its count of correct argmaxes (int64, B), in chunks of whole columns
    of about as many tokens, so every row's sum is added in the order of its positions
    whatever the batch (no atomic scatter: the same bits on every device)."""
    hidden, targets = hidden[:, :-1], labels[:, 1:]
    rows, columns = targets.shape
    totals = hidden.new_zeros(rows, dtype=torch.float32)
    correct = torch.zeros(rows, dtype=torch.int64, device=hidden.device)
    step = max(1, loss_chunk_tokens(chunk_tokens, vocab_size) // max(rows, 1))
    pieces = [(hidden[:, i : i + step], targets[:, i : i + step]) for i in range(0, columns, step)]
    return _summed(_piece_row_losses, pieces, logits_of, tensors, totals, correct)


def _piece_row_losses(logits_of, hidden, targets, *tensors):
    rows, columns = targets.shape
    logits = logits_of(hidden.reshape(rows * columns, hidden.shape[-1]), *tensors)
    logits = logits.reshape(rows * columns, -1).float()
    flat = targets.reshape(-1)
    with torch.no_grad():
        correct = (logits.argmax(dim=-1) == flat).view(rows, columns).sum(dim=1)
    losses = F.cross_entropy(logits, flat, ignore_index=IGNORE_INDEX, reduction="none")
    return losses.view(rows, columns).sum(dim=1), correct
