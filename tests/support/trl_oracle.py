"""TRL 1.16's ``DPOTrainer`` and ``KTOTrainer`` as oracles (``trl`` from the package
index, in ``.[dev]``): built on a tiny model and tokenizer in code, driven one batch at
a time through their own ``_compute_loss`` so a test compares a step's loss, metrics and
gradients with ours on the same rows."""

from __future__ import annotations

import copy
import os
import warnings

import torch

os.environ.setdefault("TQDM_DISABLE", "1")


def trl_trainer(
    kind: str, model, tokenizer, records: list[dict], directory, peft_config=None, **config
):
    """A TRL ``DPOTrainer`` (``kind="dpo"``) or ``KTOTrainer`` over ``records``; a
    full model gets a deep copy of itself as its reference; with ``peft_config`` TRL
    adds the adapters itself (``trainer.model``) and its reference is the base model,
    the adapters off (as for a policy whose adapters ``roundpipe train`` adds)."""
    import datasets
    import trl

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config_class = trl.DPOConfig if kind == "dpo" else trl.KTOConfig
        trainer_class = trl.DPOTrainer if kind == "dpo" else trl.KTOTrainer
        args = config_class(
            output_dir=str(directory),
            report_to=[],
            use_cpu=True,
            logging_steps=1,
            bf16=False,  # TRL's default: bf16 autocast, also on CPUs
            per_device_train_batch_size=len(records),
            **config,
        )
        ref = None if peft_config is not None else copy.deepcopy(model)
        return trainer_class(
            model=model,
            ref_model=ref,
            peft_config=peft_config,
            args=args,
            train_dataset=datasets.Dataset.from_list(records),
            processing_class=tokenizer,
        )


def trl_batch(trainer) -> dict:
    """TRL's collated batch of its whole (prepared) training set, in dataset order."""
    dataset = trainer.train_dataset
    return trainer.data_collator([dataset[i] for i in range(len(dataset))])


def trl_step(trainer, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's loss of ``batch`` with its gradients accumulated into the model, and the
    metrics it logged for it."""
    trainer._metrics["train"].clear()
    trainer.model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = trainer._compute_loss(trainer.model, batch, False)
    loss.backward()
    return loss.detach(), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def pair_adjacent(batch: dict) -> dict:
    """TRL's DPO rows ``[chosen..., rejected...]`` as ours, ``[chosen_0, rejected_0, ...]``,
    with labels: the completion tokens (``-100`` elsewhere)."""
    rows = batch["input_ids"].shape[0]
    order = torch.stack([torch.arange(rows // 2), torch.arange(rows // 2, rows)], 1).flatten()
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    return {
        "input_ids": batch["input_ids"][order],
        "attention_mask": batch["attention_mask"][order],
        "labels": labels[order],
    }
