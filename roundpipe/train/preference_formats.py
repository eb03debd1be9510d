"""TRL's preference formats, recognised per source and normalised for
:mod:`roundpipe.train.preference_data`.

Paired records (DPO, and KTO after unpairing) hold ``prompt``, ``chosen`` and
``rejected``, or ``chosen`` and ``rejected`` alone with the prompt inside them, found
as TRL's ``extract_prompt`` finds it; unpaired records (KTO) hold ``prompt``,
``completion`` and a boolean ``label``. A record's fields are all strings (standard)
or all lists of ``{"role", "content"}`` messages (conversational), and a source's
records are all of one format. ``--data-fields`` renames columns first
(docs/design.md#training-data).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .formats import messages_of, parse_field_map, renamed, rows_of_one_format
from .sources import Records, read_source, split_sources

PREFERENCE_FIELDS = ("prompt", "chosen", "rejected", "completion", "label")
"""Every field name ``--data-fields`` may map a column to for ``--method dpo|kto``."""
UNPAIR_BATCH = 1000
"""``datasets``' default ``map`` batch size: TRL unpairs a paired dataset with a batched
map, so the unpaired rows come as this many chosen completions, then their rejected
ones, batch after batch."""
_PAIR = ("chosen", "rejected")
_UNPAIRED = ("prompt", "completion", "label")
_SFT_FIELDS = ("text", "messages", "conversations", "instruction", "output")


@dataclass(frozen=True)
class PreferenceSource:
    """One source's records, normalised: ``paired`` ones as ``{"prompt", "chosen",
    "rejected"}`` (the prompt extracted where it was implicit), the others as
    ``{"prompt", "completion", "label"}``; ``conversational``: their values are lists
    of messages, else strings."""

    paired: bool
    conversational: bool
    records: Records

    @property
    def format(self) -> str:
        """``"paired text"``, ``"unpaired conversational"``..."""
        return _format_name(self.paired, self.conversational)


def parse_preference_fields(spec: str | None) -> dict[str, str]:
    """``--data-fields chosen=good,rejected=bad`` as ``{field: column}``."""
    return parse_field_map(spec, tuple(PREFERENCE_FIELDS), "the fields of preference data are")


def read_preference_sources(
    sources: str | Path, split: str, fields: str | None, method: str
) -> list[PreferenceSource]:
    """The normalised records of each ``--data`` source, for ``method`` (dpo or kto)."""
    mapping = parse_preference_fields(fields)
    return [
        normalise_preference(read_source(source, split), mapping, method)
        for source in split_sources(sources)
    ]


def normalise_preference(records: Records, fields: dict[str, str], method: str) -> PreferenceSource:
    """``records`` renamed by ``fields``, checked and normalised; all of one format."""
    first, rows = rows_of_one_format(
        records,
        lambda record: _normalised(renamed(record, fields), method),
        lambda kind: _format_name(*kind),
    )
    return PreferenceSource(first[0], first[1], records.with_rows(rows))


def unpaired_order(count: int) -> list[tuple[int, bool]]:
    """``(pair, desirable)`` for each row TRL's ``unpair_preference_dataset`` makes of
    ``count`` pairs: per :data:`UNPAIR_BATCH` pairs, their chosen completions
    (desirable), then their rejected ones."""
    order = []
    for start in range(0, count, UNPAIR_BATCH):
        batch = range(start, min(start + UNPAIR_BATCH, count))
        order += [(i, True) for i in batch] + [(i, False) for i in batch]
    return order


def extract_prompt(chosen: str | list, rejected: str | list) -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)`` as TRL's ``extract_prompt`` splits a pair whose
    prompt is inside it: the prompt ends where the two first differ (for text, before a
    space there), or one before the shorter one's end if that is a prefix of the other.
    An empty prompt is refused (TRL's rule then reads index -1)."""
    length = min(len(chosen), len(rejected))
    differs = next((k for k in range(length) if chosen[k] != rejected[k]), None)
    if differs is None:  # one is a prefix of the other: TRL's loop ends on its last index
        cut = length - 1
    elif differs > 0 and chosen[differs - 1] == " ":
        cut = differs - 1
    else:
        cut = differs
    if cut <= 0:
        raise ValueError(
            '"chosen" and "rejected" share no prompt (they differ from the start); give the '
            'prompt in a "prompt" field'
        )
    return chosen[:cut], chosen[cut:], rejected[cut:]


def _normalised(record: dict, method: str) -> tuple[tuple[bool, bool], dict]:
    """``((paired, conversational), normalised row)`` of one renamed record."""
    present = _present(record)
    paired = any(record.get(key) is not None for key in _PAIR)
    unpaired = any(record.get(key) is not None for key in ("completion", "label"))
    if method == "dpo" and not paired:
        raise ValueError(
            f'--method dpo needs "chosen" and "rejected" (and "prompt" unless it is inside '
            f"them); the record has {_fields(present)}{_hint(record)}"
        )
    if method == "kto" and paired and unpaired:
        raise ValueError(
            'has both a pair ("chosen", "rejected") and an unpaired example ("completion", '
            '"label"); keep one (rename the other columns, or map them with --data-fields)'
        )
    if method == "kto" and not paired and not all(record.get(k) is not None for k in _UNPAIRED):
        raise ValueError(
            '--method kto needs "prompt", "completion" and "label" (true or false), or a '
            f'pair ("chosen", "rejected", and "prompt" unless it is inside them); the record '
            f"has {_fields(present)}{_hint(record)}"
        )
    if paired:
        return _paired(record)
    return _unpaired(record)


def _paired(record: dict) -> tuple[tuple[bool, bool], dict]:
    for key in _PAIR:
        if record.get(key) is None:
            raise ValueError(f'a pair lacks "{key}" (it has {_fields(_present(record))})')
    keys = [key for key in ("prompt", *_PAIR) if record.get(key) is not None]
    conversational = _conversational(record, keys)
    values = {key: _value(record, key, conversational) for key in keys}
    if values["chosen"] == values["rejected"]:
        raise ValueError('"chosen" and "rejected" are identical; a pair must differ')
    if "prompt" not in values:
        values["prompt"], values["chosen"], values["rejected"] = extract_prompt(
            values["chosen"], values["rejected"]
        )
    return (True, conversational), values


def _unpaired(record: dict) -> tuple[tuple[bool, bool], dict]:
    label = record["label"]
    if not isinstance(label, bool):
        raise ValueError(
            f'"label" must be true or false (a boolean: is the completion desirable?), got '
            f"{type(label).__name__} {label!r}"
        )
    conversational = _conversational(record, ["prompt", "completion"])
    row = {key: _value(record, key, conversational) for key in ("prompt", "completion")}
    return (False, conversational), {**row, "label": label}


def _conversational(record: dict, keys: list[str]) -> bool:
    """Whether the fields ``keys`` are lists of messages (all) or strings (all)."""
    kinds = {key: type(record[key]).__name__ for key in keys}
    for key, kind in kinds.items():
        if kind not in ("str", "list"):
            raise ValueError(f'"{key}" must be a string or a list of messages, got {kind}')
    if len(set(kinds.values())) > 1:
        described = ", ".join(f'"{key}" is {kind}' for key, kind in kinds.items())
        raise ValueError(
            f"mixes text and conversational fields ({described}); make all of them strings "
            "or all lists of messages"
        )
    return "list" in kinds.values()


def _value(record: dict, key: str, conversational: bool) -> str | list[dict]:
    """A field's checked value: messages as :mod:`~roundpipe.train.formats` checks them,
    or a string; only a prompt may be empty."""
    value = record[key]
    if conversational and not value:
        raise ValueError(f'"{key}" is an empty list of messages')
    if not value and key != "prompt":
        raise ValueError(f'"{key}" is empty; give it a completion')
    if not conversational:
        return value
    try:
        return messages_of(value, key)
    except ValueError as error:
        raise ValueError(f'"{key}": {error}') from error


def _present(record: dict) -> list[str]:
    return sorted(key for key, value in record.items() if value is not None)


def _fields(keys: list[str]) -> str:
    return ", ".join(f'"{key}"' for key in keys) if keys else "no fields"


def _hint(record: dict) -> str:
    """What the record looks like, when it is no preference data of the method."""
    if all(record.get(key) is not None for key in _UNPAIRED):
        return " (KTO's unpaired format: train it with --method kto)"
    if any(record.get(key) is not None for key in (*_SFT_FIELDS, "completion")):
        return " (supervised fine-tuning data: train it with --method sft)"
    return " (columns of other names: --data-fields)"


def _format_name(paired: bool, conversational: bool) -> str:
    pairing = "paired" if paired else "unpaired"
    return f"{pairing} {'conversational' if conversational else 'text'}"
