"""``mean_token_accuracy`` as TRL's SFTTrainer computes it (the share of the label tokens,
shifted by one, -100 ignored, that are the logits' argmax), from the head's chunked
loss without the batch's logits: equal to the count on the transformers model's own
logits, for our own adapter and the general path, tiled or not, training and eval."""

from __future__ import annotations

import pytest
import torch
from support import architectures, hf_families

import roundpipe
from roundpipe.core.config import RoundPipeRunConfig


def half_predicted(model, batch: dict) -> dict:
    """``batch`` with every other label token replaced by the model's own prediction for
    it, so that about half of them are right (a random model predicts almost none)."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"].clone()
    predicted = logits[:, :-1].argmax(-1)
    every_other = torch.zeros_like(labels[:, 1:], dtype=torch.bool)
    every_other[:, ::2] = True
    chosen = every_other & (labels[:, 1:] != -100)
    labels[:, 1:][chosen] = predicted[chosen]
    return {**batch, "labels": labels}


def trl_counts(model, batch: dict) -> tuple[int, int]:
    """TRL's correct and total token counts on the transformers model's logits."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    shift_labels = batch["labels"][..., 1:]
    mask = shift_labels != -100
    correct = (logits[..., :-1, :].argmax(dim=-1) == shift_labels) & mask
    return int(correct.sum()), int(mask.sum())


CASES = {
    "own-adapter": lambda: (hf_families.build("llama"), hf_families.VOCAB),
    "general-path": lambda: (architectures.architecture("phi3").build(), architectures.VOCAB),
}


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_token_accuracy_equals_trls_on_the_models_own_logits(case, tiled):
    model, vocab = CASES[case]()
    if tiled and case == "general-path":
        pytest.skip("the general path does not tile")
    batch = half_predicted(model, architectures.padded_batch(5, 12, vocab=vocab, seed=3))
    correct, total = trl_counts(model, batch)
    assert 0 < correct < total  # the check can fail either way
    config = RoundPipeRunConfig(seq_chunk_tokens=4 if tiled else None)
    with roundpipe.from_hf(model, devices="emulated:2", model_run_config=config) as pipe:
        loss, metrics = pipe.forward_backward(input_kwargs=batch, return_metrics=True)
        plain = pipe.forward_backward(input_kwargs=batch)
        pipe.zero_grad()
        eval_loss, eval_metrics = pipe.eval_loss(batch, return_metrics=True)
    accuracy = (torch.tensor(correct) / torch.tensor(total)).item()  # TRL's float32 quotient
    want = {"mean_token_accuracy": accuracy, "correct_tokens": correct, "label_tokens": total}
    assert metrics == want
    assert eval_metrics == want
    assert float(loss) == float(plain)  # asking for the metrics changes nothing else
    torch.testing.assert_close(eval_loss, loss.detach())
