"""``roundpipe.train`` batches: padded or packed, a function of seed and step.

Padded batches pad each batch to its longest example; packed windows hold whole
examples with positions restarting at each; every epoch holds each example once. The
batch loss equals the separate examples' loss, checked against ``transformers``' own
packed-sequence attention (a tiny Qwen3 model). The tokenizer is a tiny byte-level BPE
built here (``support/bpe_tokenizer.py``). Examples: ``test_train_examples.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from support.train_fixtures import tiny_qwen3_config  # noqa: E402

from roundpipe.train.batches import Batches, pack  # noqa: E402
from roundpipe.train.data import Example, load_dataset, pad_token_id  # noqa: E402

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "and", "says"]


# --- batches --------------------------------------------------------------------


def some_dataset(tokenizer, write_jsonl, count=11, seq_len=24):
    lines = [{"prompt": " ".join(WORDS[: 1 + i % 5]), "completion": " " + " ".join(WORDS[i:])}
             for i in range(count)]  # fmt: skip
    return load_dataset(write_jsonl(lines), tokenizer, seq_len)


def test_padded_batches_pad_each_batch_to_its_longest_example(tokenizer, write_jsonl):
    dataset = some_dataset(tokenizer, write_jsonl)
    batches = Batches(dataset, batch_size=4, seed=0, pad_id=pad_token_id(tokenizer))
    assert batches.steps_per_epoch == 3  # 11 examples: 4 + 4 + 3, the last one kept
    seen = []
    for step in range(batches.steps_per_epoch):
        batch = batches.batch(step)
        assert set(batch) == {"input_ids", "attention_mask", "labels"}
        assert all(t.dtype == torch.int64 for t in batch.values())
        lengths = batch["attention_mask"].sum(1)
        assert batch["input_ids"].shape[1] == int(lengths.max())
        for ids, mask, labels, length in zip(*batch.values(), lengths.tolist(), strict=True):
            assert mask.tolist() == [1] * length + [0] * (len(mask) - length)
            assert (ids[length:] == 0).all() and (labels[length:] == -100).all()
        assert batches.num_tokens(step) == int(lengths.sum())
        assert batches.num_label_tokens(step) == int((batch["labels"][:, 1:] != -100).sum())
        seen += examples_in(batch)
    assert [len(batches.batch(step)["labels"]) for step in range(3)] == [4, 4, 3]
    assert Counter(seen) == Counter(dataset.examples)


def segments_of(batch) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` of each segment of a packed batch (split where the
    positions restart), checking that every segment's positions count 0, 1, 2..."""
    segments = []
    rows = zip(batch["input_ids"], batch["position_ids"], batch["labels"], strict=True)
    for ids, positions, labels in rows:
        starts = [i for i, p in enumerate(positions.tolist()) if p == 0] + [len(ids)]
        for a, b in zip(starts, starts[1:], strict=False):
            assert positions[a:b].tolist() == list(range(b - a))
            segments.append((ids[a:b].tolist(), labels[a:b].tolist()))
    return segments


def examples_in(batch) -> list[Example]:
    """The examples of a batch: its padded rows cut to their mask, or the segments of
    its packed windows that have a label (the others are the windows' tails)."""
    if "attention_mask" in batch:
        lengths = batch["attention_mask"].sum(1).tolist()
        rows = zip(batch["input_ids"].tolist(), batch["labels"].tolist(), lengths, strict=True)
        return [Example(tuple(ids[:n]), tuple(labels[:n])) for ids, labels, n in rows]
    segments = segments_of(batch)
    return [Example(tuple(ids), tuple(labels)) for ids, labels in segments if set(labels) != {-100}]


def test_packed_windows_hold_whole_examples_restarting_positions(tokenizer, write_jsonl):
    dataset = some_dataset(tokenizer, write_jsonl, count=23, seq_len=24)
    batches = Batches(dataset, batch_size=3, seed=5, packing=True, pad_id=0)
    windows = len(batches.rows)
    assert windows < len(dataset.examples)  # several examples share windows
    assert batches.steps_per_epoch == -(-windows // 3)
    seen, tails = [], []
    for step in range(batches.steps_per_epoch):
        batch = batches.batch(step)
        assert set(batch) == {"input_ids", "position_ids", "labels"}
        assert batch["input_ids"].shape[1] == 24 and batch["input_ids"].dtype == torch.int64
        examples = examples_in(batch)
        assert all(example.labels[0] == -100 for example in examples)
        assert batches.num_tokens(step) == sum(len(e.input_ids) for e in examples)
        assert batches.num_label_tokens(step) == int((batch["labels"] != -100).sum())
        seen += examples
        tails += [ids for ids, labels in segments_of(batch) if set(labels) == {-100}]
    assert Counter(seen) == Counter(dataset.examples)  # each example once, never split
    assert all(set(tail) == {0} for tail in tails)
    real_tokens = sum(len(example.input_ids) for example in dataset.examples)
    assert sum(map(len, tails)) == 24 * windows - real_tokens


def test_best_fit_puts_each_length_into_the_fullest_window_it_fits():
    assert pack([6, 5, 4, 3, 2], capacity=8) == [[0, 4], [1, 3], [2]]
    assert pack([8, 8], capacity=8) == [[0], [1]]
    with pytest.raises(ValueError, match="9 tokens exceeds the window of 8"):
        pack([9], capacity=8)


@pytest.mark.parametrize("packing", [False, True])
def test_batches_are_a_function_of_seed_and_step(tokenizer, write_jsonl, packing):
    dataset = some_dataset(tokenizer, write_jsonl, count=30)
    forward, backward = (Batches(dataset, 2, seed=3, packing=packing) for _ in range(2))
    steps = range(3 * forward.steps_per_epoch)
    in_order = [forward.batch(step) for step in steps]
    in_reverse = [backward.batch(step) for step in reversed(steps)][::-1]  # as after resumes
    for a, b in zip(in_order, in_reverse, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)

    def epoch_examples(batches, epoch):
        per_epoch = batches.steps_per_epoch
        first = epoch * per_epoch
        return [
            e for step in range(first, first + per_epoch) for e in examples_in(batches.batch(step))
        ]

    epochs = [epoch_examples(forward, epoch) for epoch in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]
    assert all(Counter(epoch) == Counter(dataset.examples) for epoch in epochs)
    assert epoch_examples(Batches(dataset, 2, seed=4, packing=packing), 0) != epochs[0]


def test_bad_batch_options_are_refused(tokenizer, write_jsonl):
    dataset = some_dataset(tokenizer, write_jsonl, count=3)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        Batches(dataset, batch_size=0, seed=0)
    with pytest.raises(ValueError, match="step must be a non-negative integer, got -1"):
        Batches(dataset, batch_size=1, seed=0).batch(-1)


# --- against transformers -------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_qwen3(tokenizer):
    torch.manual_seed(0)
    config = tiny_qwen3_config(
        len(tokenizer),
        max_position_embeddings=64,
        initializer_range=0.2,  # larger weights than the default: attention matters more
        attn_implementation="eager",
    )
    return transformers.Qwen3ForCausalLM(config).float().eval()


def separate_loss(model, examples: list[Example]) -> torch.Tensor:
    """The token-weighted mean of the examples' losses, each run on its own."""
    total, count = torch.zeros(()), 0
    for example in examples:
        ids, labels = torch.tensor([example.input_ids]), torch.tensor([example.labels])
        total += model(input_ids=ids, labels=labels).loss * example.num_label_tokens
        count += example.num_label_tokens
    return total / count


@pytest.mark.parametrize("packing", [False, True])
def test_batch_loss_equals_the_separate_examples_loss(tokenizer, write_jsonl, tiny_qwen3, packing):
    lines = [{"prompt": WORDS[i], "completion": " " + " ".join(WORDS[i + 1 : i + 2 + i % 4])}
             for i in range(len(WORDS) - 1)]  # fmt: skip
    dataset = load_dataset(write_jsonl(lines), tokenizer, 32)
    batches = Batches(dataset, batch_size=2, seed=1, packing=packing, pad_id=0)
    with torch.no_grad():
        for step in range(batches.steps_per_epoch):
            batch = batches.batch(step)
            loss = tiny_qwen3(**batch, use_cache=False).loss
            torch.testing.assert_close(loss, separate_loss(tiny_qwen3, examples_in(batch)))
            if packing:  # the oracle notices attention crossing examples
                rows = len(batch["input_ids"])
                crossing = dict(batch, position_ids=torch.arange(32).expand(rows, 32))
                assert abs(tiny_qwen3(**crossing, use_cache=False).loss - loss) > 1e-3
