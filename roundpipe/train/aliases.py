"""Other projects' names for the options of ``roundpipe train``: the names
``transformers``' ``TrainingArguments`` and TRL give options that mean the same here are
accepted, on the command line and in ``--config`` files (those whose values translate,
``--bf16`` or ``--optim``, are :mod:`.trainer_flags`'); a name that means something
else here, or one nobody knows, is refused, with a suggestion only where it is a
spelling of the same option (docs/cli.md#coming-from-trainer--trl)."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Iterable

HF_NAMES: dict[str, str] = {
    "learning_rate": "lr",
    "warmup_steps": "warmup_steps",
    "warmup_ratio": "warmup_ratio",
    "weight_decay": "weight_decay",
    "max_grad_norm": "grad_clip",
    "seed": "seed",
    "output_dir": "output",
    "model_name_or_path": "model",
    "report_to": "report_to",
    "lora_r": "lora_r",
    "lora_alpha": "lora_alpha",
    "lora_dropout": "lora_dropout",
    "lora_target_modules": "lora_targets",
    "dataset_name": "data",
    "dataset_train_split": "data_split",
    "max_length": "seq_len",
    "max_seq_length": "seq_len",
    "save_steps": "save_every",
    "eval_steps": "eval_every",
    "save_total_limit": "keep_checkpoints",
    "loss_type": "loss_type",  # DPOConfig's, as the next ones (KTOConfig's)
    "label_smoothing": "label_smoothing",
    "desirable_weight": "desirable_weight",
    "undesirable_weight": "undesirable_weight",
    "precompute_ref_log_probs": "precompute_ref_log_probs",
}
"""Their name -> our option's key, for options whose meaning is the same."""

OTHER_MEANING: dict[str, str] = {
    "per_device_train_batch_size": "batch_size",
    "gradient_accumulation_steps": "microbatches",
}
"""Their name -> the option of ours nearest to it, which means something else."""

BATCH_NOTE = (
    "--batch-size is the global number of sequences per step (all processes together, "
    "Trainer's per_device_train_batch_size x gradient_accumulation_steps x processes); "
    "--microbatches is how many pieces each process cuts its share of it into, pipeline "
    "microbatches that go through the GPUs one after another, not accumulation steps"
)


def flag(key: str) -> str:
    """``lr`` -> ``--lr``, ``batch_size`` -> ``--batch-size`` (our spelling)."""
    return "--" + key.replace("_", "-")


def aliases_of(key: str) -> list[str]:
    """The other names of our option ``key`` that are other flags than ours
    (``warmup_steps`` for ``--warmup-steps``, not ``seed``)."""
    return [n for n, ours in HF_NAMES.items() if ours == key and n != key.replace("_", "-")]


SAME_SPELLING = 0.85
"""How alike (``difflib``'s ratio, ignoring case, ``-`` and ``_``) an unknown name and a
known one must be for the first to be taken for a misspelling of the second: a typo
(``--learning_rat``, ``--warmup-ratoi``) is, another option of a similar name
(``--save_steps`` and ``--max_steps``, 0.71) is not."""


def hint(name: str, known: Iterable[str], spell: Callable[[str], str]) -> str:
    """What to add to the error for the unknown option ``name`` (without dashes):
    ``" (did you mean X?)"`` where one of ``known`` (spelled by ``spell``) is a spelling
    of it (:data:`SAME_SPELLING`), and for a Trainer batch option how ours differ; ``""``
    otherwise."""
    bare = name.lstrip("-")
    if bare in OTHER_MEANING:
        return (
            f" (did you mean {spell(OTHER_MEANING[bare])}? it means something else: {BATCH_NOTE})"
        )
    by_spelling = {_letters(k): k for k in known}
    close = difflib.get_close_matches(_letters(bare), by_spelling, n=1, cutoff=SAME_SPELLING)
    return f" (did you mean {spell(by_spelling[close[0]])}?)" if close else ""


def _letters(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def refuse_unknown_options(parser: argparse.ArgumentParser, known: Iterable[str]) -> None:
    """Make ``parser`` itself refuse an option it does not know (argparse would leave it
    to the top-level parser's plain "unrecognized arguments"), with :func:`hint` over
    ``known``, the names of its options."""
    known = list(known)
    names = [name.replace("-", "_") for name in known]
    parse_known_args = parser.parse_known_args

    def checked(args=None, namespace=None):
        namespace, extras = parse_known_args(args, namespace)
        for extra in extras:
            if extra.startswith("--"):
                given = extra.split("=", 1)[0]
                key = given[2:].replace("-", "_")
                suggestion = hint(key, names, lambda k: _as_flag(k, known))
                parser.error(f"unknown option {given}{suggestion}")
        return namespace, extras

    parser.parse_known_args = checked  # type: ignore[method-assign]


def _as_flag(name: str, known: Iterable[str]) -> str:
    """``name`` (with underscores) as the flag spelled in ``known``."""
    for spelled in known:
        if spelled.replace("-", "_") == name:
            return "--" + spelled
    return flag(name)


class JoinedNames(argparse.Action):
    """An option of names taking them comma-separated or, as TRL's
    ``--lora_target_modules q_proj v_proj`` and ``--report_to wandb tensorboard``, as
    separate words: stored comma-joined."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, ",".join(values))
