"""``roundpipe train`` data whose text is emoji (skin tones, flags, ZWJ sequences),
right-to-left script with its marks, or NUL: every record trains like any other, its
tokens those the tokenizer gives the text (``tokenizer(text)``, the oracle), whatever
the file (JSONL, CSV) or format (``text``, ``prompt``/``completion``, ``messages``).

A word-level vocabulary has no token for such characters and gives its UNK token,
which stands for text and is learnt like text (TRL labels it too), unless the UNK is
also the EOS (GPT-2's): then an empty completion still has nothing to learn.
"""

from __future__ import annotations

import csv
import json

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from support.train_cli import run_train  # noqa: E402
from support.train_fixtures import CHAT_TEMPLATE, build_tokenizer  # noqa: E402

from roundpipe.train.batches import Batches  # noqa: E402
from roundpipe.train.data import load_dataset  # noqa: E402
from roundpipe.train.data_summary import data_summary  # noqa: E402

UNUSUAL = {
    "skin tone": "thumbs 👍🏽 up",
    "flag": "Bonjour 🇫🇷",
    "hebrew with RLM": "שלום\u200f עולם",
    "arabic": "مرحبا بالعالم",
    "ZWJ family": "family 👩\u200d👩\u200d👧",
    "NUL": "nul\x00here",
}
# The word-level vocabulary's words around a character it lacks (the last one alone).
WORD_LEVEL = [
    "say hello 👍🏽",
    "say 🇫🇷",
    "say שלום\u200f",
    "say 👩\u200d👩\u200d👧",
    "say \x00",
    "👍🏽",
]


def record(data_format: str, text: str) -> dict:
    if data_format == "text":
        return {"text": text}
    if data_format == "prompt_completion":
        return {"prompt": "say", "completion": text}
    return {
        "messages": [{"role": "user", "content": "say"}, {"role": "assistant", "content": text}]
    }


def write_csv(path, rows: list[dict]):
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def learnt(example) -> list[int]:
    return [label for label in example.labels if label != -100]


def encoded(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("data_format", ["text", "prompt_completion", "messages"])
def test_unusual_characters_train_as_the_tokenizer_encodes_them(
    tokenizer, write_jsonl, data_format
):
    rows = [record(data_format, text) for text in UNUSUAL.values()]
    dataset = load_dataset(write_jsonl(rows), tokenizer, 128)
    assert len(dataset.examples) == len(rows) and dataset.dropped == 0
    eos = [tokenizer.eos_token_id]
    for example, text in zip(dataset.examples, UNUSUAL.values(), strict=True):
        if data_format == "messages":
            assert learnt(example)[: len(encoded(tokenizer, text))] == encoded(tokenizer, text)
        else:
            assert learnt(example) == encoded(tokenizer, text)[data_format == "text" :] + eos


def test_nul_is_kept_like_any_character_in_json_and_csv(tokenizer, write_jsonl, tmp_path):
    rows = [{"text": "before\x00after"}]
    for path in (write_jsonl(rows), write_csv(tmp_path / "data.csv", rows)):
        (example,) = load_dataset(path, tokenizer, 64).examples
        assert tokenizer.decode(example.input_ids, skip_special_tokens=True) == "before\x00after"


def test_a_csv_of_unusual_text_trains_every_row(tokenizer, tmp_path):
    rows = [{"prompt": "say", "completion": text} for text in UNUSUAL.values()]
    dataset = load_dataset(write_csv(tmp_path / "data.csv", rows), tokenizer, 128)
    assert [learnt(e)[:-1] for e in dataset.examples] == [
        encoded(tokenizer, text) for text in UNUSUAL.values()
    ]


@pytest.mark.parametrize("data_format", ["text", "prompt_completion", "messages"])
def test_characters_a_word_vocabulary_lacks_train_as_its_unk_token(write_jsonl, data_format):
    tokenizer = build_tokenizer()
    rows = [record(data_format, text) for text in WORD_LEVEL[:-1]]
    dataset = load_dataset(write_jsonl(rows), tokenizer, 32)
    assert len(dataset.examples) == len(rows) and dataset.dropped == 0
    for example, text in zip(dataset.examples, WORD_LEVEL, strict=False):
        ids = encoded(tokenizer, text)
        assert tokenizer.unk_token_id in ids
        learnt_ids = learnt(example)[:-1]  # without the end token
        assert learnt_ids == (ids[1:] if data_format == "text" else ids)


def test_a_completion_of_only_unknown_characters_is_learnt(write_jsonl):
    tokenizer = build_tokenizer()
    (example,) = load_dataset(
        write_jsonl([{"prompt": "say", "completion": WORD_LEVEL[-1]}]), tokenizer, 32
    ).examples
    assert learnt(example) == [tokenizer.unk_token_id, tokenizer.eos_token_id]


def test_an_assistant_turn_is_learnt_past_an_unknown_character(write_jsonl):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<|im_end|>", "")  # no end token
    text = "say 👍🏽 hello back"
    (example,) = load_dataset(write_jsonl([record("messages", text)]), tokenizer, 32).examples
    assert learnt(example)[: len(encoded(tokenizer, text))] == encoded(tokenizer, text)


def test_an_unk_that_is_also_the_eos_still_drops_an_empty_completion(write_jsonl):
    tokenizer = build_tokenizer()
    tokenizer.unk_token = tokenizer.eos_token
    rows = [{"prompt": "say", "completion": ""}, {"prompt": "say", "completion": "hello"}]
    dataset = load_dataset(write_jsonl(rows), tokenizer, 32)
    assert (len(dataset.examples), dataset.dropped) == (1, 1)


def test_the_data_summary_counts_every_unusual_record(write_jsonl):
    tokenizer = build_tokenizer()
    rows = [record("prompt_completion", text) for text in WORD_LEVEL]
    dataset = load_dataset(write_jsonl(rows), tokenizer, 32)
    batches = Batches(dataset, 2, seed=0)
    assert f"{len(rows)} examples" in data_summary(dataset, batches, tokenizer)[0]
    rows_batched = sum(len(batches.batch(step)["input_ids"]) for step in range(3))
    assert (batches.steps_per_epoch, rows_batched) == (3, len(rows))


def test_roundpipe_train_trains_every_unusual_record(train_files, tmp_path):
    data = tmp_path / "unusual.jsonl"
    lines = [
        json.dumps(record("prompt_completion", text), ensure_ascii=False) for text in WORD_LEVEL
    ]
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    output = tmp_path / "run"
    run = run_train(
        "--model", train_files["model"], "--data", data, "--output", output, "--seq-len", "32",
        "--batch-size", "2", "--devices", "emulated:2", "--max_steps", "1",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    said = run.stdout + run.stderr
    assert f'unusual.jsonl ("prompt"+"completion"): {len(WORD_LEVEL)} examples' in said
    assert "dropped" not in said
