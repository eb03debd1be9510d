"""``roundpipe.train`` data: JSONL to labelled examples, and padded or packed batches.

The tokenizer is a tiny byte-level BPE built here (no downloads) with ChatML special
tokens; masks are checked by decoding the labelled tokens, and packing against
``transformers``' own packed-sequence attention (a tiny Qwen3 model).
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from roundpipe.train.batches import Batches, pack  # noqa: E402
from roundpipe.train.data import DataError, Example, load_dataset, pad_token_id  # noqa: E402

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Like Qwen3's template: the assistant turn being generated (the last message) opens
# with an empty think block, earlier assistant turns are rendered without one.
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Hello world, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "What is two plus three? Two plus three is five.",
    "user assistant system think",
]
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "and", "says"]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus three?"},
    {"role": "assistant", "content": "Five."},
    {"role": "user", "content": "And the fox?"},
    {"role": "assistant", "content": "It jumps over the dog."},
]


def make_tokenizer(chat_template=CHATML, bos=False, appends_eos=False):
    """A byte-level BPE tokenizer; ``bos`` adds ``<s>`` in front and ``appends_eos``
    ``<|endoftext|>`` at the end of every encoding with special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        show_progress=False,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    model.train_from_iterator(CORPUS * 5, trainer)
    if bos or appends_eos:
        single = ("<s> " if bos else "") + "$A" + (" <|endoftext|>" if appends_eos else "")
        ids = [(token, model.token_to_id(token)) for token in ("<s>", "<|endoftext|>")]
        model.post_processor = processors.TemplateProcessing(single=single, special_tokens=ids)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model,
        bos_token="<s>" if bos else None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
    )


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def write_jsonl(tmp_path):
    """``write_jsonl(lines)``: a file holding ``lines`` (dicts as JSON, strings as they are)."""

    def write(lines, name="data.jsonl"):
        path = tmp_path / name
        text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
        path.write_text(text + "\n", encoding="utf-8")
        return path

    return write


def labelled_runs(example: Example, tokenizer) -> list[str]:
    """The decoded text of each run of consecutive labelled tokens."""
    runs, current = [], []
    for token, label in zip(example.input_ids, example.labels, strict=True):
        if label != -100:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tokenizer.decode(run) for run in runs]


def unlabelled_text(example: Example, tokenizer) -> str:
    ids = [t for t, label in zip(example.input_ids, example.labels, strict=True) if label == -100]
    return tokenizer.decode(ids)


# --- examples -------------------------------------------------------------------


def test_text_learns_every_token_after_the_first_and_ends_with_eos(tokenizer, write_jsonl):
    dataset = load_dataset(write_jsonl([{"text": "Hello world, how are you?"}]), tokenizer, 64)
    (example,) = dataset.examples
    assert dataset.format == "text"
    assert example.input_ids == (*tokenizer.encode("Hello world, how are you?"), 0)
    assert example.labels == (-100, *example.input_ids[1:])
    assert tokenizer.decode(example.input_ids) == "Hello world, how are you?<|endoftext|>"


def test_prompt_completion_learns_the_completion_and_eos_only(tokenizer, write_jsonl):
    line = {"prompt": "What is two plus three?", "completion": " Five."}
    (example,) = load_dataset(write_jsonl([line]), tokenizer, 64).examples
    assert labelled_runs(example, tokenizer) == [" Five.<|endoftext|>"]
    assert unlabelled_text(example, tokenizer) == "What is two plus three?"


@pytest.mark.parametrize("appends_eos", [False, True])
def test_a_bos_is_added_once_and_the_eos_never_twice(write_jsonl, appends_eos):
    tokenizer = make_tokenizer(bos=True, appends_eos=appends_eos)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    lines = [{"prompt": "Hello", "completion": " world"}, {"prompt": "The fox", "completion": ""}]
    pair = load_dataset(write_jsonl(lines), tokenizer, 64).examples[0]
    assert pair.input_ids.count(bos) == 1 and pair.input_ids[0] == bos
    assert pair.input_ids.count(eos) == 1 and pair.input_ids[-1] == eos
    assert labelled_runs(pair, tokenizer) == [" world<|endoftext|>"]
    text = load_dataset(write_jsonl([{"text": "Hello"}]), tokenizer, 64).examples[0]
    assert text.input_ids == (bos, *tokenizer.encode("Hello", add_special_tokens=False), eos)


def test_chat_learns_each_assistant_turn_and_its_end_token_only(tokenizer, write_jsonl):
    (example,) = load_dataset(write_jsonl([{"messages": CHAT}]), tokenizer, 256).examples
    assert labelled_runs(example, tokenizer) == [
        "Five.<|im_end|>",
        "It jumps over the dog.<|im_end|>",
    ]
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert example.input_ids == tuple(tokenizer.encode(rendered, add_special_tokens=False))


def test_chat_messages_after_the_last_assistant_turn_are_left_out(tokenizer, write_jsonl):
    messages = [*CHAT, {"role": "user", "content": "Thanks"}]
    (example,) = load_dataset(write_jsonl([{"messages": messages}]), tokenizer, 256).examples
    assert "Thanks" not in tokenizer.decode(example.input_ids)


def test_a_template_that_rewrites_earlier_turns_gives_an_example_per_turn(write_jsonl):
    tokenizer = make_tokenizer(chat_template=THINKING)
    examples = load_dataset(write_jsonl([{"messages": CHAT}]), tokenizer, 256).examples
    assert [labelled_runs(example, tokenizer) for example in examples] == [
        ["<think>\n\n</think>\n\nFive.<|im_end|>"],
        ["<think>\n\n</think>\n\nIt jumps over the dog.<|im_end|>"],
    ]
    for example, end in zip(examples, (3, 5), strict=True):
        rendered = tokenizer.apply_chat_template(CHAT[:end], tokenize=False)
        assert example.input_ids == tuple(tokenizer.encode(rendered, add_special_tokens=False))


class SlowTokenizer:
    """The fast tokenizer seen as a slow one (no offset mappings)."""

    is_fast = False

    def __init__(self, fast):
        self._fast = fast

    def __getattr__(self, name):
        return getattr(self._fast, name)


def test_a_slow_tokenizer_labels_chat_like_a_fast_one(tokenizer, write_jsonl):
    path = write_jsonl([{"messages": CHAT}])
    slow = load_dataset(path, SlowTokenizer(tokenizer), 256).examples
    assert slow == load_dataset(path, tokenizer, 256).examples


def test_blank_lines_and_unknown_keys_are_ignored(tokenizer, write_jsonl):
    path = write_jsonl(["", json.dumps({"text": "Hello", "id": 7}), "   ", '{"text": "fox"}'])
    assert len(load_dataset(path, tokenizer, 16).examples) == 2


def test_long_examples_keep_their_first_seq_len_tokens_and_are_counted(tokenizer, write_jsonl):
    long_text = "The quick brown fox jumps over the lazy dog. " * 4
    path = write_jsonl([{"text": long_text}, {"text": "Hello"}])
    dataset = load_dataset(path, tokenizer, 12)
    assert dataset.truncated == 1 and dataset.dropped == 0
    assert dataset.examples[0].input_ids == tuple(tokenizer.encode(long_text)[:12])
    assert dataset.examples[0].labels == (-100, *dataset.examples[0].input_ids[1:])
    exact = len(tokenizer.encode("Hello world")) + 1  # with the EOS
    path = write_jsonl([{"text": "Hello world"}])
    assert load_dataset(path, tokenizer, exact).truncated == 0
    assert load_dataset(path, tokenizer, exact - 1).truncated == 1


def test_examples_with_nothing_to_learn_are_dropped_and_counted(tokenizer, write_jsonl):
    lines = [
        {"prompt": "Hello", "completion": ""},  # only the EOS would be learnt
        {"prompt": "The quick brown fox jumps over the lazy dog.", "completion": " Yes"},
        {"prompt": "Hello", "completion": " world"},
    ]
    dataset = load_dataset(write_jsonl(lines), tokenizer, 8)  # the long prompt fills 8
    assert dataset.dropped == 2 and dataset.truncated == 0
    assert [labelled_runs(e, tokenizer) for e in dataset.examples] == [[" world<|endoftext|>"]]


# --- errors ---------------------------------------------------------------------

GOOD = json.dumps({"text": "Hello"})


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"input": "Hello"}', "no fields of a known format"),
        ('{"text": 3}', '"text" must be a string, got int'),
        ('{"prompt": "Hello"}', 'lacks "completion"'),
        ('{"text": "a", "messages": []}', "more than one format"),
        ('{"prompt": "a", "completion": "b"}', 'first line (1) is "text"'),
    ],
)
def test_a_bad_line_is_named_with_its_file_and_number(tokenizer, write_jsonl, bad_line, expected):
    path = write_jsonl([GOOD, "", bad_line, GOOD])
    with pytest.raises(DataError, match=f"{path}:3: .*{re.escape(expected)}"):
        load_dataset(path, tokenizer, 16)


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ("hi", '"messages" must be a non-empty list'),
        ([], '"messages" must be a non-empty list'),
        (["hi"], "message 1 is str, not an object"),
        ([{"role": "user"}], 'message 1: "content" must be a string, got nothing'),
        ([{"role": "user", "content": None}], '"content" must be a string, got NoneType'),
        ([{"role": "user", "content": "Hello"}], "no assistant turn"),
    ],
)
def test_a_bad_conversation_is_named_with_its_line(tokenizer, write_jsonl, messages, expected):
    path = write_jsonl([{"messages": CHAT}, {"messages": messages}])
    with pytest.raises(DataError, match=f"{path}:2: .*{re.escape(expected)}"):
        load_dataset(path, tokenizer, 64)


def test_a_line_that_is_not_utf8_is_named(tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(GOOD.encode() + b'\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=f"{path}:2: not UTF-8"):
        load_dataset(path, tokenizer, 16)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ raise_exception('roles must alternate') }}", "template failed.*roles must alternate"),
        (  # the assistant header differs from the generation prompt
            CHATML.replace("{{ m.role }}", "{{ 'bot' if m.role == 'assistant' else m.role }}"),
            "rendering of message 5 \\(assistant\\) does not start with",
        ),
    ],
)
def test_a_template_that_fails_or_hides_the_turns_is_named(write_jsonl, template, expected):
    path = write_jsonl([{"messages": CHAT}])
    with pytest.raises(DataError, match=f"{path}:1: .*{expected}"):
        load_dataset(path, make_tokenizer(chat_template=template), 64)


def test_an_empty_file_has_no_examples(tokenizer, write_jsonl):
    with pytest.raises(DataError, match="no examples"):
        load_dataset(write_jsonl(["", "  "]), tokenizer, 16)


def test_a_missing_file_is_a_data_error(tokenizer, tmp_path):
    with pytest.raises(DataError, match="nothing.jsonl"):
        load_dataset(tmp_path / "nothing.jsonl", tokenizer, 16)


def test_chat_data_needs_a_chat_template(write_jsonl):
    tokenizer = make_tokenizer(chat_template=None)
    with pytest.raises(DataError, match='no chat template.*"text" or "prompt"\\+"completion"'):
        load_dataset(write_jsonl([{"messages": CHAT}]), tokenizer, 64)


def test_dropping_every_example_is_an_error(tokenizer, write_jsonl):
    path = write_jsonl([{"prompt": "The quick brown fox jumps", "completion": " over"}])
    with pytest.raises(DataError, match=f"{path}: all 1 examples were dropped"):
        load_dataset(path, tokenizer, 3)


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
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
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
