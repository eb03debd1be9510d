"""The training data of ``roundpipe train``: a JSONL file as tokenized, labelled examples.

Three line formats (``text``, ``prompt``/``completion``, ``messages``), labels in
Hugging Face's convention with the first label of every example ``-100`` so examples
can be packed side by side; long examples are truncated and examples with nothing to
learn dropped, both counted (docs/design.md#training-data). Batches are built by
:mod:`roundpipe.train.batches`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .chat import IGNORE_INDEX, chat_examples, special_token_ids

FORMAT_FIELDS = {
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "messages": ("messages",),
}


class DataError(ValueError):
    """The training data cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Example:
    """One tokenized example; ``labels`` has the length of ``input_ids``, ``-100``
    where there is no loss (always at position 0)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    @property
    def num_label_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


@dataclass
class Dataset:
    """The examples of one JSONL file. ``truncated`` counts the kept examples that were
    cut to ``seq_len`` tokens; ``dropped`` the examples left with nothing to learn."""

    path: Path
    format: str  # "text" | "prompt_completion" | "messages"
    seq_len: int
    examples: list[Example]
    truncated: int
    dropped: int


def load_dataset(path: str | Path, tokenizer: Any, seq_len: int) -> Dataset:
    """Reads, checks and tokenizes the JSONL file at ``path``; raises :class:`DataError`."""
    path = Path(path)
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an integer of at least 2, got {seq_len!r}")
    records = list(_read_records(path))
    if not records:
        raise DataError(f"{path}: no examples (the file is empty or holds only blank lines)")
    data_format = _common_format(path, records)
    if data_format == "messages" and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f'{path} holds chat data ("messages") but the tokenizer has no chat template; '
            'give a model whose tokenizer has one, or write the data as "text" or '
            '"prompt"+"completion", which need none'
        )
    special = special_token_ids(tokenizer)
    adds_eos = _adds_eos(tokenizer)
    examples, truncated, dropped = [], 0, 0
    for line, record in records:
        try:
            pairs = _tokenized(record, data_format, tokenizer, adds_eos)
        except ValueError as error:
            raise DataError(f"{path}:{line}: {error}") from error
        for ids, labels in pairs:
            labels = [IGNORE_INDEX, *labels[1:seq_len]][: len(ids)]
            if not any(label != IGNORE_INDEX and label not in special for label in labels):
                dropped += 1
                continue
            truncated += len(ids) > seq_len
            examples.append(Example(tuple(ids[:seq_len]), tuple(labels)))
    if not examples:
        raise DataError(
            f"{path}: all {dropped} examples were dropped: none has a labelled token within "
            f"the first {seq_len} tokens (empty completions or assistant turns, or prompts "
            "that fill the sequence); raise --seq-len or fix the data"
        )
    return Dataset(path, data_format, seq_len, examples, truncated, dropped)


def pad_token_id(tokenizer: Any) -> int:
    """The id that fills padding: the tokenizer's pad token, else its EOS, else 0."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    return 0


def _read_records(path: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, JSON object)`` for every non-blank line of ``path``."""
    try:
        file = path.open("rb")
    except OSError as error:
        raise DataError(f"cannot read the data file {path}: {error.strerror}") from error
    with file:
        for number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{path}:{number}: not UTF-8 text ({error.reason})") from error
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{number}: not valid JSON: {error}") from error
            if not isinstance(record, dict):
                raise DataError(
                    f"{path}:{number}: expected a JSON object, got {type(record).__name__}"
                )
            yield number, record


def _common_format(path: Path, records: list[tuple[int, dict]]) -> str:
    """The format all records share, each checked for its fields' types."""
    first_line, first_format = None, None
    for line, record in records:
        try:
            record_format = _format_of(record)
        except ValueError as error:
            raise DataError(f"{path}:{line}: {error}") from error
        if first_format is None:
            first_line, first_format = line, record_format
        elif record_format != first_format:
            raise DataError(
                f"{path}:{line}: a {_describe(record_format)} line in a file whose first "
                f"line ({first_line}) is {_describe(first_format)}; all lines must be one format"
            )
    return first_format


def _format_of(record: dict) -> str:
    present = [name for name, keys in FORMAT_FIELDS.items() if any(k in record for k in keys)]
    if not present:
        raise ValueError(
            f'no fields of a known format (keys: {sorted(record)}); expected "text", '
            '"prompt" and "completion", or "messages"'
        )
    if len(present) > 1:
        raise ValueError(f"fields of more than one format: {' and '.join(present)}")
    (data_format,) = present
    for key in FORMAT_FIELDS[data_format]:
        if key not in record:
            raise ValueError(f'{_describe(data_format)} line lacks "{key}"')
        if key != "messages" and not isinstance(record[key], str):
            raise ValueError(f'"{key}" must be a string, got {type(record[key]).__name__}')
    if data_format == "messages":
        _check_messages(record["messages"])
    return data_format


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            '"messages" must be a non-empty list of {"role": ..., "content": ...} objects'
        )
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            raise ValueError(f"message {number} is {type(message).__name__}, not an object")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = type(message[key]).__name__ if key in message else "nothing"
                raise ValueError(f'message {number}: "{key}" must be a string, got {got}')


def _describe(data_format: str) -> str:
    return {
        "text": '"text"',
        "prompt_completion": '"prompt"+"completion"',
        "messages": '"messages"',
    }[data_format]


def _tokenized(record: dict, data_format: str, tokenizer: Any, adds_eos: bool) -> list:
    """``(input_ids, labels)`` pairs of one record, before truncation. ``adds_eos``: the
    tokenizer appends EOS itself, so it is taken off the prompt and not doubled."""
    if data_format == "messages":
        return chat_examples(record["messages"], tokenizer)
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    head_text = record["text"] if data_format == "text" else record["prompt"]
    head = tokenizer.encode(head_text, add_special_tokens=True)
    if eos and adds_eos:
        head = head[:-1]
    if data_format == "text":
        return [(head + eos, head + eos)]
    completion = tokenizer.encode(record["completion"], add_special_tokens=False)
    return [(head + completion + eos, [IGNORE_INDEX] * len(head) + completion + eos)]


def _adds_eos(tokenizer: Any) -> bool:
    """Whether encoding with special tokens appends the EOS token itself."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    special = tokenizer.encode("a", add_special_tokens=True)
    return len(special) > len(plain) and special[-1] == tokenizer.eos_token_id
