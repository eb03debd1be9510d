"""``--config`` files: a YAML mapping of option names (ours, with ``-`` or ``_``, or
Trainer's and TRL's, :mod:`.aliases` and :mod:`.trainer_flags`) to values, each
converted as the command line converts it. :func:`roundpipe.train.options.read_config`
reads one against the option table."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .aliases import HF_NAMES, hint
from .trainer_flags import BY_NAME as TRAINER_FLAGS
from .usage import UsageError

LISTS = ("lora_targets", "report_to")
"""Options of names, which YAML may give as a list."""


def read_options(path: Path, table: Mapping[str, Any]) -> dict[str, Any]:
    """The options of the YAML file ``path``, by key of ``table`` (our keys ->
    :class:`~roundpipe.train.options.Option`) or, for a name of
    :data:`~roundpipe.train.trainer_flags.FLAGS`, by that name (translated later),
    converted; ``null`` values are left out (not given). ``config`` itself is not an
    option of a file."""
    import yaml

    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise UsageError(f"--config {path}: cannot read it ({error.strerror})") from error
    except yaml.YAMLError as error:
        raise UsageError(f"--config {path}: not valid YAML: {error}") from error
    if loaded is None:
        return {}
    if not isinstance(loaded, Mapping):
        raise UsageError(f"--config {path}: expected a mapping of option names to values")
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for raw_key, value in loaded.items():
        key = _key(str(raw_key), table, path)
        if key in spelled:
            raise UsageError(
                f"--config {path}: {spelled[key]!r} and {raw_key!r} are the same option; "
                "give one of them"
            )
        spelled[key] = str(raw_key)
        if value is not None:
            option = table.get(key) or TRAINER_FLAGS[key]
            values[key] = convert(option, value, path)
    return values


def _key(raw_key: str, table: Mapping[str, Any], path: Path) -> str:
    name = raw_key.replace("-", "_")
    key = HF_NAMES.get(name, name)
    if (key not in table and key not in TRAINER_FLAGS) or key == "config":
        known = [k for k in (*table, *HF_NAMES, *TRAINER_FLAGS) if k != "config"]
        raise UsageError(f"--config {path}: unknown option {raw_key!r}{hint(name, known, repr)}")
    return key


def convert(option: Any, value: Any, path: Path) -> Any:
    """A YAML ``value`` of ``option`` (ours or a Trainer flag) as its ``parse`` makes it
    from text (an on/off flag takes a YAML boolean; the :data:`LISTS` also a list of
    names)."""
    where = f"--config {path}: {option.name}"
    if getattr(option, "switch", False) and isinstance(value, bool):
        return value
    if option.parse is None:
        if not isinstance(value, bool):
            raise UsageError(f"{where} must be true or false, got {value!r}")
        return value
    if getattr(option, "key", None) in LISTS and isinstance(value, list):  # YAML's spelling
        if not all(isinstance(name, str) for name in value):
            raise UsageError(f"{where} must list names, got {value!r}")
        value = ",".join(value)
    if isinstance(value, (bool, list, dict)):
        raise UsageError(f"{where} must be a single {option.parse.__name__}, got {value!r}")
    try:
        converted = option.parse(str(value))
    except argparse.ArgumentTypeError as error:
        raise UsageError(f"{where}: {error}") from error
    except ValueError as error:
        raise UsageError(f"{where}: {value!r} is not a valid {option.parse.__name__}") from error
    if getattr(option, "choices", None) and converted not in option.choices:
        raise UsageError(f"{where} must be one of {', '.join(option.choices)}, got {value!r}")
    return converted
