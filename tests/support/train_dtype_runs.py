"""Finished ``roundpipe train`` runs of a bf16-stored tiny Qwen3 on the CPU (fp32), shared
by ``test_train_save_dtype.py`` and ``test_train_export.py`` and built once per session:
``--full`` (the default save dtype), ``--full --save-dtype fp32`` and LoRA, each 4 steps
with checkpoints at steps 2 and 4."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from support.train_cli import COMMON, run_train
from support.train_fixtures import build_model_dir

RUNS = {"full": ("--full",), "full_fp32": ("--full", "--save-dtype", "fp32"), "lora": ()}
_BUILT: dict[str, Path] = {}


def bf16_model_dir(directory: Path) -> Path:
    """The tiny Qwen3 of ``build_model_dir``, stored in bf16."""
    import transformers

    fp32 = build_model_dir(directory.with_name(directory.name + "-fp32"))
    model = transformers.AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    for path in fp32.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(path, directory)
    return directory


def bf16_runs(root: Path, data: Path) -> dict[str, Path]:
    """``{"base": the model, name: output of each run in RUNS}`` (built on first call)."""
    if not _BUILT:
        _BUILT["base"] = bf16_model_dir(root / "bf16-model")
        for name, extra in RUNS.items():
            output = root / f"out-{name}"
            done = run_train("--model", _BUILT["base"], "--data", data, "--output", output, *COMMON,
                             "--steps", "4", "--save-every", "2", "--sync", *extra)  # fmt: skip
            assert done.returncode == 0, done.stderr
            _BUILT[name] = output
    return dict(_BUILT)


def trained_weights(output: Path, step: int) -> dict[str, torch.Tensor]:
    """The weights a run trained with at ``step``: its checkpoint's ``param/`` tensors."""
    import safetensors.torch

    tensors = safetensors.torch.load_file(
        output / "checkpoints" / f"step-{step}" / "weights.safetensors"
    )
    return {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}
