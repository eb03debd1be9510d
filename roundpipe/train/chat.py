"""Chat data: a conversation rendered with the tokenizer's chat template, loss on the
assistant turns only (or on every token, for ``--train-on-prompt``).

Which characters belong to an assistant turn is read off the template itself, by
rendering prefixes of the conversation, so any template works without knowing its
markup; templates that rewrite earlier turns give one example per such turn
(docs/design.md#chat-labels).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..hf.decoder import IGNORE_INDEX  # the label of a token without loss (HF's -100)

Span = tuple[int, int]


def chat_examples(
    messages: Sequence[dict], tokenizer: Any, learn_from: int = 0
) -> list[tuple[list[int], list[int]]]:
    """``messages`` (validated dicts with string ``role`` and ``content``) as one or more
    ``(input_ids, labels)`` pairs; labels are ``IGNORE_INDEX`` outside the assistant
    turns from message ``learn_from`` on (a conversational prompt's own assistant turns
    are not learnt). Raises ``ValueError`` (without a location: the caller adds it) when
    there is no such turn or the template cannot be rendered or does not extend its own
    generation prompt."""
    turns = [
        k
        for k, message in enumerate(messages)
        if message["role"] == "assistant" and k >= learn_from
    ]
    if not turns:
        raise ValueError("the conversation has no assistant turn, so nothing to learn")
    pieces = []
    while turns:
        text = _render(tokenizer, messages[: turns[-1] + 1], generation_prompt=False)
        spans: list[Span] = []
        while turns and (span := _turn_span(tokenizer, messages, turns[-1], text)) is not None:
            spans.append(span)
            turns.pop()
        if not spans:
            raise ValueError(
                f"the chat template's rendering of message {turns[-1] + 1} (assistant) does "
                "not start with its rendering of the messages before it plus the generation "
                "prompt (add_generation_prompt=True), so the assistant turn cannot be located"
            )
        pieces.append(_labelled_tokens(tokenizer, text, spans[::-1]))
    return pieces[::-1]


def whole_chat_example(messages: Sequence[dict], tokenizer: Any) -> tuple[list[int], list[int]]:
    """The whole conversation as the template renders it, every token labelled
    (``--train-on-prompt``: what TRL trains on for messages by default)."""
    text = _render(tokenizer, messages, generation_prompt=False)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return ids, list(ids)


def _render(tokenizer: Any, messages: Sequence[dict], generation_prompt: bool) -> str:
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as error:  # template errors come as jinja's, transformers' or ours
        raise ValueError(f"the chat template failed on this conversation: {error}") from error
    if not isinstance(text, str):
        raise ValueError(f"the chat template rendered {type(text).__name__}, not a string")
    return text


def _turn_span(tokenizer: Any, messages: Sequence[dict], turn: int, text: str) -> Span | None:
    """The characters of assistant message ``turn`` in ``text`` (the rendering of a
    conversation that contains it), or None if the template breaks the prefix property."""
    before = _render(tokenizer, messages[:turn], generation_prompt=True)
    after = _render(tokenizer, messages[: turn + 1], generation_prompt=False)
    if len(before) <= len(after) and text.startswith(after) and after.startswith(before):
        return len(before), len(after)
    return None


def _labelled_tokens(tokenizer: Any, text: str, spans: list[Span]) -> tuple[list[int], list[int]]:
    """``text`` tokenized as ``apply_chat_template`` does (no added special tokens), each
    token labelled when it starts inside a span, up to the span's last special token."""
    ids, starts = _tokens_with_starts(tokenizer, text, [edge for span in spans for edge in span])
    special = special_token_ids(tokenizer)
    labels = [IGNORE_INDEX] * len(ids)
    for begin, end in spans:
        inside = [i for i, start in enumerate(starts) if begin <= start < end]
        last_special = max((i for i in inside if ids[i] in special), default=None)
        for i in inside:
            if last_special is None or i <= last_special:
                labels[i] = ids[i]
    return ids, labels


def _tokens_with_starts(tokenizer: Any, text: str, cuts: list[int]) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` and the character offset where each token starts. A fast
    tokenizer tokenizes the whole text and reports offsets; a slow one tokenizes the
    pieces between ``cuts`` separately (each piece's tokens start at the piece)."""
    if getattr(tokenizer, "is_fast", False):
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoding["input_ids"]), [start for start, _ in encoding["offset_mapping"]]
    ids: list[int] = []
    starts: list[int] = []
    edges = sorted({0, len(text), *cuts})
    for begin, end in zip(edges, edges[1:], strict=False):
        piece = tokenizer.encode(text[begin:end], add_special_tokens=False)
        ids += piece
        starts += [begin] * len(piece)
    return ids, starts


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special tokens: the named ones (BOS, EOS, pad...) and every
    added token marked special (``<|im_start|>``, ``<|eot_id|>``...). The UNK token is
    none of them unless another name shares it (GPT-2's is its EOS): it stands for text
    the vocabulary lacks (an emoji, to a word-level one) and is learnt like the text, as
    TRL learns it."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = set(tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}
    named = {getattr(tokenizer, f"{name}_token_id", None) for name in _NAMED_BESIDES_UNK}
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk not in named:
        special.discard(unk)
    return special


_NAMED_BESIDES_UNK = ("bos", "eos", "pad", "sep", "cls", "mask")
"""The special tokens ``transformers`` names, besides UNK."""
