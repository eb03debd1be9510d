"""Everything ``roundpipe train`` checks and reads before any training: the model
directory, the tokenizer, the data and the number of steps (:func:`prepare`, before
anything is written), then, holding ``--output``, where the run starts
(:func:`find_start`: the checkpoint to resume, or that the run is finished).

Each problem is a :class:`~roundpipe.train.options.UsageError` naming the file or the
option, raised before the model is built (docs/design.md#checks-before-training).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypedDict

from ..errors import install_hint
from .chat_templates import apply_chat_template_option, template_spelling
from .checkpoints import (
    Found,
    check_compatible,
    common_checkpoints,
    named_checkpoint,
    resumable_checkpoints,
    saved_worlds,
)
from .hub import ModelSource, local_spelling, resolve_model
from .images import ImageReader
from .memory_check import check_host_memory
from .model_checks import check_model, model_config
from .options import TrainOptions, UsageError
from .ranks import Ranks
from .report import plot_available
from .result import result_complete

DEFAULT_SEQ_LEN = 1024
REQUIRED_PACKAGES = (
    ("transformers", "transformers"),
    ("peft", "peft"),
    ("tokenizers", "tokenizers"),
    ("yaml", "pyyaml"),
)
"""matplotlib is not among them: without it the run draws no ``loss.png`` and says so."""


@dataclass
class Prepared:
    """A run ready to start: resolved options, tokenizer, data and where it begins."""

    options: TrainOptions  # model as given (a local one absolute), output absolute; seq_len filled
    tokenizer: Any
    train_batches: Any  # roundpipe.train.batches.Batches
    eval_batches: Any | None
    total_steps: int
    notes: list[str]  # what to tell the user before training starts
    source: ModelSource | None = None  # where --model lies: its directory, a hub snapshot
    resume_from: list[Found] = field(default_factory=list)  # newest first; [] if new
    finished: bool = False
    """The newest checkpoint is at the last step and the result is written: nothing to do."""


def check_packages() -> None:
    """The packages ``roundpipe train`` needs besides torch, each named if missing."""
    import importlib.util

    missing = [pip for module, pip in REQUIRED_PACKAGES if importlib.util.find_spec(module) is None]
    if missing:
        raise UsageError(f"roundpipe train needs {', '.join(missing)}: {install_hint('train')}")


def prepare(options: TrainOptions, ranks: Ranks | None = None) -> Prepared:
    """Read and check the run's inputs; see the module docstring. Under ``torchrun``
    every rank checks its own view (data, model) and they agree: a problem on one rank
    stops every rank with exit code 2."""
    ranks = ranks or Ranks()
    return ranks.agree(lambda: _prepare(options, ranks), "the checks before training")


def find_start(prepared: Prepared, ranks: Ranks | None = None) -> Prepared:
    """``prepared`` with where it starts in ``--output`` (held by this run): the
    checkpoints to resume from, and whether the run is finished. Under ``torchrun`` the
    ranks agree on a checkpoint every rank holds a shard of, and rank 0, which writes
    the result, says whether it is complete."""
    ranks = ranks or Ranks()
    prepared = ranks.agree(lambda: _find_start(prepared, ranks), "the checkpoint search")
    if ranks.world > 1 and prepared.resume_from:
        every = ranks.gather(
            [(found.position.step, found.save_id) for found in prepared.resume_from],
            "the checkpoint search",
        )
        prepared.resume_from = ranks.agree(
            lambda: _common_checkpoints(prepared, every), "the choice of the checkpoint"
        )
    at_the_end = bool(prepared.resume_from) and (
        prepared.resume_from[0].position.step == prepared.total_steps
    )
    options = prepared.options
    assert options.output is not None
    complete = ranks.main and at_the_end and result_complete(options.output, options.full)
    return replace(prepared, finished=ranks.gather(complete, "the result's check")[0])


def _prepare(options: TrainOptions, ranks: Ranks) -> Prepared:
    assert options.model is not None and options.output is not None
    model, output = local_spelling(options.model), Path(options.output).absolute()
    options = replace(
        options,
        model=model,
        data=_data_sources(options.data),
        output=output,
        eval_data=None if options.eval_data is None else _data_sources(options.eval_data),
        chat_template=template_spelling(options.chat_template),
    )
    _check_resume(output, options.resume)
    source = resolve_model(model, options.revision)
    config = model_config(options, source)
    max_positions = getattr(config, "max_position_embeddings", None)
    options = replace(options, seq_len=_seq_len(options.seq_len, max_positions))
    if options.memory_check:  # before the model is built, even on the meta device
        check_host_memory(options, config, ranks.world)
    check_model(options, source)
    tokenizer = _tokenizer(source, str(options.model))
    apply_chat_template_option(tokenizer, options.chat_template)
    notes: list[str] = []
    if not plot_available():
        notes.append(f"loss.png is not drawn: matplotlib is not installed ({install_hint('plot')})")
    images = ImageReader(source.directory, config)
    train_batches, eval_batches = _batches(options, tokenizer, notes, images)
    if ranks.world > 1 and getattr(train_batches, "images", None) is not None:
        raise UsageError(
            f"{options.data} has images, which train on one process for now (not under torchrun)"
        )
    total = options.total_steps(train_batches.steps_per_epoch)
    _check_rows(train_batches, total, ranks.world)
    return Prepared(options, tokenizer, train_batches, eval_batches, total, notes, source)


def _check_resume(output: Path, resume: bool | str) -> None:
    """Before the lock on ``output`` creates it."""
    if resume and not output.exists():
        raise UsageError(f"--resume: no checkpoint in {output} (no such directory)")


def _find_start(prepared: Prepared, ranks: Ranks) -> Prepared:
    options, notes = prepared.options, list(prepared.notes)
    assert options.output is not None
    earlier = saved_worlds(options.output)
    if earlier and not options.resume:
        if not options.demo:
            raise UsageError(
                f"--output {options.output} holds checkpoints of an earlier run (step "
                f"{max(earlier)}): continue it with --resume, or choose another --output "
                "(or delete it) to start over"
            )
        notes.append("starting the demo over: the checkpoints of the earlier run are removed")
    resume_from: list[Found] = []
    if isinstance(options.resume, str):  # --resume DIR: that checkpoint, no other
        named = Path(options.resume)
        resume_from = [named_checkpoint(options.output, named, options, ranks.shard)]
        _check_resume_step(resume_from[0], prepared.total_steps)
    elif options.resume:
        resume_from, damaged = resumable_checkpoints(options.output, options, ranks.shard)
        notes += [f"warning: {reason}; resuming from an older checkpoint" for reason in damaged]
        _check_resume_step(resume_from[0], prepared.total_steps)
    return replace(prepared, resume_from=resume_from, notes=notes)


def _check_rows(batches, total: int, world: int) -> None:
    """Under ``torchrun`` every batch must give each process at least one row."""
    if world == 1:
        return
    rows, size = len(batches.rows), batches.batch_size
    last = rows - (batches.steps_per_epoch - 1) * size
    if size < world:
        raise UsageError(
            f"--batch-size {size} with {world} processes: each process takes its share of "
            f"every batch's rows, so a batch needs at least {world}"
        )
    if last < world and total >= batches.steps_per_epoch:
        raise UsageError(
            f"--batch-size {size} with {world} processes: the last batch of each epoch has "
            f"{last} of the {rows} rows, fewer than the {world} a batch needs (one share per "
            "process); choose a batch size that leaves a larger last batch"
        )


def _check_resume_step(found: Found, total: int) -> None:
    done = found.position.step
    if done > total:
        raise UsageError(
            f"--resume: {found.path} is at step {done}, past the {total} steps of this run "
            "(raise --steps)"
        )


def _common_checkpoints(prepared: Prepared, every: list[list[tuple[int, int]]]) -> list[Found]:
    """The checkpoints every rank has a shard of, from the same save, newest first."""
    common = common_checkpoints(prepared.resume_from, every)
    if not common:
        assert prepared.options.output is not None
        newest = ", ".join(f"rank {rank}: step {found[0][0]}" for rank, found in enumerate(every))
        raise UsageError(
            f"--resume: no checkpoint in {prepared.options.output / 'checkpoints'} has a "
            f"shard of the same save on every rank (the newest by rank: {newest})"
        )
    if common[0] is not prepared.resume_from[0]:
        check_compatible(common[0], prepared.options)
        _check_resume_step(common[0], prepared.total_steps)
    return common


def _seq_len(given: int | None, max_positions: int | None) -> int:
    if given is None:
        return min(DEFAULT_SEQ_LEN, max_positions or DEFAULT_SEQ_LEN)
    if max_positions is not None and given > max_positions:
        raise UsageError(
            f"--seq-len {given} exceeds the model's maximum of {max_positions} positions"
        )
    if given < 2:
        raise UsageError(f"--seq-len must be at least 2 (a token and its successor), got {given}")
    return given


def _tokenizer(source: ModelSource, spelling: str):
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(source.directory)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(
            f"{source.describe(spelling)}: the tokenizer cannot be loaded: {error}"
        ) from error


def _data_sources(sources) -> str:
    """``--data`` or ``--eval-data``: each existing local path absolute, hub ids as given."""
    from .sources import DataError, resolve_sources

    try:
        return resolve_sources(sources)
    except DataError as error:
        raise UsageError(str(error)) from error


class _Reading(TypedDict):
    """How ``--data`` and ``--eval-data`` are read (``load_dataset``'s options)."""

    split: str
    fields: str | None
    train_on_prompt: bool
    images: ImageReader | None


def _batches(options: TrainOptions, tokenizer, notes: list[str], images: ImageReader):
    """The training batches and the evaluation's (None without ``--eval-data`` or
    ``--eval-split``); what was truncated or dropped goes to ``notes``, by source."""
    from .batches import Batches
    from .data import DataError, load_dataset, load_held_out, pad_token_id
    from .data_summary import data_summary

    assert options.data is not None and options.seq_len is not None
    if options.method != "sft":
        from .preference_run import preference_batches

        return preference_batches(options, tokenizer, notes, pad_token_id(tokenizer))
    reading: _Reading = {
        "split": options.data_split,
        "fields": options.data_fields,
        "train_on_prompt": options.train_on_prompt,
        "images": images,
    }
    try:
        if options.eval_split is not None:
            train, held_out = load_held_out(
                options.data,
                tokenizer,
                options.seq_len,
                options.eval_split,
                options.seed,
                **reading,
            )
            notes.append(
                f"--eval-split {options.eval_split}: {len(held_out.examples)} examples held out "
                f"for evaluation, {len(train.examples)} to train on (seed {options.seed})"
            )
        else:
            train = load_dataset(options.data, tokenizer, options.seq_len, **reading)
            held_out = None
            if options.eval_data is not None:
                held_out = load_dataset(options.eval_data, tokenizer, options.seq_len, **reading)
    except DataError as error:
        raise UsageError(str(error)) from error
    pad_id = pad_token_id(tokenizer)
    batches: list[Batches | None] = []
    for dataset, packing in ((train, options.packing), (held_out, False)):
        if dataset is None:
            batches.append(None)
            continue
        for counts in dataset.sources:
            total = counts.examples + counts.dropped
            if counts.truncated:
                notes.append(
                    f"{counts.label}: {counts.truncated} of {total} examples truncated to "
                    f"{options.seq_len} tokens"
                )
            if counts.dropped:
                notes.append(
                    f"{counts.label}: {counts.dropped} of {total} examples dropped (no labelled "
                    f"token within {options.seq_len} tokens)"
                )
        try:
            batches.append(Batches(dataset, options.batch_size, options.seed, packing, pad_id))
        except ValueError as error:  # what cannot be batched: packing with images
            raise UsageError(str(error)) from error
        what = "training" if len(batches) == 1 else "evaluation"
        notes.extend(data_summary(dataset, batches[-1], tokenizer, what))
    return tuple(batches)
