"""Evaluation during ``roundpipe train``: the held-out set's loss and token accuracy,
as ``transformers``' Trainer and TRL's SFTTrainer log them (``eval_loss``,
``eval_mean_token_accuracy``)."""

from __future__ import annotations

from .ranks import Ranks


def evaluate(pipe, batches, ranks: Ranks | None = None) -> tuple[float, float]:
    """The mean cross-entropy over every label token of ``batches`` (all of its first
    epoch), in eval mode, without gradients and through the head's chunked loss, and
    the mean over its batches of their ``mean_token_accuracy`` (as TRL averages what it
    logs); the pipe is synchronized first, so the newest weights answer. Under
    ``torchrun`` rank r evaluates batches r, r + K, ... and the ranks' sums are added
    (every rank returns the whole set's means)."""
    ranks = ranks or Ranks()
    pipe.synchronize()
    training = pipe.training
    pipe.eval()  # as Trainer evaluates: no dropout
    count: float  # summed over the ranks as floats
    evaluated: float
    total, count, accuracy, evaluated = 0.0, 0, 0.0, 0
    try:
        for index in range(ranks.rank, batches.steps_per_epoch, ranks.world):
            tokens = batches.num_label_tokens(index)
            loss, metrics = pipe.eval_loss(batches.batch(index), return_metrics=True)
            total += float(loss) * tokens
            count += tokens
            accuracy, evaluated = accuracy + metrics["mean_token_accuracy"], evaluated + 1
    finally:
        pipe.train(training)
    if ranks.world > 1:
        sums = [total, count, accuracy, evaluated]
        total, count, accuracy, evaluated = ranks.sum(sums, "the evaluation sums")
    return total / count, accuracy / evaluated
