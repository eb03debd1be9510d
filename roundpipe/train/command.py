"""``roundpipe train``: the subcommand's parser and its run, from options to exit code
(0; 2 for bad input before any training; 128 + the signal's number after a stop
signal, 130 for Ctrl-C; 1 when the disk is full, the host memory runs out or another
process failed). See :data:`DESCRIPTION`."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

from ..cluster import PeerFailure
from ..errors import MixedPoolDropoutError, one_line_usage_errors
from ..hf.safetensors_io import CheckpointError
from ..preference import NonFiniteStep
from .command_line import add_arguments, command_line_of, given_options
from .disk import NoSpace
from .memory_check import OutOfHostMemory
from .options import UsageError, resolve

DESCRIPTION = """\
Fine-tune a Hugging Face causal LM (a local directory or a hub id) on your data
(JSONL, JSON, Parquet or CSV files, a datasets directory or a hub dataset id).

  roundpipe train --model DIR|ORG/NAME --data SOURCES --output DIR [options]
  roundpipe train --demo [--output DIR]

LoRA by default (--full trains every weight). --output receives the adapter (or the
model) with its tokenizer, run.yaml (the resolved options, usable as --config),
metrics.jsonl, loss.png and checkpoints/step-N; --output DIR --resume continues from
the newest checkpoint there with the options of its run.yaml (a flag given overrides
one: --steps N or --epochs E to train further; a finished run: nothing to do),
--resume DIR from that checkpoint; roundpipe export turns a checkpoint into a model or
adapter. Trainer's and TRL's names are accepted too (--learning_rate, --bf16,
--use_peft, --max_steps, ...: see the last group below). Ctrl-C, SIGTERM and SIGHUP stop
after the current step (a second Ctrl-C at once), write a checkpoint and exit with code
128 + the signal's number (130 for Ctrl-C). One run at a time writes an --output (a
second exits with code 2). Bad options or inputs exit with code 2 before anything is
written; a full disk exits with code 1.

Across K machines, one process on each, data parallel (on machine R = 0..K-1):
  torchrun --nnodes K --node-rank R --nproc-per-node 1 --master-addr HOST0
           --master-port 29500 -m roundpipe train --model DIR --data FILE --output DIR
--batch-size is the global batch (each process takes its share of the rows). Rank 0
prints and writes the metrics, the plot and the model; every rank keeps its shard of
each checkpoint in checkpoints/step-N/rank<r>-of-<K> (resumable with the same K).
A stop signal on any machine stops every process after the same step (a repeated one
too).
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
        help="fine-tune a Hugging Face causal LM (LoRA or full) on your data",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_arguments(parser)
    one_line_usage_errors(parser)
    parser.set_defaults(run=run_train, train_parser=parser)
    return parser


def run_train(args: argparse.Namespace) -> int:
    """The ``train`` subcommand: its exit code (see the module docstring)."""
    try:
        return _train(command_line_of(args))
    except (UsageError, CheckpointError) as error:  # bad input; a weight found while loading
        args.train_parser.exit(EXIT_USAGE, f"roundpipe train: error: {error}\n")
    except MixedPoolDropoutError as error:  # dropout the pool's kinds of card cannot recompute
        hint = "here: --lora-dropout 0 and a model config without dropout, or --devices of one kind"
        args.train_parser.exit(EXIT_USAGE, f"roundpipe train: error: {error} ({hint})\n")
    except KeyboardInterrupt:
        print("roundpipe train: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (PeerFailure, NoSpace, OutOfHostMemory, NonFiniteStep) as error:  # or a NaN loss
        print(f"roundpipe train: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as error:  # not bad input: keep it from the CLI's exit-2 handler
        raise TrainingFailed(f"training failed: {error}") from error
    return EXIT_USAGE


def _train(command_line: dict[str, Any]) -> int:
    from .lock import holding
    from .preflight import check_packages, find_start, prepare
    from .quiet import quiet_imports
    from .ranks import check_several, from_environment, joined

    check_packages()
    quiet_imports()
    ranks = from_environment()
    given = given_options(command_line)
    config, command_line = given.config, given.command_line
    user = {**config, **command_line}
    check_several(ranks, user.get("precision"), bool(user.get("demo")))
    with contextlib.ExitStack() as held:
        demo = None
        if user.get("demo"):  # its assets go into --output: held before they are written
            output = _demo_output(user)
            held.enter_context(holding(output))
            demo = _prepare_demo(user, output)
        options = resolve(command_line, config, preset=demo and demo["options"])
        check_several(ranks, options.precision, options.demo)
        with joined(ranks, options.dist_timeout):
            prepared = prepare(options, ranks)  # nothing written before it passed
            prepared.notes[:0] = given.notes
            assert prepared.options.output is not None
            if demo is None:
                held.enter_context(holding(prepared.options.output, ranks))
            prepared = find_start(prepared, ranks)
            if prepared.finished:
                _print_finished(prepared, ranks.main)
                return 0

            from .loop import train

            outcome = train(prepared, ranks=ranks)
    if outcome.stop_signal:
        return 128 + outcome.stop_signal
    if demo is not None:
        assert prepared.options.output is not None
        _print_samples(demo["setup"], prepared.options.output)
    return 0


def _print_finished(prepared: Any, main: bool) -> None:
    from .result import result_name

    if not main:
        return
    found, o = prepared.resume_from[0], prepared.options
    by_epochs = o.steps is None and o.epochs is not None
    span = f"{o.epochs:g} epochs ({prepared.total_steps} steps)" if by_epochs else None
    print(
        f"{o.output} is finished: all {span or f'{prepared.total_steps} steps'} are done "
        f"({found.path.name}) and the {result_name(o.full)} is written; nothing to do "
        f"(raise {'--epochs' if by_epochs else '--steps'} to train further)",
        flush=True,
    )


def _demo_output(user: dict[str, Any]) -> Path:
    clashing = [f"--{name}" for name in ("model", "data") if user.get(name) is not None]
    if clashing:
        raise UsageError(f"--demo brings its own model and data: drop {' and '.join(clashing)}")
    return Path(user.get("output") or DEMO_OUTPUT)


def _prepare_demo(user: dict[str, Any], output: Path) -> dict[str, Any]:
    """The ``--demo`` assets in ``<output>/base-model`` and its preset options."""
    from .demo import prepare_demo
    from .quiet import quiet_transformers

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
    from .quiet import quiet_transformers

    with quiet_transformers():
        samples = sample_generations(setup.model_dir, trained, setup.prompts)
    print("\n" + format_samples(samples), flush=True)
