"""Everything ``roundpipe train`` checks about ``--model`` before it is loaded: its files,
its family, every weight file's header against the model (built on the ``meta``
device, no memory), and that ``--lora-targets`` names modules of it; and the LoRA
configuration the check and the run share (docs/design.md#checks-before-training).

Each problem is a :class:`~roundpipe.train.options.UsageError` naming the directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..hf.families import FAMILIES
from ..hf.safetensors_io import INDEX_FILE, SINGLE_FILE, CheckpointError
from .options import TrainOptions, UsageError
from .quiet import quiet_transformers

WEIGHT_FILES = (SINGLE_FILE, INDEX_FILE)  # what roundpipe.from_pretrained loads
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_model(options: TrainOptions) -> Any:
    """Check ``options.model`` (see the module docstring); returns its config."""
    model = options.model
    _check_files(model)
    config = _config(model)
    if config.model_type not in FAMILIES:
        supported = ", ".join(f"{f.name} ({f.model_type})" for f in FAMILIES.values())
        raise UsageError(
            f"--model {model}: model_type {config.model_type!r} is not a family roundpipe "
            f"trains; it trains decoder-only causal LMs of these families: {supported}"
        )
    from ..hf.loading import plan_pretrained

    try:
        with quiet_transformers():
            empty, _ = plan_pretrained(model)
    except (CheckpointError, OSError, ValueError) as error:
        raise UsageError(f"--model {model}: {error}") from error
    if not options.full:
        _check_lora_targets(empty, options)
    return config


def lora_config(options: TrainOptions):
    """The ``peft.LoraConfig`` of ``options`` (None with ``--full``)."""
    if options.full:
        return None
    import peft

    alpha = options.lora_alpha
    return peft.LoraConfig(
        r=options.lora_r,
        lora_alpha=int(alpha) if float(alpha).is_integer() else alpha,
        target_modules=options.lora_target_modules(),
        lora_dropout=options.lora_dropout,
        task_type="CAUSAL_LM",
    )


def _check_files(model: Path) -> None:
    if not model.is_dir():
        raise UsageError(f"--model {model}: no such directory")
    if not (model / "config.json").is_file():
        raise UsageError(f"--model {model}: not a Hugging Face model directory (no config.json)")
    if not any((model / name).is_file() for name in WEIGHT_FILES):
        raise UsageError(
            f"--model {model}: no weights ({', '.join(WEIGHT_FILES)}); the directory has "
            f"{sorted(p.name for p in model.iterdir())} (a .bin checkpoint: convert it with "
            "transformers, from_pretrained then save_pretrained)"
        )
    if not any((model / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(
            f"--model {model}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save it "
            "beside the model with tokenizer.save_pretrained"
        )


def _config(model: Path):
    import transformers

    try:
        with quiet_transformers():
            return transformers.AutoConfig.from_pretrained(model)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"--model {model}: config.json cannot be read: {error}") from error


def _check_lora_targets(empty, options: TrainOptions) -> None:
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
                    f"{flag}: {target!r} names no module of {options.model.name} (its "
                    f"linear layers: {', '.join(_linear_names(empty))})"
                )
    try:
        with quiet_transformers():
            peft.get_peft_model(empty, lora_config(options))
    except (ValueError, TypeError) as error:
        raise UsageError(f"{flag}: {error}") from error


def _linear_names(model) -> list[str]:
    from torch import nn

    found = [name.rpartition(".")[2] for name, m in model.named_modules()
             if isinstance(m, nn.Linear)]  # fmt: skip
    return list(dict.fromkeys(found))
