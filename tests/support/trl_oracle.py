"""TRL 1.16's ``DPOTrainer`` and ``KTOTrainer`` as oracles (``trl`` from the package
index, in ``.[dev]``): built on a tiny model and tokenizer in code, driven one batch at
a time through their own ``_compute_loss`` so a test compares a step's loss, metrics and
gradients with ours on the same rows."""

from __future__ import annotations

import copy
import os
import random
import warnings
from collections.abc import Sequence

import torch

from support.train_fixtures import WORDS, tiny_qwen3_config

os.environ.setdefault("TQDM_DISABLE", "1")


def paired_records(count: int, seed: int = 0, conversational: bool = False) -> list[dict]:
    """``count`` TRL paired records (``prompt``, ``chosen``, ``rejected``) of random
    words: text (completions after a space) or conversational (message lists)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt, chosen = _words(rng, rng.randint(2, 5)), _words(rng, rng.randint(1, 4))
        rejected = _words(rng, 3)
        rows.append({"prompt": _message("user", prompt, conversational),
                     "chosen": _message("assistant", chosen, conversational),
                     "rejected": _message("assistant", rejected, conversational)})  # fmt: skip
    return rows


def unpaired_records(
    labels: Sequence[bool], seed: int = 0, conversational: bool = False
) -> list[dict]:
    """TRL unpaired records (``prompt``, ``completion``, ``label``), one per label."""
    rng = random.Random(seed)
    rows = []
    for label in labels:
        prompt, completion = _words(rng, rng.randint(2, 5)), _words(rng, rng.randint(1, 4))
        rows.append({"prompt": _message("user", prompt, conversational),
                     "completion": _message("assistant", completion, conversational),
                     "label": label})  # fmt: skip
    return rows


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS[3:]) for _ in range(count))


def _message(role: str, text: str, conversational: bool):
    if conversational:
        return [{"role": role, "content": text}]
    return text if role == "user" else " " + text


def tiny_model(tokenizer):
    """A tiny fp32 Qwen3 for ``tokenizer``'s vocabulary, seeded."""
    import transformers

    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(tiny_qwen3_config(len(tokenizer))).float()


def lora_config():
    """The LoRA adapters TRL adds (``peft_config``): r 4 on attention and MLP layers."""
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])


def trained_policy(trainer):
    """TRL's policy moved away from its reference (the adapters off zero; a full model's
    weights by noise), and a copy of it for us."""
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            elif param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return copy.deepcopy(trainer.model)


def trl_reference_logps(trainer, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's reference log-probabilities of ``batch`` (its ``compute_ref_log_probs``:
    DPO's chosen and rejected rows; KTO's rows and KL rows)."""
    with torch.no_grad():
        return trainer.compute_ref_log_probs(trainer.ref_model or trainer.model, batch)


def trl_trainer(
    kind: str, model, tokenizer, records: list[dict], directory, peft_config=None, **config
):
    """A TRL ``DPOTrainer`` (``kind="dpo"``) or ``KTOTrainer`` over ``records``; a
    full model gets a deep copy of itself as its reference; with ``peft_config`` TRL
    adds the adapters itself (``trainer.model``) and its reference is the base model,
    the adapters off (as for a policy whose adapters ``roundpipe train`` adds). The batch
    is every record unless ``per_device_train_batch_size`` says otherwise (KTO unpairs
    paired records into twice as many rows, and forms its KL rows within a batch)."""
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
            **{"per_device_train_batch_size": len(records), **config},
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


def kto_rows(batch: dict) -> dict:
    """TRL's collated KTO batch as ours: labels and KL labels the completion tokens
    (``-100`` elsewhere), ``desirable`` TRL's ``label``."""
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "labels": batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100),
        "desirable": batch["label"],
        "kl_input_ids": batch["KL_input_ids"],
        "kl_attention_mask": batch["KL_attention_mask"],
        "kl_labels": batch["KL_input_ids"].masked_fill(batch["KL_completion_mask"] == 0, -100),
    }
