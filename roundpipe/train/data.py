"""The training data of ``roundpipe train``: the records of its sources as tokenized,
labelled examples.

Records are read by :mod:`roundpipe.train.sources` and normalised to three formats
(``text``, ``prompt_completion``, ``messages``) by :mod:`roundpipe.train.formats`;
labels are in Hugging Face's convention with the first label of every example
``-100`` so examples can be packed side by side; long examples are truncated and
examples with nothing to learn dropped, both counted per source; ``--eval-split``
holds out a seeded share of the records (docs/design.md#training-data). Chat records
with images (:mod:`roundpipe.train.images`) keep their images' references, and their
image tokens stand for the images as the model's processor stands them. Batches are
built by :mod:`roundpipe.train.batches`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from .chat import IGNORE_INDEX, chat_examples, special_token_ids, whole_chat_example
from .formats import normalise, parse_fields
from .images import ImageReader, resolve_image
from .sources import DataError, Records, read_source, split_sources

__all__ = ["DataError", "Dataset", "Example", "load_dataset", "load_held_out", "pad_token_id"]


@dataclass(frozen=True)
class Example:
    """One tokenized example; ``labels`` has the length of ``input_ids``, ``-100``
    where there is no loss (always at position 0)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    images: tuple = ()  # the images its image tokens stand for, resolved (paths, bytes, PIL)
    grids: tuple = ()  # their patch grids, (t, h, w) each, as measured when read

    @property
    def num_label_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


@dataclass(frozen=True)
class SourceCounts:
    """What one source gave: its format and how many examples were kept, truncated
    (kept, cut to ``seq_len`` tokens) and dropped (nothing to learn)."""

    label: str
    format: str  # the source's own format, described: "Alpaca (...)", '"messages"'...
    examples: int
    truncated: int
    dropped: int


@dataclass
class Dataset:
    """The examples of one or more sources, in their order. ``path`` is the sources as
    given; ``format`` the internal format, ``+``-joined when the sources differ;
    ``truncated`` and ``dropped`` the totals of ``sources``."""

    path: str | Path
    format: str  # "text" | "prompt_completion" | "messages", or several joined by "+"
    seq_len: int
    examples: list[Example]
    truncated: int
    dropped: int
    sources: tuple[SourceCounts, ...] = ()
    images: ImageReader | None = None  # what turns the examples' images into inputs


@dataclass(frozen=True)
class _Part:
    """One source's records, normalised to ``format``."""

    format: str
    description: str
    records: Records


def load_dataset(
    sources: str | Path,
    tokenizer: Any,
    seq_len: int,
    *,
    split: str = "train",
    fields: str | None = None,
    train_on_prompt: bool = False,
    images: ImageReader | None = None,
) -> Dataset:
    """Reads, checks and tokenizes ``sources`` (one, or several comma-separated; see
    :func:`~roundpipe.train.sources.read_source`) with ``split`` for hub and
    ``datasets`` sources and the ``--data-fields`` mapping ``fields``; ``images`` reads
    the images of vision chat records (without it they are refused); raises
    :class:`DataError`."""
    _check_seq_len(seq_len)
    parts = _read(sources, split, fields)
    return _tokenized_dataset(str(sources), parts, tokenizer, seq_len, train_on_prompt, images)


def load_held_out(
    sources: str | Path,
    tokenizer: Any,
    seq_len: int,
    fraction: float,
    seed: int,
    *,
    split: str = "train",
    fields: str | None = None,
    train_on_prompt: bool = False,
    images: ImageReader | None = None,
) -> tuple[Dataset, Dataset]:
    """``(train, held out)``: the records of all ``sources`` in order, numbered 0..n-1;
    the first ``round(fraction * n)`` of ``torch.randperm(n)`` drawn with
    ``torch.Generator().manual_seed(seed)`` are held out (at least one on each side),
    each side keeping the records' order; records are split before tokenizing, so the
    examples of one conversation stay on one side."""
    _check_seq_len(seq_len)
    sides = held_out_sides(_read(sources, split, fields), fraction, seed, sources)
    name = str(sources)
    held_out = f"{name} (held out)"
    return (
        _tokenized_dataset(name, sides[0], tokenizer, seq_len, train_on_prompt, images),
        _tokenized_dataset(held_out, sides[1], tokenizer, seq_len, train_on_prompt, images),
    )


Part = TypeVar("Part", bound=Any)


def held_out_sides(
    parts: list[Part], fraction: float, seed: int, sources: Any
) -> tuple[list[Part], list[Part]]:
    """``parts`` (dataclasses with ``records``) split into (train, held out) records as
    :func:`load_held_out` says, each side's parts keeping the records' order."""
    total = sum(len(part.records.rows) for part in parts)
    held = round(fraction * total)
    if not 0 < held < total:
        raise DataError(
            f"--eval-split {fraction}: holds out {held} of the {total} records of {sources}; "
            "each side needs at least one"
        )
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    chosen = set(order[:held])
    sides: tuple[list[Part], list[Part]] = ([], [])
    offset = 0
    for part in parts:
        count = len(part.records.rows)
        for side, keep in zip(sides, (False, True), strict=True):
            indices = [i for i in range(count) if ((offset + i) in chosen) == keep]
            if indices:
                records = part.records.subset(indices)
                if keep:
                    records = replace(records, label=f"{records.label} (held out)")
                side.append(replace(part, records=records))
        offset += count
    return sides


def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an integer of at least 2, got {seq_len!r}")


def _read(sources: str | Path, split: str, fields: str | None) -> list[_Part]:
    mapping = parse_fields(fields)
    parts = []
    for source in split_sources(sources):
        internal, description, records = normalise(read_source(source, split), mapping)
        parts.append(_Part(internal, description, records))
    return parts


def _tokenized_dataset(
    name: str,
    parts: list[_Part],
    tokenizer: Any,
    seq_len: int,
    train_on_prompt: bool,
    images: ImageReader | None,
) -> Dataset:
    special = special_token_ids(tokenizer)
    adds_eos = _adds_eos(tokenizer)
    examples: list[Example] = []
    counts = []
    for part in parts:
        records = part.records
        if part.format == "messages" and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{records.source} holds chat data ({part.description}) but the tokenizer has "
                "no chat template (a base model?); give one with --chat-template (a Jinja "
                'file, or chatml, llama3, qwen3), or write the data as "text" or '
                '"prompt"+"completion", which need none'
            )
        kept, truncated, dropped = len(examples), 0, 0
        base = _folder(records.source)
        for i, record in enumerate(records.rows):
            try:
                pairs = _tokenized(record, part.format, tokenizer, adds_eos, train_on_prompt)
                pictured = _with_images(pairs, record, images, base, seq_len)
            except ValueError as error:
                raise DataError(f"{records.where(i)}: {error}") from error
            for ids, labels, extra in pictured:
                labels = [IGNORE_INDEX, *labels[1:seq_len]][: len(ids)]
                if not any(label != IGNORE_INDEX and label not in special for label in labels):
                    dropped += 1
                    continue
                truncated += len(ids) > seq_len
                examples.append(Example(tuple(ids[:seq_len]), tuple(labels), *extra))
        counts.append(
            SourceCounts(records.label, part.description, len(examples) - kept, truncated, dropped)
        )
    if not examples:
        dropped = sum(count.dropped for count in counts)
        raise DataError(
            f"{name}: all {dropped} examples were dropped: none has a labelled token within "
            f"the first {seq_len} tokens (empty completions or assistant turns, or prompts "
            "that fill the sequence); raise --seq-len or fix the data"
        )
    formats = "+".join(dict.fromkeys(part.format for part in parts))
    total_truncated = sum(count.truncated for count in counts)
    total_dropped = sum(count.dropped for count in counts)
    reader = images if any(example.images for example in examples) else None
    return Dataset(
        name, formats, seq_len, examples, total_truncated, total_dropped, tuple(counts), reader
    )


def _folder(source: str) -> Path | None:
    """The folder of a data file, against which its relative image paths are read."""
    path = Path(source)
    return path.parent if path.is_file() else None


def _with_images(
    pairs: list, record: dict, images: ImageReader | None, base: Path | None, seq_len: int
) -> list[tuple[list[int], list[int], tuple]]:
    """``(ids, labels, (images, grids))`` of each pair: a record with images has its
    image tokens stood for by its images' tokens (which cannot be cut at ``seq_len``)."""
    if not record.get("images"):
        return [(ids, labels, ()) for ids, labels in pairs]
    if images is None:
        raise ValueError("the record has images, but this data is read without a model")
    if len(pairs) != 1:
        raise ValueError(
            "the chat template rewrites earlier turns, giving one example per assistant "
            "turn; a conversation with images must be one example (a template that keeps "
            "earlier turns)"
        )
    (ids, labels), resolved = pairs[0], [resolve_image(image, base) for image in record["images"]]
    ids, labels, grids = images.expand(ids, labels, resolved)
    if len(ids) > seq_len:
        raise ValueError(
            f"its {len(ids)} tokens (with the image tokens of its {len(grids)} image(s)) "
            f"exceed --seq-len {seq_len}, and image tokens cannot be cut; raise --seq-len "
            "or use smaller images"
        )
    return [(ids, labels, (tuple(resolved), grids))]


def pad_token_id(tokenizer: Any) -> int:
    """The id that fills padding: the tokenizer's pad token, else its EOS, else 0."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    return 0


def _tokenized(
    record: dict, data_format: str, tokenizer: Any, adds_eos: bool, train_on_prompt: bool
) -> list:
    """``(input_ids, labels)`` pairs of one normalised record, before truncation.
    ``adds_eos``: the tokenizer appends EOS itself, so it is taken off the prompt and
    not doubled; ``train_on_prompt``: every token is labelled."""
    if data_format == "messages":
        if train_on_prompt:
            return [whole_chat_example(record["messages"], tokenizer)]
        return chat_examples(record["messages"], tokenizer, record["learn_from"])
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    head_text = record["text"] if data_format == "text" else record["prompt"]
    head = tokenizer.encode(head_text, add_special_tokens=True)
    if eos and adds_eos:
        head = head[:-1]
    if data_format == "text":
        return [(head + eos, head + eos)]
    completion = tokenizer.encode(record["completion"], add_special_tokens=False)
    ids = head + completion + eos
    prompt_labels = head if train_on_prompt else [IGNORE_INDEX] * len(head)
    return [(ids, prompt_labels + completion + eos)]


def _adds_eos(tokenizer: Any) -> bool:
    """Whether encoding with special tokens appends the EOS token itself."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    special = tokenizer.encode("a", add_special_tokens=True)
    return len(special) > len(plain) and special[-1] == tokenizer.eos_token_id
