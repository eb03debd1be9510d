"""Packed sequences: ``position_ids`` that restart at 0 for each example keep attention
inside each example, as in ``transformers``.

Two oracles: the Hugging Face model given the same packed batch, and — the property
packing must have — each example run on its own.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support.hf_families import COMMON, VOCAB, assert_trains_as_hf, build  # noqa: E402

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402

LENGTHS = [(4, 7, 5), (9, 7), (3, 3, 3, 3, 4)]  # three windows of 16 tokens


def packed_batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(LENGTHS), 16), generator=generator)
    positions = torch.zeros_like(ids)
    labels = ids.clone()
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for length in lengths:
            positions[row, start : start + length] = torch.arange(length)
            labels[row, start] = -100  # the previous example's last token predicts nothing
            start += length
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


@pytest.mark.parametrize("chunk", [None, 5], ids=["untiled", "tiled"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_packed_batches_equal_the_hugging_face_model(family, chunk):
    """Tiled (docs/design.md#long-context): MLPs and norms in chunks of 5 tokens, and
    microbatches of one row, whose examples attend through SDPA one by one."""
    # (assert_trains_as_hf passes use_cache=False: with a KV cache, transformers ignores
    # packing even in training, and attention crosses the examples)
    config = RoundPipeRunConfig(num_microbatch=2 if chunk is None else 3, seq_chunk_tokens=chunk)
    assert_trains_as_hf(build(family), packed_batch(), config)


# GPT-OSS: transformers 5.24's own model does not pass position_ids to its mask
# builders, so it lets attention cross packed examples; RoundPipe keeps them apart.
@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_a_packed_example_sees_only_itself(family):
    model = build(family)
    batch = packed_batch()
    with roundpipe.from_hf(model, devices="emulated:2") as pipe, torch.no_grad():
        packed = pipe(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for length in lengths:
            alone = batch["input_ids"][row : row + 1, start : start + length]
            with torch.no_grad():
                want = model(input_ids=alone).logits[0]
            got = packed[row, start : start + length]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            start += length


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b.update(position_ids=b["position_ids"].float()), "integer tensor"),
        (lambda b: b.update(position_ids=b["position_ids"][:, :5]), "integer tensor of shape"),
        (lambda b: b.update(position_ids=b["position_ids"] - 1), r"\[0, 64\)"),
        (lambda b: b.update(position_ids=b["position_ids"] + 60), r"\[0, 64\)"),
        (
            lambda b: b.update(attention_mask=torch.ones_like(b["input_ids"])),
            "take no attention_mask",
        ),
    ],
)
def test_bad_position_ids_are_refused(change, message):
    batch = packed_batch()
    change(batch)
    pipe = roundpipe.from_hf(build("llama"), devices="emulated:1")
    with pipe, pytest.raises(ValueError, match=message):
        pipe.forward_backward(input_kwargs=batch)


def test_packed_training_with_attention_dropout_keeps_transformers_masks():
    """The per-example SDPA pieces draw no dropout: with ``attention_dropout`` in
    training the layers keep transformers' masks (and train); in eval they use the
    pieces again, and the examples still see only themselves."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, attention_dropout=0.1))
    batch = packed_batch()
    config = RoundPipeRunConfig(num_microbatch=3)
    with roundpipe.from_hf(model, devices="emulated:2", model_run_config=config) as pipe:
        pipe.train()
        loss = pipe.forward_backward(input_kwargs=batch)
        assert torch.isfinite(loss)
        pipe.eval()
        with torch.no_grad():
            packed = pipe(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    model.eval()
    with torch.no_grad():
        alone = model(input_ids=batch["input_ids"][:1, :4]).logits[0]
    torch.testing.assert_close(packed[0, :4], alone, rtol=1e-4, atol=1e-5)
