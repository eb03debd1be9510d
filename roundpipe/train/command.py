"""``roundpipe train``: the subcommand's parser and its run, from options to exit code
(0, 2 for bad input before any training, 130 after Ctrl-C). See :data:`DESCRIPTION`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..cluster import PeerFailure
from .options import OPTIONS, UsageError, add_arguments, read_config, resolve

DESCRIPTION = """\
Fine-tune a local Hugging Face causal LM on a JSONL file.

  roundpipe train --model DIR --data FILE.jsonl --output DIR [options]
  roundpipe train --demo [--output DIR]

LoRA by default (--full trains every weight). --output receives the adapter (or the
model) with its tokenizer, run.yaml (the resolved options, usable as --config),
metrics.jsonl, loss.png and checkpoints/step-N; --resume continues from the newest
checkpoint there. Ctrl-C stops after the current step (a second Ctrl-C at once),
writes a checkpoint and exits with code 130. Bad options or inputs exit with code 2
before any training.

Across K machines, one process on each, data parallel (on machine R = 0..K-1):
  torchrun --nnodes K --node-rank R --nproc-per-node 1 --master-addr HOST0
           --master-port 29500 -m roundpipe train --model DIR --data FILE --output DIR
--batch-size is the global batch (each process takes its share of the rows). Rank 0
prints and writes the metrics, the plot and the model; every rank keeps its shard of
each checkpoint in checkpoints/step-N/rank<r>-of-<K> (resumable with the same K).
Ctrl-C on any machine stops every process after the same step (a repeated Ctrl-C too).
A process that fails or is lost stops the others within --dist-timeout (exit code 1).
"""
DEMO_OUTPUT = Path("roundpipe-demo")
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_FAILED = 1


class TrainingFailed(RuntimeError):
    """An error inside training that is not the user's input (so not exit code 2)."""


def add_train_parser(commands: Any) -> argparse.ArgumentParser:
    """Register ``train`` on the ``roundpipe`` command's subparsers."""
    parser = commands.add_parser(
        "train",
        help="fine-tune a Hugging Face causal LM on a JSONL file",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(run=run_train, train_parser=parser)
    return parser


def run_train(args: argparse.Namespace) -> int:
    """The ``train`` subcommand: its exit code (0, 2 for bad input, 130 for Ctrl-C)."""
    keys = {option.key for option in OPTIONS}
    command_line = {k: v for k, v in vars(args).items() if k in keys}
    try:
        return _train(command_line)
    except UsageError as error:
        args.train_parser.exit(EXIT_USAGE, f"roundpipe train: error: {error}\n")
    except KeyboardInterrupt:
        print("roundpipe train: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except PeerFailure as error:  # another process failed, or the network between them
        print(f"roundpipe train: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as error:  # not bad input: keep it from the CLI's exit-2 handler
        raise TrainingFailed(f"training failed: {error}") from error
    return EXIT_USAGE


def _train(command_line: dict[str, Any]) -> int:
    from .preflight import check_packages, prepare
    from .ranks import check_several, from_environment, joined

    check_packages()
    ranks = from_environment()
    config = read_config(command_line["config"]) if command_line.get("config") else {}
    user = {**config, **command_line}
    check_several(ranks, user.get("precision"), bool(user.get("demo")))
    demo = _prepare_demo(user) if user.get("demo") else None
    options = resolve(command_line, config, preset=demo and demo["options"])
    check_several(ranks, options.precision, options.demo)
    with joined(ranks, options.dist_timeout):
        prepared = prepare(options, ranks)

        from .loop import train

        outcome = train(prepared, ranks=ranks)
    if outcome.interrupted:
        return EXIT_INTERRUPTED
    if demo is not None:
        _print_samples(demo["setup"], prepared.options.output)
    return 0


def _prepare_demo(user: dict[str, Any]) -> dict[str, Any]:
    """The ``--demo`` assets in ``<output>/base-model`` and its preset options."""
    clashing = [f"--{name}" for name in ("model", "data") if user.get(name) is not None]
    if clashing:
        raise UsageError(f"--demo brings its own model and data: drop {' and '.join(clashing)}")
    from .demo import prepare_demo
    from .loop import quiet_transformers

    output = Path(user.get("output") or DEMO_OUTPUT)
    try:
        with quiet_transformers():
            setup = prepare_demo(output, seed=user.get("seed", 0))
    except FileExistsError as error:
        raise UsageError(str(error)) from error
    preset = {
        **setup.options,
        "model": setup.model_dir,
        "data": setup.data,
        "eval_data": setup.eval_data,
        "output": output,
    }
    return {"setup": setup, "options": preset}


def _print_samples(setup: Any, trained: Path) -> None:
    from .demo import format_samples, sample_generations
    from .loop import quiet_transformers

    with quiet_transformers():
        samples = sample_generations(setup.model_dir, trained, setup.prompts)
    print("\n" + format_samples(samples), flush=True)
