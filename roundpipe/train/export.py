"""``roundpipe export``: a ``checkpoints/step-N`` of ``roundpipe train`` as what the run
would have written at that step, a ``transformers`` model (``--full``) or a peft
adapter, with the tokenizer; ``--merge`` folds an adapter into the base model
(``merge_and_unload``), saved in the base model's dtype (docs/design.md#export).

The checkpoint's own record of the run's options (the ``run.yaml`` of the run when it
was saved) names the model and the adapter. The weights are the checkpoint's
``param/`` tensors, those the model trained with, as ``roundpipe train`` saves its
result; a sharded checkpoint holds all of them in every rank's shard.
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ..errors import error_chain, one_line_usage_errors
from .disk import disk_full, free_space
from .options import OPTIONS, PRECISIONS, TrainOptions, UsageError

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

DESCRIPTION = """\
Turn a checkpoint of roundpipe train into a transformers model or a peft adapter.

  roundpipe export --checkpoint RUN/checkpoints/step-N --output DIR [--merge]

A --full run's checkpoint gives the model, in the base model's dtype (or
--save-dtype); a LoRA run's gives the adapter, as peft saves it, or with --merge the
base model with the adapter merged in (in the base model's dtype, or --save-dtype).
The tokenizer is saved beside it. --output must not exist or be empty.
"""
EXIT_USAGE = 2


def add_export_parser(commands: Any) -> argparse.ArgumentParser:
    """Register ``export`` on the ``roundpipe`` command's subparsers."""
    parser = commands.add_parser(
        "export",
        help="a checkpoint of roundpipe train as a transformers model or peft adapter",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    one_line_usage_errors(parser)
    parser.add_argument("--checkpoint", type=Path, required=True, metavar="DIR",
                        help="a checkpoints/step-N directory of a roundpipe train run, or "
                        "the run's --output (its newest checkpoint)")  # fmt: skip
    parser.add_argument("--output", type=Path, required=True, metavar="DIR",
                        help="where the model or adapter goes (new or empty)")  # fmt: skip
    parser.add_argument("--merge", action="store_true",
                        help="fold a LoRA adapter into the base (merge_and_unload)")  # fmt: skip
    parser.add_argument("--save-dtype", choices=PRECISIONS, default=None,
                        help="dtype of the saved model (default: the base model's)")  # fmt: skip
    parser.set_defaults(run=run_export, export_parser=parser)
    return parser


def run_export(args: argparse.Namespace) -> int:
    """The ``export`` subcommand: 0, or 2 for bad input (nothing written)."""
    from .quiet import quiet_imports

    quiet_imports()
    try:
        checkpoint = _newest_if_run(args.checkpoint)
        written = export(checkpoint, args.output, args.merge, args.save_dtype)
    except UsageError as error:
        args.export_parser.exit(EXIT_USAGE, f"roundpipe export: error: {error}\n")
    except KeyboardInterrupt:
        print(f"roundpipe export: interrupted; nothing was written to {args.output}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 130
    except Exception as error:  # noqa: BLE001 - the failures of writing, each one line
        why = _write_failure(error, Path(args.output))
        if why is None:
            raise
        print(f"roundpipe export: error: {why}", file=sys.stderr, flush=True)
        return 1
    print(f"wrote the {written} to {args.output}", flush=True)
    return 0


def _write_failure(error: BaseException, output: Path) -> str | None:
    """The line for an export that failed to write ``output`` (nothing of it is left):
    a full disk or quota, the file-size limit (``ulimit -f``), or another export that
    wrote ``output`` meanwhile; ``None`` for any other error."""
    if disk_full(error):
        return (
            f"no space left to write {output} ({free_space(output)} free there); nothing "
            "was written: free some space and export again"
        )
    for each in error_chain(error):
        if isinstance(each, OSError) and each.errno == errno.EFBIG or "os error 27" in str(each):
            return (
                f"a file of {output} would exceed the file-size limit (ulimit -f); nothing "
                "was written: raise the limit and export again"
            )
        if isinstance(each, OSError) and each.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return (
                f"{output} was written by another export meanwhile; this one kept nothing "
                "(export to another --output, or one at a time)"
            )
    return None


def _newest_if_run(checkpoint: Path) -> Path:
    """``--checkpoint``: a checkpoint, or a run's ``--output``, which gives its newest
    (said on the screen)."""
    from .checkpoints import newest_of_run

    found = newest_of_run(checkpoint)
    if found is None:
        return checkpoint
    newest, finished = found
    then = "; the run finished there: the weights it saved in it" if finished else ""
    print(f"exporting {newest}, the newest checkpoint of {checkpoint}{then}", flush=True)
    return newest


def export(checkpoint: Path, output: Path, merge: bool = False, dtype_name: str | None = None):
    """Write checkpoint ``checkpoint`` into ``output`` (see the module docstring);
    returns what was written ("model", "LoRA adapter", "merged model")."""
    from .hub import resolve_model
    from .result import save_result

    checkpoint, output = Path(checkpoint).absolute(), Path(output).absolute()
    _check_output(output)
    options, where = read_run_checkpoint(checkpoint)
    if merge and options.full:
        raise UsageError(
            f"--merge: {checkpoint} is a checkpoint of a --full run (the whole model): "
            "there is no adapter to merge; export it without --merge"
        )
    assert options.model is not None
    source = resolve_model(options.model, options.revision)
    dtype = _save_dtype(options, source.directory, merge, dtype_name)
    model = trained_model(source.directory, options, trained_weights(where), merge)
    tokenizer = run_tokenizer(source.directory, options)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.export-", dir=output.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # as a directory made by mkdir (mkdtemp's is private)
    try:
        save_result(model, tokenizer, staging, True, dtype)
        os.replace(staging, output)  # all or nothing: an empty output is replaced
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if merge:
        return "merged model"
    return "model" if options.full else "LoRA adapter"


def _save_dtype(options: TrainOptions, base: Path, merge: bool, name: str | None):
    """The dtype of the saved model: ``--save-dtype``, else (merged) the base model's
    or (``--full``) the run's; ``None`` for an adapter, which peft saves as it is."""
    from .result import DTYPES, save_dtype, stored_dtype

    if name is not None and not (merge or options.full):
        raise UsageError(
            f"--save-dtype {name} sets the dtype of a model; a LoRA adapter is saved as "
            "peft saves it (add --merge for a merged model in that dtype)"
        )
    if name is not None:
        return DTYPES[name]
    return stored_dtype(base) if merge else save_dtype(options, base)


def _check_output(output: Path) -> None:
    """``output`` must be new or an empty directory: nothing is overwritten."""
    if output.exists() and not output.is_dir():
        raise UsageError(f"--output {output}: exists and is not a directory")
    if output.is_dir() and any(output.iterdir()):
        raise UsageError(f"--output {output}: exists and is not empty (choose a new directory)")


def read_run_checkpoint(checkpoint: Path) -> tuple[TrainOptions, Path]:
    """The options of the run that saved ``checkpoint`` and the directory of its files
    (``roundpipe export`` and ``roundpipe chat --checkpoint``)."""
    from .checkpoints import read_checkpoint

    try:
        found, where = read_checkpoint(checkpoint)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(
            f"--checkpoint {checkpoint}: not a readable checkpoint ({error})"
        ) from error
    return _run_options(found.options, checkpoint), where


def _run_options(record: dict, checkpoint: Path) -> TrainOptions:
    """The run's options from the checkpoint's record, over the defaults (no checks: the
    run checked them, and its devices need not exist here)."""
    values = {option.key: option.default for option in OPTIONS}
    values.update(record)
    try:
        return TrainOptions(**{f.name: values[f.name] for f in fields(TrainOptions)})
    except KeyError as error:
        raise UsageError(
            f"--checkpoint {checkpoint}: its record of the run's options lacks {error}"
        ) from error


def trained_weights(where: Path) -> dict:
    """The checkpoint's trained parameters by name: its ``param/`` tensors."""
    import safetensors.torch

    tensors = safetensors.torch.load_file(str(where / "weights.safetensors"))
    return {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}


def trained_model(directory: Path, options: TrainOptions, weights: dict, merge: bool):
    """The model to save: the base with the trained weights put in (``--full``), the
    peft model of its adapter, or the base with the adapter merged."""
    from .model_checks import lora_config
    from .quiet import quiet_transformers

    model: PreTrainedModel
    with quiet_transformers():
        if options.full or merge:
            import transformers

            from .result import stored_dtype

            # a model as trained (its weights replaced next); merged in the base's dtype
            dtype = next(iter(weights.values())).dtype if options.full else stored_dtype(directory)
            model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        else:  # the adapter alone: the base stays on the meta device, never read
            from ..hf.loading import plan_pretrained

            model, _ = plan_pretrained(directory)
        if not options.full:
            import peft

            model = peft.get_peft_model(model, lora_config(options))
        _put(model, weights, directory)
        if options.full:
            model.tie_weights()  # a tied weight was put in under its first name only
        if merge:  # a LoRA run's (export refuses --merge of a --full one): the peft model
            model = cast("PeftModel", model).merge_and_unload()
    return model


def _put(model, weights: dict, directory: Path) -> None:
    """Replace each trained parameter of ``model`` by the checkpoint's tensor; every one
    must be there and fit."""
    import torch

    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    missing, stray = sorted(trainable - set(weights)), sorted(set(weights) - trainable)
    if missing or stray:
        raise UsageError(
            f"the checkpoint does not fit the model {directory} with the run's options "
            f"(missing {missing[:3]}, not in the model {stray[:3]})"
        )
    for name, tensor in weights.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        old = getattr(module, leaf)
        if tuple(old.shape) != tuple(tensor.shape):
            raise UsageError(f"the checkpoint's {name} has shape {tuple(tensor.shape)}, "
                             f"the model's {tuple(old.shape)}")  # fmt: skip
        setattr(module, leaf, torch.nn.Parameter(tensor, requires_grad=old.requires_grad))


def run_tokenizer(directory: Path, options: TrainOptions):
    """The tokenizer as the run used it: the base's, with the run's ``--chat-template``."""
    import transformers

    from .chat_templates import apply_chat_template_option

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    apply_chat_template_option(tokenizer, options.chat_template)
    return tokenizer
