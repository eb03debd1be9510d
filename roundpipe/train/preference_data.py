"""The preference data of ``roundpipe train --method dpo|kto``: the records of its
sources as tokenized examples, and deterministic batches of them.

Records are read by :mod:`roundpipe.train.sources` and normalised by
:mod:`roundpipe.train.preference_formats`; they are tokenized exactly as TRL's
``DPOTrainer`` and ``KTOTrainer`` tokenize them (``_prepare_dataset``): text gets the
EOS token appended to its completions, a conversation is rendered by the chat
template, and the completion starts where the tokenized prompt and prompt+completion
diverge. Where TRL silently drops or garbles an example (a prompt that fills
``max_length``, identical or empty completions, a KTO set of one kind) the record is
refused. Batches cut rows to ``max_length`` keeping their start, as TRL's collators
do (docs/design.md#training-data).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .batches import padded_batch, seeded_generator
from .chat import IGNORE_INDEX
from .data import Example, held_out_sides
from .preference_formats import PreferenceSource, read_preference_sources, unpaired_order
from .sources import DataError, Records

__all__ = [
    "DataError",
    "PairExample",
    "PreferenceBatches",
    "PreferenceDataset",
    "UnpairedExample",
    "load_preference_dataset",
    "load_preference_held_out",
]
METHODS = ("dpo", "kto")


@dataclass(frozen=True)
class PairExample:
    """One DPO pair: the prompt's ids and each completion's ids after them."""

    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]


@dataclass(frozen=True)
class UnpairedExample:
    """One KTO example: a prompt, a completion and whether it is desirable."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    desirable: bool


@dataclass
class PreferenceDataset:
    """The examples of one or more sources, in their order (KTO's from pairs in TRL's
    unpaired order). ``format`` is each source's (``"paired text"``...), ``+``-joined
    when they differ; ``truncated`` counts the examples with a row longer than
    ``max_length`` (cut at batching, kept)."""

    path: str
    method: str  # "dpo" | "kto"
    format: str
    max_length: int | None
    examples: list
    truncated: int


def load_preference_dataset(
    sources: str | Path,
    tokenizer: Any,
    max_length: int | None,
    method: str,
    *,
    split: str = "train",
    fields: str | None = None,
) -> PreferenceDataset:
    """Reads, checks and tokenizes ``sources`` (one, or several comma-separated; see
    :func:`~roundpipe.train.sources.read_source`) for ``method`` (``"dpo"`` or
    ``"kto"``), with ``split`` for hub and ``datasets`` sources and the
    ``--data-fields`` mapping ``fields``; raises :class:`DataError`."""
    _check_options(max_length, method)
    parts = read_preference_sources(sources, split, fields, method)
    return _tokenized_dataset(str(sources), parts, tokenizer, max_length, method, balanced=True)


def load_preference_held_out(
    sources: str | Path,
    tokenizer: Any,
    max_length: int | None,
    method: str,
    fraction: float,
    seed: int,
    *,
    split: str = "train",
    fields: str | None = None,
) -> tuple[PreferenceDataset, PreferenceDataset]:
    """``(train, held out)`` by :func:`roundpipe.train.data.load_held_out`'s rule: the
    records of all ``sources`` in order, numbered 0..n-1; the first
    ``round(fraction * n)`` of ``torch.randperm(n)`` drawn with
    ``torch.Generator().manual_seed(seed)`` are held out (at least one on each side),
    each side keeping the records' order; a pair stays on one side when KTO unpairs
    it. Only the training side must hold both kinds of KTO example."""
    _check_options(max_length, method)
    parts = read_preference_sources(sources, split, fields, method)
    sides = held_out_sides(parts, fraction, seed, sources)
    name = str(sources)
    return (
        _tokenized_dataset(name, sides[0], tokenizer, max_length, method, balanced=True),
        _tokenized_dataset(f"{name} (held out)", sides[1], tokenizer, max_length, method),
    )


def _check_options(max_length: int | None, method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if max_length is not None and (
        not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1
    ):
        raise ValueError(f"max_length must be a positive integer or None, got {max_length!r}")


def _tokenized_dataset(
    name: str,
    parts: list[PreferenceSource],
    tokenizer: Any,
    max_length: int | None,
    method: str,
    balanced: bool = False,
) -> PreferenceDataset:
    """The examples of ``parts``; ``balanced``: a KTO set must hold both kinds."""
    examples: list = []
    for part in parts:
        records = part.records
        if part.conversational and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{records.source} holds chat data ({part.format}) but the tokenizer has no "
                "chat template (a base model?); give one with --chat-template (a Jinja file, "
                'or chatml, llama3, qwen3), or write "prompt", "chosen", "rejected" (or '
                '"completion") as strings, which need none'
            )
        if method == "dpo":
            examples += _pairs(records, tokenizer, max_length)
        else:
            examples += _unpaired(part, tokenizer, max_length)
    if method == "kto" and balanced:
        _check_both_kinds(name, examples)
    return PreferenceDataset(
        path=name,
        method=method,
        format="+".join(dict.fromkeys(part.format for part in parts)),
        max_length=max_length,
        examples=examples,
        truncated=sum(max_length is not None and _longest(e) > max_length for e in examples),
    )


def _pairs(records: Records, tokenizer: Any, max_length: int | None) -> list[PairExample]:
    """The pairs of ``records``, tokenized as TRL's ``DPOTrainer`` does."""
    pairs = []
    for i, row in enumerate(records.rows):
        try:
            prompt, (chosen, rejected) = _split(row, ("chosen", "rejected"), tokenizer, max_length)
            if chosen == rejected:
                raise ValueError(
                    '"chosen" and "rejected" tokenize to the same completion; a pair must differ'
                )
        except ValueError as error:
            raise DataError(f"{records.where(i)}: {error}") from error
        pairs.append(PairExample(prompt, chosen, rejected))
    return pairs


def _unpaired(part: PreferenceSource, tokenizer: Any, max_length: int | None) -> list:
    """The KTO examples of ``part``, tokenized as TRL's ``KTOTrainer`` does; pairs are
    unpaired first, in TRL's order."""
    records = part.records
    if part.paired:
        order = [
            (i, "chosen" if good else "rejected") for i, good in unpaired_order(len(records.rows))
        ]
    else:
        order = [(i, "completion") for i in range(len(records.rows))]
    examples = []
    for i, key in order:
        row = records.rows[i]
        try:
            prompt, (completion,) = _split(row, (key,), tokenizer, max_length)
        except ValueError as error:
            raise DataError(f"{records.where(i)}: {error}") from error
        desirable = row["label"] if key == "completion" else key == "chosen"
        examples.append(UnpairedExample(prompt, completion, desirable))
    return examples


def _split(
    row: dict, keys: tuple[str, ...], tokenizer: Any, max_length: int | None
) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """``(prompt ids, ids of each completion in keys)`` as TRL's ``tokenize_fn``: the
    prompt ends where the tokenized prompt and every prompt+completion stop agreeing
    (a template may render the prompt alone differently, or tokens merge across it)."""
    prompt = _ids(tokenizer, row["prompt"], generation=True)
    full = [_ids(tokenizer, _with_completion(row, key, tokenizer.eos_token)) for key in keys]
    start = min(_common_prefix(prompt, ids) for ids in full)
    for key, ids in zip(keys, full, strict=True):
        if len(ids) == start:
            raise ValueError(
                f'"{key}" adds no token after the prompt (the prompt+completion tokenizes to '
                "the prompt's tokens); give it a non-empty completion"
            )
    if max_length is not None and start >= max_length:  # TRL drops it, unseen
        raise ValueError(
            f"its prompt has {start} tokens, --seq-len (--max_length) is {max_length}: raise "
            "it or shorten the prompt"
        )
    return tuple(prompt[:start]), [tuple(ids[start:]) for ids in full]


def _with_completion(row: dict, key: str, eos: str | None) -> str | list[dict]:
    """The prompt followed by completion ``key``: messages joined, or text joined with
    the EOS token appended unless the completion ends with it (TRL's ``add_eos``; a
    tokenizer without an EOS token appends nothing, where TRL would fail)."""
    completion = row[key]
    if isinstance(completion, str) and eos is not None and not completion.endswith(eos):
        completion += eos
    return row["prompt"] + completion


def _ids(tokenizer: Any, content: str | list[dict], generation: bool = False) -> list[int]:
    """TRL's ``_tokenize``: a conversation through the chat template (``generation``:
    with the generation prompt), text through the tokenizer with its special tokens."""
    if isinstance(content, str):
        return list(tokenizer(text=content)["input_ids"])
    try:
        rendered = tokenizer.apply_chat_template(
            content, tokenize=True, return_dict=True, add_generation_prompt=generation
        )
    except Exception as error:  # template errors come as jinja's, transformers' or ours
        raise ValueError(f"the chat template failed on this conversation: {error}") from error
    return list(rendered["input_ids"])


def _common_prefix(ids: list[int], other: list[int]) -> int:
    """How many leading tokens ``ids`` and ``other`` share (TRL's
    ``common_prefix_length``: a template may render the prompt alone differently)."""
    length = 0
    for token, other_token in zip(ids, other, strict=False):
        if token != other_token:
            break
        length += 1
    return length


def _check_both_kinds(name: str, examples: list[UnpairedExample]) -> None:
    desirable = sum(example.desirable for example in examples)
    if desirable in (0, len(examples)):
        kind = "desirable (label true)" if desirable else "undesirable (label false)"
        raise DataError(
            f"{name}: all {len(examples)} examples are {kind}; KTO needs both desirable and "
            "undesirable examples: add some of the other label"
        )


def _longest(example: PairExample | UnpairedExample) -> int:
    if isinstance(example, PairExample):
        return len(example.prompt_ids) + max(len(example.chosen_ids), len(example.rejected_ids))
    return len(example.prompt_ids) + len(example.completion_ids)


class PreferenceBatches:
    """The batches of a :class:`PreferenceDataset`, a pure function of the data, the
    seed and the step, as :class:`~roundpipe.train.batches.Batches`: the examples are
    shuffled per epoch by ``torch.randperm`` seeded ``seed + epoch`` and batch ``step``
    is the next ``batch_size`` of them.

    Each row is prompt + completion cut to ``max_length`` (keeping the start) and
    right-padded with ``pad_id``; ``labels`` are the completion's tokens, ``-100``
    elsewhere, unshifted. DPO rows come in pairs, chosen then rejected, so that a pair
    stays in one microbatch. KTO batches add ``desirable`` and the KL rows
    (``kl_input_ids``, ``kl_attention_mask``, ``kl_labels``): each example's prompt
    with the completion of the example before it, within chunks of ``batch_size``
    examples in dataset order (the first of a chunk takes its last), as TRL forms them
    before shuffling."""

    def __init__(self, dataset: PreferenceDataset, batch_size: int, seed: int, pad_id: int):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not dataset.examples:
            raise ValueError(f"{dataset.path}: the dataset has no examples to batch")
        self.examples = dataset.examples
        self.method = dataset.method
        self.max_length = dataset.max_length
        self.batch_size = batch_size
        self.seed = seed
        self.pad_id = pad_id
        self.steps_per_epoch = math.ceil(len(self.examples) / batch_size)
        self.rows = [[i] for i in range(len(self.examples))]
        """What a batch takes ``batch_size`` of, as ``Batches.rows``: one example each."""
        self.kl_completions = (
            _kl_completions(self.examples, batch_size) if self.method == "kto" else []
        )
        self._epoch_order: tuple[int, list[int]] | None = None

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """The batch of global step ``step`` (0-based, counting across epochs)."""
        return self.batch_of(self.indices(step))

    def batch_of(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The batch of the examples at ``indices`` (dataset order), in that order."""
        batch = padded_batch([row for i in indices for row in self._rows(i)], self.pad_id)
        if self.method == "kto":
            examples = [self.examples[i] for i in indices]
            kl_rows = [
                self._row(self.examples[i].prompt_ids, self.kl_completions[i]) for i in indices
            ]
            kl = padded_batch(kl_rows, self.pad_id)
            batch["desirable"] = torch.tensor([e.desirable for e in examples], dtype=torch.bool)
            batch.update({f"kl_{key}": value for key, value in kl.items()})
        return batch

    def num_tokens(self, step: int) -> int:
        """Tokens of the rows of batch ``step``, padding excluded (as TRL's
        ``num_tokens`` metric: both rows of a DPO pair, a KTO example's row but not its
        KL row)."""
        return sum(len(row.input_ids) for i in self.indices(step) for row in self._rows(i))

    def _rows(self, i: int) -> list[Example]:
        """Example ``i``'s rows: a pair's chosen and rejected, or a KTO example's."""
        example = self.examples[i]
        if self.method == "dpo":
            return [
                self._row(example.prompt_ids, example.chosen_ids),
                self._row(example.prompt_ids, example.rejected_ids),
            ]
        return [self._row(example.prompt_ids, example.completion_ids)]

    def _row(self, prompt: tuple[int, ...], completion: tuple[int, ...]) -> Example:
        """prompt + completion cut to ``max_length``, the completion labelled."""
        cut = slice(None, self.max_length)
        labels = ((IGNORE_INDEX,) * len(prompt) + completion)[cut]
        return Example((prompt + completion)[cut], labels)

    def indices(self, step: int) -> list[int]:
        """The examples (dataset order) of batch ``step``."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        epoch, index = divmod(step, self.steps_per_epoch)
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = torch.randperm(
                len(self.examples), generator=seeded_generator(self.seed + epoch)
            )
            self._epoch_order = epoch, order.tolist()
        return self._epoch_order[1][index * self.batch_size : (index + 1) * self.batch_size]


def _kl_completions(examples: list[UnpairedExample], batch_size: int) -> list[tuple[int, ...]]:
    """Each example's KL completion: TRL's ``add_kl_completion_ids``, mapped batched
    over ``batch_size`` examples in dataset order, gives example k the completion of
    example k - 1 and a chunk's first the chunk's last."""
    completions = [example.completion_ids for example in examples]
    kl = []
    for start in range(0, len(completions), batch_size):
        chunk = completions[start : start + batch_size]
        kl += [chunk[-1], *chunk[:-1]]
    return kl
