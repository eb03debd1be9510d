"""What ``roundpipe train --method dpo|kto`` does differently from SFT: its data
(:mod:`.preference_data`), each step's loss through :mod:`roundpipe.preference`, the
reference, and the evaluation (docs/design.md#preference-tuning).

The reference of a LoRA run is the pipe with its adapters off, at every step; a full
fine-tune's is the model as loaded, whose log-probabilities of every example are
computed once, in one forward-only pass before the first step (before a checkpoint is
loaded on ``--resume``: the same numbers), and kept in host memory (8 bytes per
example), as TRL's ``precompute_ref_log_probs``; a LoRA run does so too with
``--precompute-ref-log-probs`` (adapters off, before a checkpoint loads).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..preference import (
    NonFiniteStep,
    adapters_off,
    completion_lengths,
    dpo_forward_backward,
    dpo_loss,
    dpo_metrics,
    is_lora_pipe,
    kl_rows_of,
    kto_forward_backward,
    kto_kl,
    kto_loss,
    kto_metrics,
    main_rows,
    reference_logps,
)
from .evaluation import SftSteps
from .preference_data import (
    PreferenceBatches,
    load_preference_dataset,
    load_preference_held_out,
)
from .ranks import Ranks
from .sources import DataError
from .usage import UsageError

SHOWN = {"rewards/margins": "margin", "rewards/accuracies": "acc", "kl": "kl"}
"""The metrics the progress line shows, and their short names."""


def preference_batches(options: Any, tokenizer: Any, notes: list[str], pad_id: int):
    """The training and evaluation batches of a DPO or KTO run, and notes on them."""
    reading = {"split": options.data_split, "fields": options.data_fields}
    method, length = options.method, options.seq_len
    try:
        if options.eval_split is not None:
            train, held_out = load_preference_held_out(
                options.data, tokenizer, length, method, options.eval_split, options.seed,
                **reading,
            )  # fmt: skip
        else:
            train = load_preference_dataset(options.data, tokenizer, length, method, **reading)
            held_out = None
            if options.eval_data is not None:
                held_out = load_preference_dataset(
                    options.eval_data, tokenizer, length, method, **reading
                )
    except DataError as error:
        raise UsageError(str(error)) from error
    result: list[PreferenceBatches | None] = []
    for dataset, what in ((train, "training"), (held_out, "evaluation")):
        if dataset is None:
            result.append(None)
            continue
        unit = "pairs" if method == "dpo" else "examples"
        note = f"{what} data {dataset.path} ({dataset.format}): {len(dataset.examples)} {unit}"
        if dataset.truncated:
            note += f", {dataset.truncated} cut to --max-length {length} tokens"
        notes.append(note)
        result.append(PreferenceBatches(dataset, options.batch_size, options.seed, pad_id))
    return tuple(result)


def steps_of(prepared: Any, ranks: Ranks):
    """What each step of the run ``prepared`` computes, and its evaluation: SFT's
    (:class:`~.evaluation.SftSteps`) or a preference method's."""
    if prepared.options.method == "sft":
        return SftSteps(prepared.train_batches, prepared.eval_batches, ranks)
    return PreferenceSteps(prepared.options, prepared.train_batches, prepared.eval_batches, ranks)


class PreferenceSteps:
    """The steps and evaluations of a DPO or KTO run over ``train`` (and ``held_out``)
    batches; :meth:`start` before the first step (and before a checkpoint loads)."""

    def __init__(
        self,
        options: Any,
        train: PreferenceBatches,
        held_out: PreferenceBatches | None,
        ranks: Ranks,
    ) -> None:
        self.options, self.ranks = options, ranks
        self.train_batches, self.eval_batches = train, held_out
        self.tables: dict[str, torch.Tensor] | None = None  # full: the reference, per example

    def start(self, pipe, say) -> None:
        """A full fine-tune (or ``--precompute-ref-log-probs``): the reference
        log-probabilities of every example, from the weights as loaded (a LoRA run's
        with its adapters off), in one forward-only pass over the data."""
        lora = is_lora_pipe(pipe)
        if lora and not self.options.precompute_ref_log_probs:
            return
        count = len(self.train_batches.examples)
        what = "the base, adapters off" if lora else "the model as loaded"
        say(f"computing the reference log-probabilities of the {count} training examples "
            f"({what})")  # fmt: skip
        with adapters_off(pipe) if lora else contextlib.nullcontext():
            self.tables = {"train": _reference_table(pipe, self.train_batches)}
            if self.eval_batches is not None:
                self.tables["eval"] = _reference_table(pipe, self.eval_batches)

    def step(
        self, pipe, index: int, batch: dict, run_config
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Step ``index``'s forward-backward of ``batch``: its loss and TRL's metrics.
        One whose loss or reference is not finite stops the run before its gradients
        reach the weights (:class:`~roundpipe.preference.NonFiniteStep`, exit code 1)."""
        try:
            return self._step(pipe, index, batch, run_config)
        except NonFiniteStep as error:
            raise NonFiniteStep(
                f"step {index + 1}: {error}; the step was not applied (the weights are "
                "those after the step before)"
            ) from None

    def _step(
        self, pipe, index: int, batch: dict, run_config
    ) -> tuple[torch.Tensor, dict[str, float]]:
        refs = self._given(self.train_batches, "train", index)
        o, examples = self.options, len(self.train_batches.indices(index))
        several = self.ranks.world > 1
        gather = self._gather if several else None
        batch, refs = self._share(batch, refs)
        if o.method == "dpo":
            return dpo_forward_backward(
                pipe, batch, beta=o.beta, loss_type=o.loss_type,
                label_smoothing=o.label_smoothing, ref_logps=refs[0], run_config=run_config,
                batch_pairs=examples, gather=gather,
            )  # fmt: skip
        return kto_forward_backward(
            pipe, batch, beta=o.beta, desirable_weight=o.desirable_weight,
            undesirable_weight=o.undesirable_weight, ref_logps=refs[0], ref_kl_logps=refs[1],
            run_config=run_config, batch_rows=examples, gather=gather,
        )  # fmt: skip

    def _share(self, batch: dict, refs: tuple) -> tuple[dict, tuple]:
        """This process's examples of the global batch (a DPO pair's two rows together),
        and of the given reference log-probabilities."""
        if self.ranks.world == 1:
            return batch, refs
        per = 2 if self.options.method == "dpo" else 1

        def mine(tensor):
            if tensor is None:
                return None
            grouped = tensor.view(-1, per, *tensor.shape[1:])
            return torch.tensor_split(grouped, self.ranks.world)[self.ranks.rank].flatten(0, 1)

        return {k: mine(v) for k, v in batch.items()}, tuple(mine(r) for r in refs)

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's rows of ``tensor``, in rank order (the global batch's)."""
        return torch.cat(self.ranks.gather(tensor.detach().cpu(), "the preference metrics"))

    def evaluate(self, pipe) -> dict[str, float]:
        """The held-out set's loss and metrics, without gradients, in eval mode: the mean
        over its pairs (examples) of the loss, the mean over its batches of each metric
        (as TRL averages what it logs), each named ``eval_...``. Every process evaluates
        the whole set (no collective)."""
        assert self.eval_batches is not None
        pipe.synchronize()
        training = pipe.training
        pipe.eval()
        total, count = 0.0, 0
        sums: dict[str, float] = {}
        seen: dict[str, int] = {}
        try:
            for index in range(self.eval_batches.steps_per_epoch):
                losses, metrics = self._eval_batch(pipe, index)
                total, count = total + float(losses.sum()), count + losses.numel()
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
                    seen[key] = seen.get(key, 0) + 1
        finally:
            pipe.train(training)
        return {"eval_loss": total / count, **{f"eval_{k}": sums[k] / seen[k] for k in sums}}

    def shown(self, metrics: dict[str, float]) -> str:
        """The progress line's part for a step: its reward margin and accuracy (DPO) or
        KL estimate (KTO)."""
        parts = [f"{short} {metrics[k]:.3f}" for k, short in SHOWN.items() if k in metrics]
        return "  ".join(parts)

    def _eval_batch(self, pipe, index: int) -> tuple[torch.Tensor, dict[str, float]]:
        o, batches = self.options, self.eval_batches
        assert batches is not None
        batch = batches.batch(index)
        given = self._given(batches, "eval", index)
        main = main_rows(batch)
        logps = pipe.sequence_logps(main)
        ref = given[0] if given[0] is not None else reference_logps(pipe, main)
        if o.method == "dpo":
            lengths = completion_lengths(main["labels"])
            losses, _, _ = dpo_loss(
                logps[0::2], logps[1::2], ref[0::2], ref[1::2], beta=o.beta,
                loss_type=o.loss_type, label_smoothing=o.label_smoothing,
                chosen_lengths=lengths[0::2], rejected_lengths=lengths[1::2],
            )  # fmt: skip
            return losses, dpo_metrics(logps, ref, o.beta)
        kl_rows = kl_rows_of(batch)
        ref_kl = given[1] if given[1] is not None else reference_logps(pipe, kl_rows)
        kl = kto_kl(pipe.sequence_logps(kl_rows), ref_kl)
        desirable = batch["desirable"]
        losses, _ = kto_loss(
            logps, ref, desirable, kl, beta=o.beta, desirable_weight=o.desirable_weight,
            undesirable_weight=o.undesirable_weight,
        )  # fmt: skip
        return losses, kto_metrics(logps, ref, desirable, kl, o.beta)

    def _given(self, batches: PreferenceBatches, side: str, index: int) -> tuple:
        """A full fine-tune's reference of batch ``index``: (rows', KL rows') or Nones."""
        if self.tables is None:
            return None, None
        table = self.tables[side][batches.indices(index)]
        if self.options.method == "dpo":
            return table.flatten(), None  # chosen, rejected of each pair: its rows' order
        return table[:, 0].contiguous(), table[:, 1].contiguous()


def _reference_table(pipe, batches: PreferenceBatches) -> torch.Tensor:
    """Each example's reference log-probabilities, in dataset order: (chosen, rejected)
    of a pair, (completion, KL row) of a KTO example."""
    rows = []
    count = len(batches.examples)
    for start in range(0, count, batches.batch_size):
        batch = batches.batch_of(list(range(start, min(start + batches.batch_size, count))))
        logps = pipe.sequence_logps(main_rows(batch))
        if batches.method == "dpo":
            rows.append(logps.view(-1, 2))
        else:
            kl = pipe.sequence_logps(kl_rows_of(batch))
            rows.append(torch.stack([logps, kl], dim=1))
    return torch.cat(rows)
