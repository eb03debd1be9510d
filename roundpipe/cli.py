"""The ``roundpipe`` command: the top-level parser, its subcommands, and the dispatch.

Each subcommand registers its own parser and run function: ``simulate`` in
:mod:`roundpipe.predict.simulate_command`, ``train`` in :mod:`roundpipe.train.command`,
``export`` in :mod:`roundpipe.train.export`, ``env`` in :mod:`roundpipe.train.environment`.
``roundpipe --version`` prints the installed version.
A ``ValueError`` a run raises is bad input: its message and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .predict.simulate_command import add_simulate_parser
from .train.chat_command import add_chat_parser
from .train.command import add_train_parser
from .train.environment import add_env_parser, roundpipe_version
from .train.export import add_export_parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ValueError as error:  # PlanError included
        parser.exit(2, f"roundpipe: error: {error}\n")
    return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roundpipe", description="RoundPipe tools.")
    parser.add_argument("--version", action="version", version=f"roundpipe {roundpipe_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_simulate_parser(commands)
    add_train_parser(commands)
    add_export_parser(commands)
    add_chat_parser(commands)
    add_env_parser(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
