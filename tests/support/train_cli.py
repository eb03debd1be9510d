"""Running ``roundpipe train`` as a real process, and reading what a run wrote.

:func:`write_train_files` and :func:`finish_train_runs` build the inputs and the
finished runs the ``train_files`` and ``train_runs`` fixtures in ``conftest.py`` share,
once per session, between ``test_train_cli.py``, ``test_train_resume.py`` and
``test_train_errors.py``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from support.train_fixtures import build_model_dir, write_data

REPO = Path(__file__).resolve().parent.parent.parent
COMMON = ("--seq-len", "32", "--batch-size", "8", "--devices", "emulated:2", "--lr", "1e-2")
RUN_LIMIT_S = 180


def train_process(*args, env: dict | None = None, wrap=(), **popen) -> subprocess.Popen:
    """``roundpipe train *args`` in a new process (started through the command ``wrap``
    if given)."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    command = [*map(str, wrap), sys.executable, "-m", "roundpipe", "train", *map(str, args)]
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    return subprocess.Popen(command, text=True, env=environment, cwd=REPO, **{**streams, **popen})


def run_train(*args, env: dict | None = None, wrap=()) -> subprocess.CompletedProcess:
    process = train_process(*args, env=env, wrap=wrap)
    out, err = process.communicate(timeout=RUN_LIMIT_S)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def checkpoint_steps(output: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (output / "checkpoints").glob("step-*"))


def reference_schedule(step: int, warmup: int, total: int, peak: float) -> float:
    """Linear warm-up from 0 (Trainer's: peak * step / warmup), then a cosine decay that
    reaches 0 at total."""
    if step < warmup:
        return peak * step / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def write_train_files(root: Path) -> dict[str, Path]:
    """Under ``root``: a tiny model, data in each format, and eval data; -> their paths."""
    found = {"root": root, "model": build_model_dir(root / "model")}
    for data_format in ("text", "prompt_completion", "messages"):
        found[data_format] = write_data(root / f"{data_format}.jsonl", data_format)
    found["eval"] = write_data(root / "eval.jsonl", "prompt_completion", lines=12, seed=1)
    return found


def finish_train_runs(files: dict[str, Path]) -> dict[str, Path]:
    """One finished 10-step run per data format, each exercising other options; -> the
    output directory of each. Tests read these; none may change them."""
    root, model = files["root"], files["model"]
    config = root / "text.yaml"
    config.write_text(
        "warmup-steps: 1\nlr: 5.0e-3\nschedule: linear\nweight_decay: 0.1\nsave_every: 3\n"
    )
    plan = {
        # full fine-tune, options from YAML (lr overridden here), a torchrun of one process
        "text": (["--full", "--config", config, "--lr", "1e-2"], {"WORLD_SIZE": "1", "RANK": "0"}),
        # LoRA with exact steps, warm-up, clipping, evaluation and a checkpoint half-way
        "prompt_completion": (
            ["--sync", "--warmup-steps", "2", "--grad-clip", "0.5", "--eval-data", files["eval"],
             "--eval-every", "5", "--lora-r", "4", "--lora-targets", "q_proj,v_proj,down_proj",
             "--save-every", "5"],
            None,
        ),
        # LoRA with asynchronous steps on packed sequences
        "messages": (["--packing"], None),
    }  # fmt: skip
    outputs = {}
    for name, (extra, env) in plan.items():
        output = root / f"out-{name}"
        done = run_train(
            "--model", model, "--data", files[name], "--output", output, *COMMON, "--steps",
            "10", *extra, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        outputs[name] = output
    return outputs
