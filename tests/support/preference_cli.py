"""``roundpipe train --method dpo|kto`` and TRL 1.16's ``DPOTrainer``/``KTOTrainer``
configured alike, each trained to the end on the same tiny model directory and records.

A :class:`Case` holds TRL's settings (``DPOConfig``/``KTOConfig`` names); our command
line is made from them through :data:`FLAGS`, so the two sides cannot drift apart.
Every step sees the same examples on both sides: ``--batch-size`` (TRL's
``per_device_train_batch_size``) is the number of training records, one batch per
epoch, and a loss that is a mean over the batch does not depend on the order of its
rows (TRL draws its own; KTO's KL rows are formed in dataset order on both sides).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from support.train_cli import run_train

FLAGS = {
    "learning_rate": "--lr",
    "lr_scheduler_type": "--schedule",
    "max_steps": "--steps",
    "per_device_train_batch_size": "--batch-size",
    "max_length": "--seq-len",
    "max_grad_norm": "--grad-clip",
    "weight_decay": "--weight-decay",
    "warmup_steps": "--warmup-steps",
    "seed": "--seed",
    "beta": "--beta",
    "loss_type": "--loss-type",
    "desirable_weight": "--desirable-weight",
    "undesirable_weight": "--undesirable-weight",
}
"""TRL's setting -> our flag for the same thing."""
COMMON = {"max_length": 32, "max_grad_norm": 1.0, "weight_decay": 0.0, "warmup_steps": 0,
          "seed": 0}  # fmt: skip
"""The settings every case shares: fp32 throughout, clipping at 1, no decay, no warm-up."""
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear"}
"""A LoRA case's adapters: ``--lora-r 4 --lora-alpha 8 --lora-dropout 0`` and our
default ``--lora-targets all-linear``; peft's names."""
RESULT = {True: "adapter_model.safetensors", False: "model.safetensors"}
"""The weights a run writes into ``--output``: a LoRA run's adapter, a full one's model."""


@dataclass(frozen=True)
class Case:
    """One training run, TRL's settings and ours alike. ``eval_split``: our
    ``--eval-split``, whose held-out records TRL evaluates (:func:`held_out`) and
    leaves out of training; ``save_every``: our checkpoints (TRL saves none)."""

    method: str  # "dpo" | "kto"
    records: list[dict]
    lora: bool
    settings: dict
    eval_split: float | None = None
    save_every: int | None = None

    @property
    def trained(self) -> list[dict]:
        """The records both sides train on, in order."""
        held = set(held_out(len(self.records), self.eval_split, COMMON["seed"]))
        return [record for i, record in enumerate(self.records) if i not in held]

    @property
    def evaluated(self) -> list[dict]:
        """The held-out records, in order."""
        held = held_out(len(self.records), self.eval_split, COMMON["seed"])
        return [self.records[i] for i in held]

    @property
    def trl_settings(self) -> dict:
        """The ``DPOConfig``/``KTOConfig`` fields of this run."""
        return {**COMMON, "per_device_train_batch_size": len(self.trained), **self.settings}

    def flags(self) -> list[str]:
        """Our command line for the run but ``--model``, ``--data`` and ``--output``."""
        args = ["--method", self.method, "--sync", "--devices", "emulated:2",
                "--precision", "fp32"]  # fmt: skip
        for key, value in self.trl_settings.items():
            args += [FLAGS[key], str(value)]
        if self.lora:
            args += ["--lora-r", str(LORA["r"]), "--lora-alpha", str(LORA["lora_alpha"]),
                     "--lora-dropout", str(LORA["lora_dropout"])]  # fmt: skip
        else:
            args.append("--full")
        if self.eval_split is not None:
            args += ["--eval-split", str(self.eval_split)]
        if self.save_every is not None:
            args += ["--save-every", str(self.save_every)]
        return args


def held_out(count: int, fraction: float | None, seed: int) -> list[int]:
    """The records ``--eval-split fraction`` holds out of ``count``, by the rule of
    :func:`roundpipe.train.preference_data.load_preference_held_out`: the first
    ``round(fraction * count)`` of a ``torch.randperm`` drawn with ``seed``."""
    if fraction is None:
        return []
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[: round(fraction * count)])


def write_records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def train_ours(case: Case, model: Path, data: Path, output: Path) -> subprocess.CompletedProcess:
    """``roundpipe train`` of ``case`` in a process; it must succeed."""
    done = run_train("--model", model, "--data", data, "--output", output, *case.flags())
    assert done.returncode == 0, done.stderr
    return done


@dataclass(frozen=True)
class TrlRun:
    """What TRL's trainer logged (one dict per step), its trained weights (named as
    ours saves them) and ``trainer.evaluate()`` of the held-out records (or ``{}``)."""

    rows: list[dict]
    weights: dict[str, torch.Tensor]
    evaluated: dict[str, float]


def train_trl(case: Case, model: Path, directory: Path) -> TrlRun:
    """TRL's trainer of ``case`` built from the model directory itself (a full run's
    reference loaded from it too, a LoRA run's: its adapters off), ``train()``, and
    ``evaluate()`` on the held-out records."""
    import datasets
    import peft
    import trl

    config_class = trl.DPOConfig if case.method == "dpo" else trl.KTOConfig
    trainer_class = trl.DPOTrainer if case.method == "dpo" else trl.KTOTrainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = config_class(
            output_dir=str(directory), report_to=[], use_cpu=True, bf16=False, logging_steps=1,
            save_strategy="no", disable_tqdm=True, **case.trl_settings,
        )  # fmt: skip
        lora = peft.LoraConfig(**LORA, task_type="CAUSAL_LM") if case.lora else None
        trainer = trainer_class(
            model=str(model), args=args, peft_config=lora,
            train_dataset=datasets.Dataset.from_list(case.trained),
        )  # fmt: skip
        trainer.train()
        evaluated = {}
        if case.evaluated:
            evaluated = trainer.evaluate(datasets.Dataset.from_list(case.evaluated))
    rows = [row for row in trainer.state.log_history if "loss" in row]
    if case.lora:
        weights = peft.get_peft_model_state_dict(trainer.model)
    else:
        weights = trainer.model.state_dict()
    return TrlRun(rows, {k: v.detach().clone() for k, v in weights.items()}, evaluated)


def saved_weights(output: Path, lora: bool) -> dict[str, torch.Tensor]:
    """The adapter or model a run saved in ``output``."""
    from safetensors.torch import load_file

    return load_file(str(output / RESULT[lora]))


def assert_weights_match(
    ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], lr: float
) -> tuple[float, float]:
    """All weights together equal to 1e-4 relative (the norm of the difference), and
    each within a hundredth of one AdamW step (``lr / 100``). Not each to 1e-4: AdamW
    moves a weight by about ``lr`` a step whatever the size of its gradient, so where a
    gradient is near ``eps`` or its moments nearly cancel, the gradients' rounding (1e-7
    relative) moves that weight's step by a small fraction of ``lr`` (two TRL runs of
    the same batch, its rows in another order, differ by 1e-5 at lr 1e-2). Returns the
    largest difference and the relative one."""
    assert ours.keys() == theirs.keys(), sorted(ours.keys() ^ theirs.keys())
    worst, squared, size = 0.0, 0.0, 0.0
    for name, weight in theirs.items():
        torch.testing.assert_close(ours[name], weight, rtol=0.0, atol=lr / 100, msg=name)
        difference = (ours[name] - weight).double()
        worst = max(worst, difference.abs().max().item())
        squared += difference.square().sum().item()
        size += weight.double().square().sum().item()
    relative = (squared / size) ** 0.5
    assert relative <= 1e-4, f"the weights differ by {relative:.3g} of their norm"
    return worst, relative


def crashed_copy(output: Path, into: Path, after: int, lora: bool) -> Path:
    """``output`` as a crash right after the checkpoint of step ``after`` would have
    left it: the later checkpoints and the result lost, the metrics lines written."""
    shutil.copytree(output, into)
    for checkpoint in (into / "checkpoints").glob("step-*"):
        if int(checkpoint.name.split("-")[1]) > after:
            shutil.rmtree(checkpoint)
    (into / RESULT[lora]).unlink()
    return into
