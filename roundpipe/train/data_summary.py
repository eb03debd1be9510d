"""What ``roundpipe train`` says about its data before it trains: per source the examples
and tokens (and those with a loss), the packed windows and how full they are, and the
first example as it is trained, its tokens with a loss marked (as LLaMA-Factory shows
one), so a wrong template or a prompt mask that hides the answer is seen at once."""

from __future__ import annotations

from typing import Any

from .chat import IGNORE_INDEX

MARK_OPEN, MARK_CLOSE = "[[", "]]"
"""Around the tokens with a loss in the rendered example."""
SHOWN_CHARACTERS = 1200
"""The rendered example is cut after this many characters."""


def data_summary(dataset: Any, batches: Any, tokenizer: Any, what: str = "training") -> list[str]:
    """Lines describing ``dataset`` (a :class:`~roundpipe.train.data.Dataset`) batched as
    ``batches`` (a :class:`~roundpipe.train.batches.Batches`)."""
    lines = []
    start = 0
    for counts in dataset.sources:
        examples = dataset.examples[start : start + counts.examples]
        start += counts.examples
        tokens = sum(len(example.input_ids) for example in examples)
        trained = sum(example.num_label_tokens for example in examples)
        lines.append(
            f"{what} data {counts.label} ({counts.format}): {counts.examples} examples, "
            f"{tokens:,} tokens, {trained:,} with a loss"
        )
    if batches.packing:
        tokens = sum(len(example.input_ids) for example in dataset.examples)
        windows = len(batches.rows)
        fill = tokens / (windows * dataset.seq_len)
        lines.append(
            f"packed into {windows} windows of {dataset.seq_len} tokens, {fill:.0%} filled"
        )
    if what == "training":
        lines.append(
            f"the first example as trained ({MARK_OPEN} {MARK_CLOSE} mark the tokens with a "
            f"loss):\n{rendered(dataset.examples[0], tokenizer)}"
        )
    return lines


def rendered(example: Any, tokenizer: Any) -> str:
    """``example``'s text, each run of tokens with a loss between the marks; cut after
    :data:`SHOWN_CHARACTERS` characters."""
    run: list[int]  # the token ids of one run
    pieces, run, run_trained = [], [], None
    for token, label in zip(example.input_ids, example.labels, strict=True):
        trained = label != IGNORE_INDEX
        if run and trained != run_trained:
            pieces.append(_piece(tokenizer, run, run_trained))
            run = []
        run.append(token)
        run_trained = trained
    if run:
        pieces.append(_piece(tokenizer, run, run_trained))
    text = "".join(pieces)
    if len(text) > SHOWN_CHARACTERS:
        text = text[:SHOWN_CHARACTERS] + f" ... ({len(text) - SHOWN_CHARACTERS:,} more characters)"
    return text


def _piece(tokenizer: Any, tokens: list[int], trained: bool | None) -> str:
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    return f"{MARK_OPEN}{text}{MARK_CLOSE}" if trained else text
