"""Where ``roundpipe train`` reads its data from: the records of each ``--data`` source,
each with the place it came from, for error messages.

A source is a local path if one exists, else a hub dataset id. JSONL and JSON arrays
are read here, so that an error names the file and line (and a JSON array's element);
CSV with :mod:`csv`, every cell a string, also named by line; Parquet files, a
``datasets`` ``save_to_disk`` directory, another local directory of data files and hub
ids through ``datasets``, imported only for them, named by row
(docs/design.md#training-data).
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import install_hint

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
FILE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".parquet")
"""Names ending so are files, never hub ids, even when they do not exist."""
_SPACE = re.compile(r"\s*")
_FORMAT_OF = {".jsonl": "json", ".ndjson": "json", ".json": "json"}
"""Suffixes ``datasets`` reads as one format."""
CSV_FIELD_LIMIT = 2**31 - 1
"""A CSV cell may hold a long document (the csv module's default limit is 128 KiB)."""


class DataError(ValueError):
    """The training data cannot be used; the message names the source, and the line or
    row where it has them."""


@dataclass(frozen=True)
class Records:
    """The rows of one source. ``numbers[i]`` counts row ``i`` from 1 in the source
    (a JSON array's element, a table's row); ``lines[i]`` is its line in a file that has
    lines (None for tables). ``unit`` names what is counted: line, element or row."""

    source: str
    label: str  # the short name for notes: a file's name, a hub id as given
    rows: list[dict]
    numbers: list[int]
    lines: list[int] | None
    unit: str

    def where(self, i: int) -> str:
        """Row ``i`` as ``file:line``, ``file:line (element n)`` or ``source: row n``."""
        if self.lines is None:
            return f"{self.source}: row {self.numbers[i]}"
        if self.unit == "element":
            return f"{self.source}:{self.lines[i]} (element {self.numbers[i]})"
        return f"{self.source}:{self.lines[i]}"

    def number(self, i: int) -> int:
        """The line of row ``i`` where the source has lines, else its number."""
        return self.numbers[i] if self.lines is None else self.lines[i]

    def subset(self, indices: list[int]) -> Records:
        """The rows at ``indices``, keeping where each came from."""
        lines = None if self.lines is None else [self.lines[i] for i in indices]
        return replace(
            self,
            rows=[self.rows[i] for i in indices],
            numbers=[self.numbers[i] for i in indices],
            lines=lines,
        )

    def with_rows(self, rows: list[dict]) -> Records:
        return replace(self, rows=rows)


def split_sources(sources: str | Path) -> list[str]:
    """``--data``'s sources: comma-separated, unless the whole value is an existing path."""
    text = str(sources)
    if Path(text).exists():
        return [text]
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise DataError(f"--data {text!r}: an empty source between commas")
    return parts


def resolve_sources(sources: str | Path) -> str:
    """``sources`` with each existing local path made absolute and hub ids as given."""
    parts = split_sources(sources)
    return ",".join(str(Path(p).absolute()) if Path(p).exists() else p for p in parts)


def read_source(source: str, split: str) -> Records:
    """The records of one source (``split``: the split of a hub or ``datasets`` one)."""
    path = Path(source)
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return _saved_dataset(path, split)
        return _hub_or_directory(source, split)
    suffix = path.suffix.lower()
    if path.exists() or suffix in FILE_SUFFIXES or not HUB_ID.fullmatch(source):
        if suffix == ".csv":
            return _csv(path)
        if suffix == ".parquet":
            table = _load(source, "parquet", data_files=str(path), split="train")
            return _table(str(path), path.name, table)
        text = _text(path)
        if suffix == ".json" and text.lstrip()[:1] == "[":
            return _json_array(path, text)
        return _jsonl(path, text)
    return _hub_or_directory(source, split)


def _text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise DataError(f"cannot read the data file {path}: {error.strerror}") from error
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text ({error.reason})") from error


def _jsonl(path: Path, text: str) -> Records:
    rows, lines = [], []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{number}: not valid JSON: {error}") from error
        except RecursionError:
            raise DataError(f"{path}:{number}: not usable JSON: nested too deeply") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        _check_text(record, f"{path}:{number}")
        rows.append(record)
        lines.append(number)
    return _file_records(path, rows, lines, "line")


def _json_array(path: Path, text: str) -> Records:
    """A file holding one JSON array of objects, each element's line found as it is
    decoded (``raw_decode`` walks the array one element at a time)."""
    decoder = json.JSONDecoder()
    rows: list[dict] = []
    lines: list[int] = []
    position = _past_space(text, text.index("[") + 1)
    line, counted = 1, 0
    while position < len(text) and text[position] != "]":
        line += text.count("\n", counted, position)
        counted = position
        try:
            record, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{error.lineno}: not valid JSON: {error}") from error
        except RecursionError:
            raise DataError(f"{path}:{line}: not usable JSON: nested too deeply") from None
        _check_text(record, f"{path}:{line}")
        if not isinstance(record, dict):
            raise DataError(
                f"{path}:{line} (element {len(rows) + 1}): expected a JSON object, got "
                f"{type(record).__name__}"
            )
        rows.append(record)
        lines.append(line)
        position = _past_space(text, end)
        if position < len(text) and text[position] == ",":
            position = _past_space(text, position + 1)
        elif position >= len(text) or text[position] != "]":
            line += text.count("\n", counted, position)
            raise DataError(f"{path}:{line}: not valid JSON: expected ',' or ']' after an element")
    if position >= len(text) or text[position + 1 :].strip():
        raise DataError(f"{path}: not valid JSON: the array does not end with ']' alone")
    return _file_records(path, rows, lines, "element")


def _check_text(record: Any, where: str) -> None:
    """A JSON string escape can make a lone UTF-16 surrogate (``"\\ud800"``), which is
    no character: no tokenizer can encode it."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        bad = error.object[error.start : error.end].encode("unicode_escape").decode()
        raise DataError(
            f"{where}: holds {bad}, a lone surrogate escape that is no character; fix the "
            "record's escapes"
        ) from None
    except RecursionError:
        raise DataError(f"{where}: not usable JSON: nested too deeply") from None


def _csv(path: Path) -> Records:
    """A CSV file with a header line; every cell stays a string (a completion ``42`` is
    text, not a number), of any length, and each record is named by the line it starts
    on. A header naming a column twice is refused (which cell would be the column's?)."""
    rows, lines = [], []
    text = _text(path)  # names the line of bytes that are not UTF-8
    csv.field_size_limit(max(csv.field_size_limit(), CSV_FIELD_LIMIT))
    try:
        reader = csv.reader(io.StringIO(text, newline=""))
        header, previous = None, 0
        for cells in reader:
            start, previous = previous + 1, reader.line_num
            if not cells:
                continue
            if header is None:
                header = cells
                twice = sorted({name for name in cells if cells.count(name) > 1})
                if twice:
                    raise DataError(
                        f"{path}:{start}: the header names the column {twice[0]!r} twice; "
                        "rename one"
                    )
                continue
            if len(cells) != len(header):
                raise DataError(
                    f"{path}:{start}: {len(cells)} fields where the header has {len(header)}"
                )
            rows.append(dict(zip(header, cells, strict=True)))
            lines.append(start)
    except csv.Error as error:
        raise DataError(f"{path}:{reader.line_num}: not valid CSV: {error}") from error
    return _file_records(path, rows, lines, "line")


def _past_space(text: str, position: int) -> int:
    """Where the whitespace from ``position`` ends (``\\s*`` matches anywhere)."""
    match = _SPACE.match(text, position)
    assert match is not None
    return match.end()


def _file_records(path: Path, rows: list[dict], lines: list[int], unit: str) -> Records:
    return Records(str(path), path.name, rows, list(range(1, len(rows) + 1)), lines, unit)


def _saved_dataset(path: Path, split: str) -> Records:
    """A directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``
    (``split`` picks the split of the latter)."""
    datasets = _datasets(str(path))
    try:
        loaded = datasets.load_from_disk(str(path))
    except (datasets.exceptions.DatasetsError, OSError, ValueError, KeyError) as error:
        raise DataError(f"{path}: datasets.load_from_disk cannot read it: {error}") from error
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(
                f"{path}: no split {split!r} (its splits: {', '.join(loaded)}); choose one "
                "with --data-split"
            )
        return _table(f"{path} (split {split})", f"{path.name} (split {split})", loaded[split])
    return _table(str(path), path.name, loaded)


def _hub_or_directory(source: str, split: str) -> Records:
    """``datasets.load_dataset(source, split=split)``: a local directory of data files,
    or a hub dataset id (offline, ``HF_HUB_OFFLINE=1``, from the user's cache). A
    directory of data files in several formats is refused: ``datasets`` would read the
    files of one format and silently leave the others out."""
    if Path(source).is_dir():
        _check_one_format(Path(source))
    name = f"{source} (split {split})"
    label = f"{Path(source).name} (split {split})" if Path(source).exists() else name
    return _table(name, label, _load(source, source, split=split))


def _check_one_format(directory: Path) -> None:
    files = sorted(
        p for p in directory.rglob("*") if p.is_file() and p.suffix.lower() in FILE_SUFFIXES
    )
    formats = {_FORMAT_OF.get(p.suffix.lower(), p.suffix.lower()) for p in files}
    if len(formats) > 1:
        named = ", ".join(str(p.relative_to(directory)) for p in files[:6])
        raise DataError(
            f"{directory} holds data files of {len(formats)} formats ({named}"
            f"{', ...' if len(files) > 6 else ''}); datasets reads one format per directory "
            "and would leave the others out: give the files as sources, comma-separated"
        )


def _load(source: str, path: str, **options: Any):
    datasets = _datasets(source)
    try:
        return datasets.load_dataset(path, **options)
    except (
        datasets.exceptions.DatasetsError,
        OSError,
        ValueError,
        KeyError,
        RuntimeError,
    ) as error:
        kind = "a local file or directory" if Path(source).exists() else "a hub dataset id"
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DataError(
            f"{source} (read as {kind}): datasets.load_dataset cannot load it: {message}"
        ) from error


def _table(source: str, label: str, table: Any) -> Records:
    rows = table.to_list()
    return Records(source, label, rows, list(range(1, len(rows) + 1)), None, "row")


def _datasets(source: str):
    try:
        import datasets
    except ImportError as error:
        raise DataError(
            f"{source}: reading it needs the datasets package: {install_hint('train')}"
        ) from error
    return datasets
