"""The command line of ``roundpipe train``: the option table
(:data:`~roundpipe.train.options.OPTIONS`) as argparse arguments, Trainer's and TRL's
flags among them (:mod:`.trainer_flags`), and what the user gave: the parsed command
line and the ``--config`` layer (with ``--resume``, ``--output``'s ``run.yaml``),
translated to our keys (:func:`given_options`; docs/design.md#train-options)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from .aliases import JoinedNames, aliases_of, refuse_unknown_options
from .config_file import LISTS, read_options
from .options import BY_KEY, OPTIONS, RUN_YAML
from .trainer_flags import BY_NAME as TRAINER_NAMES
from .trainer_flags import FLAGS as TRAINER_FLAGS
from .trainer_flags import trains_every_weight, translate

METAVARS = {
    "model": "DIR|ID", "revision": "REV", "data": "SOURCES", "data_split": "SPLIT",
    "data_fields": "MAP", "output": "DIR", "eval_data": "SOURCES", "eval_split": "FRACTION",
    "config": "FILE", "warmup_ratio": "RATIO", "report_to": "NAMES",
    "chat_template": "FILE|NAME",
    "lora_r": "R", "lora_alpha": "ALPHA", "lora_targets": "NAMES", "lora_dropout": "P",
    "devices": "SPEC", "microbatches": "M", "dist_timeout": "SECONDS", "steps": "N",
    "epochs": "E", "batch_size": "B",
    "seq_len": "S", "seed": "SEED", "lr": "LR", "warmup_steps": "W", "grad_clip": "NORM",
    "weight_decay": "WD", "eval_every": "N", "save_every": "N", "keep_checkpoints": "K",
    "beta": "BETA", "label_smoothing": "P", "desirable_weight": "W", "undesirable_weight": "W",
}  # fmt: skip


def command_line_of(args: argparse.Namespace) -> dict[str, Any]:
    """The options the parsed ``args`` give: our keys, and Trainer's names that
    :func:`given_options` translates."""
    keys = set(BY_KEY) | set(TRAINER_NAMES)
    return {k: v for k, v in vars(args).items() if k in keys}


@dataclass(frozen=True)
class Given:
    """What the user gave, by our keys: on the command line and in the ``--config``
    layer; and a note for each Trainer name that changes nothing here."""

    command_line: dict[str, Any]
    config: dict[str, Any]
    notes: list[str]


def given_options(command_line: Mapping[str, Any]) -> Given:
    """The command line's options (ours and Trainer's names, as parsed) and those of
    ``--config`` or, with ``--resume`` and no ``--config``, of ``--output``'s
    ``run.yaml`` (the run's own options: nothing to retype), translated."""
    path = command_line.get("config")
    output = command_line.get("output")
    resume = command_line.get("resume", command_line.get("resume_from_checkpoint"))
    if path is None and resume and output is not None and not command_line.get("demo"):
        path = Path(output) / RUN_YAML if (Path(output) / RUN_YAML).is_file() else None
    config = read_options(path, BY_KEY) if path else {}
    full = trains_every_weight(command_line, config)
    from_config, config_notes = translate(config, full)
    from_command_line, notes = translate(command_line, full)
    return Given(from_command_line, from_config, config_notes + notes)


class _Arity(TypedDict, total=False):
    """``add_argument``'s options for an option taking several values, or none."""

    nargs: str
    action: type[argparse.Action]
    const: bool


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every option to ``parser``; an option not given is absent from the namespace."""
    groups: dict[str, Any] = {}
    for option in OPTIONS:
        group = groups.get(option.group) or parser.add_argument_group(option.group)
        groups[option.group] = group
        help_text = option.help + _default_text(option.default)
        if option.key == "resume":  # a flag that may name a checkpoint: --resume [DIR]
            group.add_argument("--resume", nargs="?", const=True, default=argparse.SUPPRESS,
                               metavar="DIR", help=help_text)  # fmt: skip
            group.add_argument("--no-resume", dest="resume", action="store_false",
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # fmt: skip
        elif option.default is True:  # on unless --no-NAME (--NAME undoes a file's false)
            group.add_argument(f"--no-{option.name}", dest=option.key, action="store_false",
                               default=argparse.SUPPRESS, help=option.help)  # fmt: skip
            group.add_argument(f"--{option.name}", dest=option.key, action="store_true",
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # fmt: skip
        elif option.parse is None:
            action = argparse.BooleanOptionalAction if option.key != "demo" else "store_true"
            group.add_argument(
                f"--{option.name}", action=action, default=argparse.SUPPRESS, help=help_text
            )
        else:
            names = [f"--{option.name}", *(f"--{name}" for name in aliases_of(option.key))]
            several: _Arity = {"nargs": "+", "action": JoinedNames} if option.key in LISTS else {}
            group.add_argument(
                *names,
                type=option.parse,
                choices=option.choices,
                default=argparse.SUPPRESS,
                help=help_text,
                metavar=None if option.choices else METAVARS[option.key],
                **several,
            )
    _add_trainer_flags(parser)
    known = [o.name for o in OPTIONS] + [a for o in OPTIONS for a in aliases_of(o.key)]
    known += [f"no-{o.name}" for o in OPTIONS if o.default is True or o.parse is None]
    refuse_unknown_options(parser, known + [f.name for f in TRAINER_FLAGS])


def _add_trainer_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "Trainer and TRL names",
        "accepted as these options of ours (in a --config file too); the rest of their "
        "names are extra spellings shown above (--learning_rate, --max_length, ...)",
    )
    for trainer_flag in TRAINER_FLAGS:
        switch: _Arity = {"nargs": "?", "const": True} if trainer_flag.switch else {}
        group.add_argument(
            f"--{trainer_flag.name}",
            dest=trainer_flag.name,
            type=trainer_flag.parse,
            default=argparse.SUPPRESS,
            help=trainer_flag.help,
            metavar=trainer_flag.metavar or "BOOL",
            **switch,
        )


def _default_text(default: Any) -> str:
    """`` (default 0.0)``; `` (default off)`` for a flag; nothing where there is none."""
    return "" if default is None else f" (default {'off' if default is False else default})"
