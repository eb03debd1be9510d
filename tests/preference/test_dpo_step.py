"""One DPO step through a ``from_hf`` pipe equals TRL 1.16's ``DPOTrainer`` on the same
rows: the loss, the metrics TRL logs and the gradients, for every loss type, a full
model (reference log-probabilities given, as precomputed) and a LoRA one (the reference:
the same pipe with its adapters off, as TRL's peft path)."""

from __future__ import annotations

import copy

import pytest
import torch
from support.train_fixtures import build_tokenizer
from support.trl_oracle import (
    lora_config,
    pair_adjacent,
    paired_records,
    tiny_model,
    trained_policy,
    trl_batch,
    trl_reference_logps,
    trl_step,
    trl_trainer,
)

import roundpipe
from roundpipe.preference import dpo_forward_backward

pytest.importorskip("trl")

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected", "mean_token_accuracy")  # fmt: skip


@pytest.mark.parametrize(
    ("loss_type", "smoothing"), [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.1)]
)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_dpo_step_equals_trls(loss_type, smoothing, lora, tmp_path):
    tokenizer = build_tokenizer()
    beta = 0.3
    trainer = trl_trainer(
        "dpo", tiny_model(tokenizer), tokenizer, paired_records(6, conversational=lora), tmp_path,
        peft_config=lora_config() if lora else None,
        beta=beta, loss_type=[loss_type], label_smoothing=smoothing, max_length=64,
    )  # fmt: skip
    ours = trained_policy(trainer)
    batch = trl_batch(trainer)
    ref_chosen, ref_rejected = trl_reference_logps(trainer, batch)
    ref = torch.stack([ref_chosen, ref_rejected], 1).flatten()
    if not lora:  # given, as precomputed: TRL reads them from the batch
        trainer.precompute_ref_logps = True
        batch = {**batch, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    trl_loss, trl_metrics = trl_step(trainer, batch)

    with roundpipe.from_hf(ours, devices="emulated:2") as pipe:
        pipe.train()
        loss, metrics = dpo_forward_backward(
            pipe, pair_adjacent(batch), beta=beta, loss_type=loss_type,
            label_smoothing=smoothing, ref_logps=None if lora else ref,
        )  # fmt: skip
        pipe.synchronize()
        grads = {name: p.grad for name, p in pipe.optim_named_parameters()}

    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-7)
    for name in METRICS:
        assert metrics[name] == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6), name
    trained = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert grads.keys() == trained.keys()
    for name, param in trained.items():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_lora_reference_is_the_base_model_with_the_adapters_off(tmp_path):
    """Our reference pass (adapters off) equals TRL's reference pass of the peft model."""
    tokenizer = build_tokenizer()
    trainer = trl_trainer(
        "dpo",
        tiny_model(tokenizer),
        tokenizer,
        paired_records(4),
        tmp_path,
        peft_config=lora_config(),
    )
    model = trained_policy(trainer)
    batch = trl_batch(trainer)
    ref_chosen, ref_rejected = trl_reference_logps(trainer, batch)
    with roundpipe.from_hf(model, devices="emulated:2") as pipe:
        from roundpipe.preference import reference_logps

        ours = reference_logps(pipe, pair_adjacent(batch))
        policy = pipe.sequence_logps(pair_adjacent(batch))
    expected = torch.stack([ref_chosen, ref_rejected], 1).flatten()
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    assert (policy - ours).abs().max() > 1e-2  # the adapters were on for the policy


def test_a_step_with_a_nan_reference_is_refused_before_anything_runs(tmp_path):
    tokenizer = build_tokenizer()
    model = tiny_model(tokenizer)
    trainer = trl_trainer("dpo", copy.deepcopy(model), tokenizer, paired_records(2), tmp_path)
    batch = pair_adjacent(trl_batch(trainer))
    from roundpipe.preference import NonFiniteStep

    with roundpipe.from_hf(model, devices="emulated:2") as pipe:
        with pytest.raises(NonFiniteStep, match="not finite"):
            dpo_forward_backward(pipe, batch, ref_logps=torch.tensor([0.0, float("nan")] * 2))
        assert all(p.grad is None for p in pipe.optim_parameters())
