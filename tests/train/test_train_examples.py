"""``roundpipe.train`` data: JSONL lines to labelled examples, and the errors a bad file gives.

Each format learns only what it should (text: every token after the first; a prompt
and completion: the completion; a chat: each assistant turn), with one BOS and one EOS;
long examples are truncated and examples with nothing to learn dropped, both counted;
a bad line, conversation or template is named with its file and line. The tokenizer is
a tiny byte-level BPE built here (``support/bpe_tokenizer.py``) with ChatML special
tokens; masks are checked by decoding the labelled tokens. Batches:
``test_train_batches.py``.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from support.bpe_tokenizer import CHATML, make_tokenizer  # noqa: E402

from roundpipe.train.data import DataError, Example, load_dataset  # noqa: E402

# Like Qwen3's template: the assistant turn being generated (the last message) opens
# with an empty think block, earlier assistant turns are rendered without one.
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus three?"},
    {"role": "assistant", "content": "Five."},
    {"role": "user", "content": "And the fox?"},
    {"role": "assistant", "content": "It jumps over the dog."},
]


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
