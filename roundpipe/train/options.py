"""The options of ``roundpipe train``: one table for the command line, ``--config`` YAML
files and ``run.yaml``.

Defaults, the ``--demo`` preset, a ``--config`` file (or, resuming, the run's
``run.yaml``) and the command line, each overriding the one before, merged and checked
by :func:`resolve`; Trainer's and TRL's names are translated first
(:func:`roundpipe.train.command_line.given_options`); what needs the model is checked
later (docs/design.md#train-options).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from .config_file import read_options
from .machine import machine_defaults
from .option_checks import (
    FULL_ONLY,
    LORA_ONLY,
    MASTER_WEIGHTS,
    OPTIMIZER_STATES,
    PRECISIONS,
    QUANTIZATIONS,
    SCHEDULES,
    check,
    check_dtypes,
)
from .preference_options import preference_options, record_without
from .trainer_flags import trains_every_weight, translate
from .usage import UsageError

SHAPE_KEYS = ("model", "full", "lora_r", "lora_targets")
"""Options a checkpoint must agree with: they decide which parameters exist."""
STATE_KEYS = ("optimizer_states", "master_weights", "quantize")
"""Options a checkpoint must agree with too: they decide the types of the optimizer's
state and of the weights it loads into (absent from an older record: their defaults)."""
INVOCATION_KEYS = ("config", "demo", "resume", "dist_timeout")
"""Options about how this command was started, not about the run (left out of run.yaml)."""
RUN_YAML = "run.yaml"


def count_or_fraction(text: str) -> int | float:
    """``2`` -> 2, ``0.5`` -> 0.5 (``--epochs``, which may be a fraction as Trainer's)."""
    value = float(text)
    return int(value) if value.is_integer() else value


@dataclass(frozen=True)
class Option:
    """One option: ``--name`` on the command line, ``name`` (or ``name_with_underscores``)
    in YAML. ``parse`` converts a string; ``None`` marks an on/off flag."""

    name: str
    parse: Callable[[str], Any] | None
    default: Any
    help: str
    group: str
    choices: tuple[str, ...] | None = None

    @property
    def key(self) -> str:
        return self.name.replace("-", "_")


_IO, _LORA, _RUN, _LENGTH, _OPTIM, _SAVE = (
    "model and data",
    "what trains",
    "devices and precision",
    "how long, and the batches",
    "optimizer",
    "evaluation, checkpoints and resume",
)

OPTIONS: tuple[Option, ...] = (
    Option(
        "model", str, None, "a Hugging Face model: a local directory or a hub id (org/name)", _IO
    ),
    Option("revision", str, None, "the hub revision of --model: branch, tag or commit", _IO),
    Option(
        "data",
        str,
        None,
        "training data: JSONL, JSON, Parquet or CSV files, a datasets save_to_disk "
        "directory or a hub dataset id; several comma-separated",
        _IO,
    ),
    Option("data-split", str, "train", "the split of a hub or save_to_disk dataset", _IO),
    Option(
        "data-fields",
        str,
        None,
        "columns under other names: prompt=question,completion=answer",
        _IO,
    ),
    Option("output", Path, None, "where the result, checkpoints and metrics go", _IO),
    Option(
        "eval-data",
        str,
        None,
        "held-out data (as --data): its mean token loss is logged (see --eval-every)",
        _IO,
    ),
    Option(
        "eval-split",
        float,
        None,
        "hold out this fraction of --data for evaluation, drawn with --seed",
        _IO,
    ),
    Option(
        "config",
        Path,
        None,
        "a YAML file of these options (flags given here win; with --resume and no --config: "
        "--output's run.yaml)",
        _IO,
    ),
    Option("demo", None, False, "train a tiny model on a built-in chat set (no --model)", _IO),
    Option("full", None, False, "train every weight instead of a LoRA adapter", _LORA),
    Option("lora-r", int, 16, "LoRA rank", _LORA),
    Option("lora-alpha", float, 32.0, "LoRA scaling numerator (scale = alpha / r)", _LORA),
    Option(
        "lora-targets",
        str,
        "all-linear",
        "modules that get adapters: 'all-linear' or a comma list (q_proj,v_proj)",
        _LORA,
    ),
    Option("lora-dropout", float, 0.0, "dropout on the adapters' input", _LORA),
    Option(
        "quantize",
        str,
        "none",
        "keep the frozen base of a LoRA run in 4-bit NF4 (QLoRA), or none",
        _LORA,
        QUANTIZATIONS,
    ),
    Option(
        "train-on-prompt",
        None,
        False,
        "also train on prompts and user turns (default: completions and assistant turns)",
        _LORA,
    ),
    Option(
        "chat-template",
        str,
        None,
        "a Jinja chat template file, or a built-in name: chatml, llama3, qwen3; for a base "
        "model without a template",
        _IO,
    ),
    Option("devices", str, None, "'cuda', 'cuda:0,1', 'emulated:N[@speeds]' (default: cuda)", _RUN),
    Option(
        "precision",
        str,
        None,
        "weights' dtype (default: bf16 on CUDA, fp32 else)",
        _RUN,
        PRECISIONS,
    ),
    Option("sync", None, False, "exact synchronous optimizer steps (default: async)", _RUN),
    Option(
        "memory-check",
        None,
        True,
        "skip the check that the run fits this machine's host memory before loading the model",
        _RUN,
    ),
    Option(
        "microbatches",
        int,
        None,
        "microbatches per step and process (default: devices + 1)",
        _RUN,
    ),
    Option(
        "dist-timeout",
        float,
        600.0,
        "under torchrun: seconds a process waits for the others before it fails",
        _RUN,
    ),
    Option(
        "steps",
        int,
        None,
        "optimizer steps; may be raised on --resume (the LR schedule then spans the new "
        "total; given on --resume, it replaces the run's --epochs)",
        _LENGTH,
    ),
    Option(
        "epochs",
        count_or_fraction,
        None,
        "passes over the data, a fraction too: 0.5 is half an epoch's steps, rounded up "
        "(default 1 without --steps; given on --resume, it replaces the run's --steps)",
        _LENGTH,
    ),
    Option("batch-size", int, 8, "sequences per step", _LENGTH),
    Option("seq-len", int, None, "tokens per sequence (default 1024 or the model's max)", _LENGTH),
    Option("packing", None, False, "pack several examples into each sequence", _LENGTH),
    Option("seed", int, 0, "seed of the data order and the adapters' initialisation", _LENGTH),
    Option("lr", float, 2e-4, "peak learning rate (AdamW)", _OPTIM),
    Option("warmup-steps", int, 0, "steps of linear warm-up from 0 to --lr", _OPTIM),
    Option(
        "warmup-ratio",
        float,
        None,
        "warm up over this fraction of the steps, rounded up (a nonzero --warmup-steps wins)",
        _OPTIM,
    ),
    Option("schedule", str, "cosine", "decay to 0 after warm-up, or constant", _OPTIM, SCHEDULES),
    Option("grad-clip", float, 1.0, "clip the gradients' global norm (0: off)", _OPTIM),
    Option("weight-decay", float, 0.0, "AdamW weight decay (not on biases and norms)", _OPTIM),
    Option(
        "optimizer-states",
        str,
        "fp32",
        "--full: AdamW's moments in fp32, bf16 or int8 (block-wise 8-bit; 8 bytes per "
        "weight, 4, about 2)",
        _OPTIM,
        OPTIMIZER_STATES,
    ),
    Option(
        "master-weights",
        str,
        "fp32",
        "--full: the optimizer updates fp32 copies of the weights, or the bf16 weights "
        "themselves, rounded stochastically (needs --precision bf16; 4 bytes per weight less)",
        _OPTIM,
        MASTER_WEIGHTS,
    ),
    Option("eval-every", int, None, "evaluate every N steps (and at the end)", _SAVE),
    Option("save-every", int, None, "checkpoint every N steps (default: at the end)", _SAVE),
    Option("keep-checkpoints", int, 2, "how many checkpoints/step-N to keep", _SAVE),
    Option(
        "resume",
        None,
        False,
        "continue from the newest checkpoint in --output, or from checkpoint DIR there, "
        "with the options of its run.yaml (a flag given here overrides one)",
        _SAVE,
    ),
    Option(
        "save-dtype",
        str,
        None,
        "dtype of the saved full model (default: the base model's)",
        _SAVE,
        PRECISIONS,
    ),
    Option(
        "report-to",
        str,
        "none",
        "also log the metrics to tensorboard, wandb and/or trackio (comma list), or none",
        _SAVE,
    ),
)
OPTIONS += preference_options(Option)
BY_KEY = {option.key: option for option in OPTIONS}


@dataclass(frozen=True)
class TrainOptions:
    """The options of one run (``None``: not given; :func:`resolve` fills what it can)."""

    model: str | None
    revision: str | None
    data: str | None
    data_split: str
    data_fields: str | None
    output: Path | None
    eval_data: str | None
    eval_split: float | None
    config: Path | None
    demo: bool
    full: bool
    lora_r: int
    lora_alpha: float
    lora_targets: str
    lora_dropout: float
    quantize: str
    train_on_prompt: bool
    chat_template: str | None
    devices: str | None
    precision: str | None
    sync: bool
    memory_check: bool
    microbatches: int | None
    dist_timeout: float
    steps: int | None
    epochs: int | float | None
    batch_size: int
    seq_len: int | None
    packing: bool
    seed: int
    lr: float
    warmup_steps: int
    warmup_ratio: float | None
    schedule: str
    grad_clip: float
    weight_decay: float
    optimizer_states: str
    master_weights: str
    eval_every: int | None
    save_every: int | None
    keep_checkpoints: int
    resume: bool | str  # True: the newest checkpoint; a str: that checkpoint directory
    save_dtype: str | None
    report_to: str
    method: str
    beta: float
    precompute_ref_log_probs: bool
    loss_type: str
    label_smoothing: float
    desirable_weight: float
    undesirable_weight: float

    def lora_target_modules(self) -> str | list[str]:
        """``--lora-targets`` as peft's ``target_modules``."""
        if self.lora_targets == "all-linear":
            return "all-linear"
        return [name.strip() for name in self.lora_targets.split(",") if name.strip()]

    def total_steps(self, steps_per_epoch: int) -> int:
        """The run's optimizer steps: ``--steps``, else ``--epochs`` (default 1) of
        ``steps_per_epoch``, rounded up as Trainer rounds ``num_train_epochs``."""
        if self.steps is not None:
            return self.steps
        return math.ceil((self.epochs or 1) * steps_per_epoch)

    def trackers(self) -> list[str]:
        """``--report-to`` as a list of names (empty for none), each once."""
        names = [name.strip() for name in self.report_to.split(",") if name.strip()]
        return [] if names == ["none"] else list(dict.fromkeys(names))

    def run_record(self) -> dict[str, Any]:
        """The options as plain data (paths as strings), without the invocation's own
        (nor the other mode's: with ``--full`` the LoRA options, without it the full
        optimizer's; nor another method's; ``run.yaml`` must work as ``--config``, which
        refuses them)."""
        record = {k: v for k, v in asdict(self).items() if k not in INVOCATION_KEYS}
        if self.full:
            record = {k: v for k, v in record.items()
                      if not k.startswith("lora_") and k not in LORA_ONLY}  # fmt: skip
        else:
            record = {k: v for k, v in record.items() if k not in FULL_ONLY}
        record = record_without(self, record)
        return {k: str(v) if isinstance(v, Path) else v for k, v in record.items()}


def read_config(path: Path) -> dict[str, Any]:
    """The options of a YAML file by our keys, converted as the command line converts
    them (Trainer's and TRL's names translated)."""
    options = read_options(path, BY_KEY)
    return translate(options, trains_every_weight(options))[0]


def resolve(
    command_line: Mapping[str, Any],
    config: Mapping[str, Any] | None = None,
    preset: Mapping[str, Any] | None = None,
) -> TrainOptions:
    """Merge ``preset`` < ``config`` < ``command_line`` over the defaults, fill the
    machine-dependent defaults and check the result (contradictions count only between
    options the user gave, in ``config`` or ``command_line``)."""
    merged: dict[str, Any] = {}
    given: set[str] = set()
    for layer in (preset or {}, config or {}, command_line):
        values = {k: v for k, v in layer.items() if v is not None}
        for key, other in (("steps", "epochs"), ("epochs", "steps")):
            if key in values and other not in values:  # a layer's length replaces the other
                merged.pop(other, None)
                given.discard(other)
        merged.update(values)
        if layer is not preset:
            given |= set(values)
    unknown = set(merged) - set(BY_KEY)
    if unknown:
        raise UsageError(f"unknown options: {', '.join(sorted(unknown))}")
    options = TrainOptions(
        **{f.name: merged.get(f.name, BY_KEY[f.name].default) for f in fields(TrainOptions)}
    )
    check(options, given)
    devices, precision = machine_defaults(options.devices, options.precision)
    options = replace(options, devices=devices, precision=precision)
    check_dtypes(options)
    return options


def write_run_yaml(options: TrainOptions, path: Path) -> None:
    """``run.yaml``: the resolved options, loadable again with ``--config``."""
    import yaml

    Path(path).write_text(yaml.safe_dump(options.run_record(), sort_keys=False))
