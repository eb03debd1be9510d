"""The formats of training data, recognised per source and normalised to the three that
:mod:`roundpipe.train.data` tokenizes: ``text``, ``prompt_completion`` and
``messages``.

A source's records are all of one format, told by its fields: ``text``; ``prompt`` and
``completion``, strings, or lists of messages (TRL's conversational prompt-completion:
loss on the completion's assistant messages); ``messages``; Alpaca (``instruction``,
``input``, ``output``: a prompt and completion); ShareGPT (``conversations`` of
``from``/``value`` turns: messages). Message content may be a list of text parts
(joined). Chat records with an ``images`` column (TRL's vision format) keep their
content parts, ``{"type": "image"}`` ones standing for the column's images in order
(:mod:`roundpipe.train.images`). ``--data-fields`` renames columns first
(docs/design.md#training-data).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .sources import DataError, Records

FORMAT_FIELDS = {  # a source format: the fields that tell it
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "messages": ("messages",),
    "alpaca": ("instruction", "output"),
    "sharegpt": ("conversations",),
}
FIELD_FORMATS = {
    **{field: name for name, keys in FORMAT_FIELDS.items() for field in keys},
    "input": "alpaca",  # optional, so it does not tell the format
}
"""Every field name ``--data-fields`` may map a column to, and its format."""
SHAREGPT_ROLES = {
    "human": "user",
    "gpt": "assistant",
    "system": "system",
    "user": "user",
    "assistant": "assistant",
}
_DESCRIPTIONS = {
    "text": '"text"',
    "prompt_completion": '"prompt"+"completion"',
    "conversational": 'conversational "prompt"+"completion"',
    "messages": '"messages"',
    "alpaca": 'Alpaca ("instruction"+"output")',
    "sharegpt": 'ShareGPT ("conversations")',
}


def parse_fields(spec: str | None) -> dict[str, str]:
    """``--data-fields prompt=question,completion=answer`` as ``{field: column}``."""
    fields = parse_field_map(spec, tuple(FIELD_FORMATS), "the fields are")
    formats = sorted({FIELD_FORMATS[field] for field in fields})
    if len(formats) > 1:
        raise DataError(
            f"--data-fields {spec!r} maps fields of more than one format "
            f"({' and '.join(_DESCRIPTIONS[f] for f in formats)}); a source has one format"
        )
    return fields


def parse_field_map(spec: str | None, known: tuple[str, ...], listed: str) -> dict[str, str]:
    """``--data-fields FIELD=COLUMN,...`` as ``{field: column}``, each field one of
    ``known`` (else refused, ``listed`` introducing them) and mapped once."""
    if not spec:
        return {}
    fields: dict[str, str] = {}
    for item in (item.strip() for item in spec.split(",")):
        field, equals, column = (part.strip() for part in item.partition("="))
        if not equals or not field or not column:
            raise DataError(f"--data-fields {spec!r}: {item!r} is not FIELD=COLUMN")
        if field not in known:
            raise DataError(
                f"--data-fields {spec!r}: unknown field {field!r}; {listed} {', '.join(known)}"
            )
        if field in fields:
            raise DataError(f"--data-fields {spec!r}: {field!r} is mapped twice")
        fields[field] = column
    return fields


def rows_of_one_format(
    records: Records, normalised: Callable[[dict], tuple[Any, dict]], describe: Callable
) -> tuple[Any, list[dict]]:
    """``(kind, rows)``: each record as ``normalised`` gives its ``(kind, row)`` (a
    ValueError refuses it, naming the record), all of one kind (``describe(kind)`` names
    it in the refusal of another); a source without records is refused."""
    rows, first = [], None
    for i, record in enumerate(records.rows):
        try:
            kind, row = normalised(record)
        except ValueError as error:
            raise DataError(f"{records.where(i)}: {error}") from error
        if first is None:
            first = kind
        elif kind != first:
            unit = records.unit
            raise DataError(
                f"{records.where(i)}: a {describe(kind)} {unit} in a source whose first "
                f"{unit} ({records.number(0)}) is {describe(first)}; all {unit}s must be "
                "one format"
            )
        rows.append(row)
    if first is None:
        raise DataError(f"{records.source}: no examples (it is empty or holds only blank lines)")
    return first, rows


def normalise(records: Records, fields: dict[str, str]) -> tuple[str, str, Records]:
    """``(internal format, source format's description, normalised records)``: the
    records renamed by ``fields``, checked to share one format and rewritten as
    ``{"text"}``, ``{"prompt", "completion"}`` or ``{"messages", "learn_from"}`` (the
    index of the first message whose assistant turns are learnt)."""
    allowed = {FIELD_FORMATS[field] for field in fields} or set(FORMAT_FIELDS)
    first, rows = rows_of_one_format(
        records, lambda record: _normalised(renamed(record, fields), allowed), _DESCRIPTIONS.get
    )
    internal = {
        "text": "text",
        "prompt_completion": "prompt_completion",
        "alpaca": "prompt_completion",
    }
    return internal.get(first, "messages"), _DESCRIPTIONS[first], records.with_rows(rows)


def renamed(record: dict, fields: dict[str, str]) -> dict:
    """``record`` with each mapped column under its field's name (and the columns that
    already bore those names dropped)."""
    if not fields:
        return record
    for field, column in fields.items():
        if column not in record:
            raise ValueError(
                f"no column {column!r} (--data-fields {field}={column}); the columns are "
                f"{', '.join(map(repr, record))}"
            )
    mapped = set(fields) | set(fields.values())
    return {
        **{key: value for key, value in record.items() if key not in mapped},
        **{field: record[column] for field, column in fields.items()},
    }


def _normalised(record: dict, allowed: set[str]) -> tuple[str, dict]:
    present = [
        name
        for name, keys in FORMAT_FIELDS.items()
        if name in allowed and any(record.get(k) is not None for k in keys)
    ]
    if not present:
        raise ValueError(
            f'no fields of a known format (keys: {sorted(record)}); expected "text", '
            '"prompt" and "completion", "messages", Alpaca\'s "instruction" and "output", '
            'or ShareGPT\'s "conversations" (columns of other names: --data-fields)'
        )
    if len(present) > 1:
        names = " and ".join(_DESCRIPTIONS[name] for name in present)
        raise ValueError(
            f"fields of more than one format: {names}; choose one with --data-fields "
            "(the columns of other formats are then ignored)"
        )
    (kind,) = present
    for key in FORMAT_FIELDS[kind]:
        if record.get(key) is None:
            raise ValueError(f'a {_DESCRIPTIONS[kind]} record lacks "{key}"')
    if kind == "text":
        return kind, {"text": _string(record, "text")}
    images = _images(record) if kind in ("messages", "prompt_completion") else None
    if kind == "messages":
        messages = messages_of(record["messages"], "messages", images is not None)
        return kind, _with_images({"messages": messages, "learn_from": 0}, images)
    if kind == "sharegpt":
        return kind, {"messages": _sharegpt(record["conversations"]), "learn_from": 0}
    if kind == "alpaca":
        instruction, output = _string(record, "instruction"), _string(record, "output")
        extra = record.get("input")
        if extra is not None and not isinstance(extra, str):
            raise ValueError(f'"input" must be a string, got {type(extra).__name__}')
        prompt_text = instruction + ("\n\n" + extra if extra else "")
        return kind, {"prompt": prompt_text, "completion": output}
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, list) and isinstance(completion, list):
        parts = images is not None
        prompt = messages_of(prompt, "prompt", parts)
        completion = messages_of(completion, "completion", parts)
        if not any(message["role"] == "assistant" for message in completion):
            raise ValueError('the "completion" has no assistant message, so nothing to learn')
        normalised = {"messages": prompt + completion, "learn_from": len(prompt)}
        return "conversational", _with_images(normalised, images)
    if images is not None:
        raise ValueError('"images" go with conversational records (lists of messages)')
    if isinstance(prompt, str) and isinstance(completion, str):
        return kind, {"prompt": prompt, "completion": completion}
    raise ValueError(
        '"prompt" and "completion" must both be strings, or both lists of messages '
        f"(conversational), got {type(prompt).__name__} and {type(completion).__name__}"
    )


def _string(record: dict, key: str) -> str:
    if not isinstance(record[key], str):
        raise ValueError(f'"{key}" must be a string, got {type(record[key]).__name__}')
    return record[key]


def _images(record: dict) -> list | None:
    """The record's ``images`` column (``None`` without one, or an empty one)."""
    images = record.get("images")
    if images is None or (isinstance(images, list) and not images):
        return None
    if not isinstance(images, list):
        raise ValueError(f'"images" must be a list of images, got {type(images).__name__}')
    return images


def _with_images(normalised: dict, images: list | None) -> dict:
    """A chat record with its images, checked against its image parts."""
    if images is None:
        return normalised
    parts = sum(
        1
        for message in normalised["messages"]
        if isinstance(message["content"], list)
        for part in message["content"]
        if part["type"] == "image"
    )
    if parts != len(images):
        raise ValueError(
            f'the messages hold {parts} image part(s) ({{"type": "image"}}) but "images" '
            f"has {len(images)} image(s); each image part stands for the next image"
        )
    return {**normalised, "images": images}


def messages_of(messages: Any, key: str, parts: bool = False) -> list[dict]:
    """Checked messages, each with its content as one string (``parts``: a list of
    text and image parts kept as such) and without the empty (``None``) keys a table
    gives messages that lack them."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f'"{key}" must be a non-empty list of {{"role": ..., "content": ...}} objects'
        )
    checked = []
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            raise ValueError(f"message {number} is {type(message).__name__}, not an object")
        if not isinstance(message.get("role"), str):
            raise ValueError(
                f'message {number}: "role" must be a string, got {_got(message, "role")}'
            )
        content = _content(message, number, parts)
        checked.append({**{k: v for k, v in message.items() if v is not None}, "content": content})
    return checked


def _content(message: dict, number: int, images: bool = False) -> str | list[dict]:
    """A message's content as a string; a list of text parts (``{"type": "text",
    "text": ...}``, the multimodal layout) is joined, as chat templates that take parts
    render them. With ``images`` (a record with an ``images`` column) the list is kept,
    checked, with its ``{"type": "image"}`` parts; other parts cannot be trained on."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(
            f'message {number}: "content" must be a string, got {_got(message, "content")} '
            '(or a list of {"type": "text", "text": ...} parts)'
        )
    parts = []
    for index, part in enumerate(content, start=1):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image" and images:
            parts.append({"type": "image"})
        else:
            what = f"of type {kind!r}" if isinstance(part, dict) else type(part).__name__
            raise ValueError(
                f"message {number}: content part {index} is {what}; only text parts "
                '({"type": "text", "text": ...}) can be trained on, and image parts '
                '({"type": "image"}) with the record\'s "images" column'
            )
    return parts if images else "".join(part["text"] for part in parts)


def _sharegpt(turns: Any) -> list[dict]:
    """ShareGPT turns as messages: ``from`` human, gpt, system (or user, assistant)."""
    if not isinstance(turns, list) or not turns:
        raise ValueError('"conversations" must be a non-empty list of {"from", "value"} turns')
    messages = []
    for number, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise ValueError(f"turn {number} is {type(turn).__name__}, not an object")
        if turn.get("from") not in SHAREGPT_ROLES:
            raise ValueError(
                f'turn {number}: "from" must be one of {", ".join(SHAREGPT_ROLES)}, got '
                f"{turn.get('from')!r}"
            )
        if not isinstance(turn.get("value"), str):
            raise ValueError(f'turn {number}: "value" must be a string, got {_got(turn, "value")}')
        messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
    return messages


def _got(record: dict, key: str) -> str:
    return type(record[key]).__name__ if key in record else "nothing"
