"""LoRA on every linear layer and packed sequences, on every architecture that trains.

LoRA ``all-linear`` (non-zero adapters) is exact against peft on the model itself where
peft can wrap and run the model; where it cannot, peft's own refusal or failure is
listed. Packed sequences (position ids restarting per example, no attention mask) give
the loss of the examples run apart on every architecture whose layers attend under a
mask; the others are refused at call start, by name. These lists are the README's table.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from support.architecture_status import LORA_FAILS_IN_PEFT, PACKING_REFUSED, TRAINED  # noqa: E402
from support.architectures import VOCAB, architecture, padded_batch  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402

LORA = [name for name in TRAINED if name not in LORA_FAILS_IN_PEFT]
PACKED = [name for name in TRAINED if name not in PACKING_REFUSED]


def lora_model(name: str):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    config.init_lora_weights = False  # non-zero adapters: the base's path alone would pass
    return peft.get_peft_model(architecture(name).build(), config)


@pytest.mark.parametrize("name", LORA)
def test_lora_on_every_linear_layer_trains_as_peft(name):
    model = lora_model(name)
    reference = copy.deepcopy(model)
    batch = padded_batch(side="right")
    want = reference(**batch, use_cache=False).loss
    want.backward()
    config = RoundPipeRunConfig(num_microbatch=3)
    with roundpipe.from_hf(model, devices="emulated:2", model_run_config=config) as pipe:
        loss = pipe.forward_backward(input_kwargs=batch)
        pipe.synchronize()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    expected = dict(reference.named_parameters())
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_" in n for n, _ in trained)
    for name_, param in trained:
        want_grad = expected[name_].grad
        if want_grad is None:  # adapters of a vision tower on text, of unused experts
            assert param.grad is None or not param.grad.any(), name_
            continue
        scale = float(want_grad.abs().max()) + 1e-6
        torch.testing.assert_close(param.grad, want_grad, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("name", sorted(LORA_FAILS_IN_PEFT))
def test_where_peft_cannot_wrap_or_run_every_linear_layer_it_says_so_itself(name):
    with pytest.raises((ValueError, AttributeError)):
        model = lora_model(name)
        model(**padded_batch(), use_cache=False)


def packed_batch():
    """Rows of several examples each (position ids restart), a label-less first token
    per example."""
    lengths = [(4, 6), (7, 3), (10,), (5, 5)]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (len(lengths), 10), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    labels = ids.masked_fill(positions == 0, -100)
    return {"input_ids": ids, "position_ids": positions, "labels": labels}, lengths


def examples_apart_loss(model, batch, lengths) -> float:
    total, count = 0.0, 0
    for row, example_lengths in enumerate(lengths):
        starts = torch.tensor((0, *example_lengths[:-1])).cumsum(0)
        for start, n in zip(starts, example_lengths, strict=True):
            ids = batch["input_ids"][row : row + 1, start : start + n]
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            targets = batch["labels"][row, start + 1 : start + n]
            total += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
            count += targets.numel()
    return total / count


@pytest.mark.parametrize("name", PACKED)
def test_packed_sequences_give_the_loss_of_their_examples_apart(name):
    model = architecture(name).build().eval()
    batch, lengths = packed_batch()
    with torch.no_grad():
        want = examples_apart_loss(model, batch, lengths)
    config = RoundPipeRunConfig(num_microbatch=2)
    with roundpipe.from_hf(model, devices="emulated:2", model_run_config=config) as pipe:
        got = float(pipe.eval_loss(batch))
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("name", sorted(PACKING_REFUSED))
def test_packed_sequences_are_refused_where_examples_would_not_stay_apart(name):
    batch, _ = packed_batch()
    model = architecture(name).build()
    with (
        roundpipe.from_hf(model, devices="emulated:1") as pipe,
        pytest.raises(ValueError, match=PACKING_REFUSED[name]) as refused,
    ):
        pipe.forward_backward(input_kwargs=batch)
    assert "cannot train packed sequences" in str(refused.value)


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_next", "deepseek_v3", "qwen3_5_vlm"])
def test_a_bf16_model_gives_the_loss_of_transformers_in_bf16(name):
    """Measured within 1e-7 (bf16 against fp32: 2e-5 to 6e-5 on these models)."""
    model = architecture(name).build().to(torch.bfloat16)
    batch = padded_batch(side="right")
    want = copy.deepcopy(model)(**batch, use_cache=False).loss
    config = RoundPipeRunConfig(num_microbatch=3)
    with roundpipe.from_hf(model, devices="emulated:2", model_run_config=config) as pipe:
        loss = pipe.forward_backward(input_kwargs=batch)
    torch.testing.assert_close(loss.detach().float(), want.detach().float(), rtol=1e-5, atol=0)
