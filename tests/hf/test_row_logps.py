"""Each row's log-probability through a ``from_hf`` pipe: ``sequence_logps`` and
``forward_backward_logps`` equal the model's own log-softmax of its logits summed over
each row's label tokens (and its gradients), for our own adapter (tiled or not) and the
general path; rows stay in their groups; bad arguments are refused before any work."""

from __future__ import annotations

import pytest
import torch
from support import architectures, hf_families

import roundpipe
from roundpipe.core.config import RoundPipeRunConfig

CASES = {
    "own-adapter": lambda: (hf_families.build("llama"), hf_families.VOCAB),
    "general-path": lambda: (architectures.architecture("phi3").build(), architectures.VOCAB),
}


def model_logps(model, batch: dict) -> torch.Tensor:
    """Each row's summed log-probability of its shifted labels, from the logits."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logps.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (targets != -100)).sum(dim=1)


def completion_batch(vocab: int, rows: int = 6) -> dict:
    batch = architectures.padded_batch(rows, 12, vocab=vocab, seed=5)
    batch["labels"][:, :4] = -100  # a prompt
    return batch


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_row_logps_and_their_gradients_equal_the_models_own(case, tiled):
    model, vocab = CASES[case]()
    if tiled and case == "general-path":
        pytest.skip("the general path does not tile")
    batch = completion_batch(vocab)
    weights = torch.linspace(-1.0, 2.0, batch["input_ids"].shape[0])
    model.zero_grad()
    (model_logps(model, batch) * weights).sum().backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        expected = model_logps(model, batch)
    model.zero_grad()
    config = RoundPipeRunConfig(seq_chunk_tokens=4 if tiled else None)
    seen_rows = []

    def loss_fn(logps, label):
        seen_rows.append(logps.shape[0])
        return (logps * label).sum()

    with roundpipe.from_hf(model, devices="emulated:2", model_run_config=config) as pipe:
        no_grad = pipe.sequence_logps(batch)
        loss, logps, correct = pipe.forward_backward_logps(batch, loss_fn, weights, group_rows=2)
        pipe.synchronize()
        grads = {name: p.grad for name, p in pipe.optim_named_parameters()}
    torch.testing.assert_close(no_grad, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logps, no_grad)  # the same numbers with autograd
    torch.testing.assert_close(loss, (expected * weights).sum(), rtol=1e-5, atol=1e-5)
    assert correct.shape == (6,) and correct.dtype == torch.int64
    assert all(rows % 2 == 0 for rows in seen_rows) and sum(seen_rows) == 6
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_sft_loss_is_bit_for_bit_what_it_was():
    """row_losses is off by default: the batch's token mean does not go through rows."""
    model, vocab = CASES["own-adapter"]()
    batch = completion_batch(vocab)
    with roundpipe.from_hf(model, devices="emulated:2") as pipe:
        loss = pipe.eval_loss(batch)
    expected = model(**batch).loss
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)


def test_bad_groups_and_labels_are_refused_before_any_work():
    model, vocab = CASES["own-adapter"]()
    batch = completion_batch(vocab, rows=5)
    with roundpipe.from_hf(model, devices="emulated:2") as pipe:
        with pytest.raises(ValueError, match="groups of 2"):
            pipe.forward_backward_logps(batch, lambda lp, lab: lp.sum(), None, group_rows=2)
        with pytest.raises(ValueError, match="the batch's 5 rows"):
            pipe.forward_backward_logps(batch, lambda lp, lab: lp.sum(), torch.zeros(4))
        packed = {**batch, "position_ids": torch.arange(12).repeat(5, 1)}
        packed.pop("attention_mask")
        with pytest.raises(ValueError, match="unpacked rows"):
            pipe.sequence_logps(packed)
        assert all(p.grad is None for p in pipe.optim_parameters())


def test_a_no_grad_call_accepts_parameters_frozen_for_its_duration():
    """peft's disable_adapter() freezes the adapters it turns off: a forward without
    autograd runs; a training call with a parameter still frozen is refused."""
    model, vocab = CASES["own-adapter"]()
    batch = completion_batch(vocab)
    with roundpipe.from_hf(model, devices="emulated:2") as pipe:
        first = next(iter(model.parameters()))
        first.requires_grad_(False)
        pipe.sequence_logps(batch)
        with pytest.raises(RuntimeError, match="frozen after the model was wrapped"):
            pipe.forward_backward(input_kwargs=batch)
        first.requires_grad_(True)
        pipe.forward_backward(input_kwargs=batch)


def test_row_losses_must_be_a_bool():
    with pytest.raises(TypeError, match="row_losses must be True or False"):
        RoundPipeRunConfig(row_losses=1)


def test_per_row_losses_of_a_model_with_its_router_loss_are_refused():
    model = hf_families.build("qwen3_moe")
    model.config.output_router_logits = True
    batch = completion_batch(hf_families.VOCAB, rows=2)
    with (
        roundpipe.from_hf(model, devices="emulated:2") as pipe,
        pytest.raises(NotImplementedError, match="output_router_logits=False"),
    ):
        pipe.forward_backward_logps(batch, lambda lp, lab: lp.sum(), None)
