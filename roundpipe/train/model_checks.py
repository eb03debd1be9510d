"""Everything ``roundpipe train`` checks about ``--model`` before it is loaded: its files,
that ``roundpipe.hf`` can cut it into layers, every weight file's header against the
model (built on the ``meta`` device, no memory), and that ``--lora-targets`` names
modules of it; and the LoRA configuration the check and the run share
(docs/design.md#checks-before-training).

Each problem is a :class:`~roundpipe.train.options.UsageError` naming ``--model`` (and,
for a hub id, the snapshot it resolved to: :mod:`roundpipe.train.hub`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..hf.safetensors_io import INDEX_FILE, SINGLE_FILE, CheckpointError
from .hub import ModelSource
from .options import TrainOptions, UsageError
from .quiet import quiet_transformers

WEIGHT_FILES = (SINGLE_FILE, INDEX_FILE)  # what roundpipe.from_pretrained loads
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def model_config(options: TrainOptions, source: ModelSource) -> Any:
    """The config of ``--model``, found in ``source``, once its files are checked
    (nothing is built yet)."""
    if options.save_dtype is not None and not options.full:
        raise UsageError(
            f"--save-dtype {options.save_dtype} sets the dtype of a --full model; a LoRA "
            "adapter is saved as peft saves it (to save a merged model in a dtype: "
            "roundpipe export --merge --save-dtype)"
        )
    flag = source.describe(str(options.model))
    _check_files(source.directory, flag, source.hub_id is not None)
    return _config(source.directory, flag)


def check_model(options: TrainOptions, source: ModelSource) -> None:
    """Check ``--model``, found in ``source`` and its config read by
    :func:`model_config`, on the ``meta`` device (see the module docstring)."""
    model, flag = source.directory, source.describe(str(options.model))
    from ..hf.loading import plan_pretrained

    try:
        with quiet_transformers():
            empty, _ = plan_pretrained(model)
    except (CheckpointError, OSError, ValueError) as error:
        raise UsageError(f"{flag}: {error}") from error
    if not options.full:
        _check_lora_targets(empty, options, source.name)
    _check_replayable(empty, flag)


def _check_replayable(empty, flag: str) -> None:
    """A model the general path cannot replay is refused now, not after loading."""
    from ..hf.families import own_adapter
    from ..hf.replay import check_replayable
    from ..hf.structure import text_model

    causal_lm = text_model(empty)
    if own_adapter(causal_lm) is not None:
        return
    try:
        with quiet_transformers():
            check_replayable(causal_lm)  # leaves the empty model unusable: checked last
    except ValueError as error:
        raise UsageError(f"{flag}: {error}") from error


def lora_config(options: TrainOptions):
    """The ``peft.LoraConfig`` of ``options`` (None with ``--full``)."""
    if options.full:
        return None
    import peft

    alpha = options.lora_alpha
    return peft.LoraConfig(
        r=options.lora_r,
        # peft annotates an int; it scales by any number
        lora_alpha=int(alpha) if float(alpha).is_integer() else alpha,  # type: ignore[arg-type]
        target_modules=options.lora_target_modules(),
        lora_dropout=options.lora_dropout,
        task_type="CAUSAL_LM",
    )


def _check_files(model: Path, flag: str, from_hub: bool) -> None:
    if not model.is_dir():
        raise UsageError(f"{flag}: no such directory")
    if not (model / "config.json").is_file():
        raise UsageError(f"{flag}: not a Hugging Face model directory (no config.json)")
    if not any((model / name).is_file() for name in WEIGHT_FILES):
        if from_hub:
            raise UsageError(
                f"{flag}: no safetensors weights ({', '.join(WEIGHT_FILES)}) in the "
                "repository (or not in the cache while HF_HUB_OFFLINE is set); roundpipe "
                "loads safetensors only: convert a .bin checkpoint with transformers "
                "(from_pretrained then save_pretrained) and pass that directory"
            )
        raise UsageError(
            f"{flag}: no weights ({', '.join(WEIGHT_FILES)}); the directory has "
            f"{sorted(p.name for p in model.iterdir())} (a .bin checkpoint: convert it with "
            "transformers, from_pretrained then save_pretrained)"
        )
    if not any((model / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(
            f"{flag}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save it "
            "beside the model with tokenizer.save_pretrained"
        )


def _config(model: Path, flag: str):
    import transformers

    try:
        with quiet_transformers():
            return transformers.AutoConfig.from_pretrained(model)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"{flag}: config.json cannot be read: {error}") from error


def _check_lora_targets(empty, options: TrainOptions, model_name: str) -> None:
    """Every name in ``--lora-targets`` must name a module (peft ignores those that name
    none as long as one does), and peft must accept the modules named."""
    import peft

    targets = options.lora_target_modules()
    flag = f"--lora-targets {options.lora_targets!r}"
    if targets != "all-linear":
        names = [name for name, _ in empty.named_modules()]
        for target in targets:  # peft's rule for a list: the name, or its last parts
            if not any(name == target or name.endswith(f".{target}") for name in names):
                raise UsageError(
                    f"{flag}: {target!r} names no module of {model_name} (its "
                    f"linear layers: {', '.join(_linear_names(empty))})"
                )
    from ..hf.structure import adapted_head_refusal, text_model

    try:
        with quiet_transformers():
            wrapped = peft.get_peft_model(empty, lora_config(options))
    except (ValueError, TypeError) as error:
        raise UsageError(f"{flag}: {error}") from error
    refusal = adapted_head_refusal(text_model(wrapped.get_base_model()))
    if refusal is not None:
        raise UsageError(f"{flag}: {refusal}")


def _linear_names(model) -> list[str]:
    from torch import nn

    found = [name.rpartition(".")[2] for name, m in model.named_modules()
             if isinstance(m, nn.Linear)]  # fmt: skip
    return list(dict.fromkeys(found))
