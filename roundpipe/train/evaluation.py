"""An SFT run's steps and evaluation during ``roundpipe train``: the batch's loss and
token accuracy, and the held-out set's, as ``transformers``' Trainer and TRL's
SFTTrainer log them (``eval_loss``, ``eval_mean_token_accuracy``). A DPO or KTO run's
are :class:`~roundpipe.train.preference_run.PreferenceSteps`, alike in shape."""

from __future__ import annotations

from typing import Any

from .ranks import Ranks


class SftSteps:
    """What each step of an SFT run computes (``start``, ``step``, ``evaluate`` and
    ``shown``, as every method's steps have them)."""

    def __init__(self, train, held_out, ranks: Ranks) -> None:
        self.train_batches, self.eval_batches, self.ranks = train, held_out, ranks

    def start(self, pipe, say) -> None:
        """Nothing to prepare: SFT has no reference."""

    def step(self, pipe, index: int, batch: dict, run_config) -> tuple[Any, dict[str, float]]:
        """Step ``index``'s forward-backward of ``batch`` (this rank's rows of it): its
        loss (read after the optimizer step was queued) and the metrics logged with it."""
        share = self.ranks.share(batch)
        loss, metrics = pipe.forward_backward(
            input_kwargs=share, run_config=run_config, return_metrics=True
        )
        return loss, {"mean_token_accuracy": metrics["mean_token_accuracy"]}

    def evaluate(self, pipe) -> dict[str, float]:
        loss, accuracy = evaluate(pipe, self.eval_batches, self.ranks)
        return {"eval_loss": loss, "eval_mean_token_accuracy": accuracy}

    def shown(self, metrics: dict[str, float]) -> str:
        return ""  # the loss is shown already


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
