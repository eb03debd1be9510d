"""One KTO step through a ``from_hf`` pipe equals TRL 1.16's ``KTOTrainer`` on the same
rows: the loss, the metrics TRL logs and the gradients, for a full model (reference
log-probabilities given, as precomputed) and a LoRA one (the reference: the same pipe
with its adapters off, as TRL's peft path); unpaired records, paired ones TRL unpairs,
conversations; and a batch of desirable examples only, where TRL logs no rejected
metrics."""

from __future__ import annotations

import pytest
import torch
from support.train_fixtures import build_tokenizer
from support.trl_oracle import (
    kto_rows,
    lora_config,
    paired_records,
    tiny_model,
    trained_policy,
    trl_batch,
    trl_reference_logps,
    trl_step,
    trl_trainer,
    unpaired_records,
)

import roundpipe
from roundpipe.preference import kto_forward_backward

pytest.importorskip("trl")

METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins",
           "logps/chosen", "logps/rejected")  # fmt: skip
LABELS = (True, False, False, True, True, False, True)
RECORDS = {
    "unpaired": lambda: unpaired_records(LABELS),
    "paired": lambda: paired_records(4, seed=2),
    "conversational": lambda: unpaired_records(LABELS, seed=3, conversational=True),
    "desirable only": lambda: unpaired_records([True] * 5, seed=4),
}
WEIGHTS = {"unpaired": (1.0, 1.0), "paired": (1.33, 0.75), "conversational": (0.8, 1.5),
           "desirable only": (1.2, 1.0)}  # fmt: skip


def kto_step(data: str, lora: bool, directory) -> tuple[tuple, tuple]:
    """TRL's step and ours on the same policy and rows: each ``(loss, metrics, grads)``."""
    tokenizer = build_tokenizer()
    beta, (desirable_weight, undesirable_weight) = 0.3, WEIGHTS[data]
    records = RECORDS[data]()
    trainer = trl_trainer(
        "kto", tiny_model(tokenizer), tokenizer, records, directory,
        peft_config=lora_config() if lora else None, beta=beta, max_length=64,
        desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
        per_device_train_batch_size=len(records) * (2 if data == "paired" else 1),
    )  # fmt: skip
    ours = trained_policy(trainer)
    batch = trl_batch(trainer)
    ref_logps = ref_kl_logps = None
    if not lora:  # given, as precomputed: TRL reads them from the batch
        ref_logps, ref_kl_logps = trl_reference_logps(trainer, batch)
        trainer.precompute_ref_logps = True
        batch = {**batch, "ref_logps": ref_logps, "ref_KL_logps": ref_kl_logps}
    trl_loss, trl_metrics = trl_step(trainer, batch)
    trl_grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad}

    with roundpipe.from_hf(ours, devices="emulated:2") as pipe:
        pipe.train()
        loss, metrics = kto_forward_backward(
            pipe, kto_rows(batch), beta=beta, desirable_weight=desirable_weight,
            undesirable_weight=undesirable_weight, ref_logps=ref_logps, ref_kl_logps=ref_kl_logps,
        )  # fmt: skip
        pipe.synchronize()
        grads = {name: p.grad for name, p in pipe.optim_named_parameters()}
    return (trl_loss, trl_metrics, trl_grads), (loss, metrics, grads)


@pytest.mark.parametrize("data", ["unpaired", "paired", "conversational"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_kto_step_equals_trls(data, lora, tmp_path):
    (trl_loss, trl_metrics, trl_grads), (loss, metrics, grads) = kto_step(data, lora, tmp_path)

    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-7)
    if data == "unpaired":  # these rows' KL estimate is not clamped to 0: it takes part
        assert trl_metrics["kl"] > 0
    for name in METRICS:
        assert metrics[name] == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6), name
    assert grads.keys() == trl_grads.keys()
    for name, grad in trl_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_batch_of_desirable_examples_only_logs_trls_metrics(lora, tmp_path):
    (trl_loss, trl_metrics, _), (loss, metrics, _) = kto_step("desirable only", lora, tmp_path)

    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-7)
    assert metrics.keys() == trl_metrics.keys() & set(METRICS)
    assert "rewards/rejected" not in metrics and "rewards/margins" not in metrics
    for name, value in metrics.items():
        assert value == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6), name
