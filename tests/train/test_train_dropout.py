"""``roundpipe train`` trains in train mode, as ``Trainer`` does: the model config's
dropout (Qwen3's ``attention_dropout``) and ``--lora-dropout`` are active; evaluation
runs in eval mode. With dropout, the same options and seed give the same run bit for
bit on emulated devices, and a ``--sync`` run resumed from a checkpoint equals the
uninterrupted one (docs/design.md#random-numbers).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch  # noqa: E402
from support.train_cli import COMMON, metrics, run_train  # noqa: E402
from support.train_fixtures import build_model_dir, write_data  # noqa: E402

STEPS = ("--steps", "6", "--sync", "--save-every", "3", "--eval-every", "3")
ADAPTER = "adapter_model.safetensors"


def model_with_dropout(directory: Path, attention_dropout: float) -> Path:
    build_model_dir(directory)
    config = json.loads((directory / "config.json").read_text())
    config["attention_dropout"] = attention_dropout
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def without_timings(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")} for r in records]


@pytest.fixture(scope="module")
def dropout_runs(tmp_path_factory) -> dict[str, Path]:
    """Two runs with dropout from the same options and seed, one without."""
    root = tmp_path_factory.mktemp("dropout")
    data = write_data(root / "data.jsonl", "prompt_completion")
    evaluation = write_data(root / "eval.jsonl", "prompt_completion", lines=12, seed=1)
    models = {
        "model-on": model_with_dropout(root / "model-on", 0.3),
        "model-off": model_with_dropout(root / "model-off", 0.0),
    }
    outputs = {}
    for name, model, lora_dropout in (
        ("a", "model-on", "0.2"),
        ("b", "model-on", "0.2"),
        ("off", "model-off", "0.2"),
    ):
        output = root / f"out-{name}"
        done = run_train(
            "--model", models[model], "--data", data, "--eval-data", evaluation, "--output",
            output, *COMMON, *STEPS, "--lora-dropout", lora_dropout,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        outputs[name] = output
    outputs.update(models, data=data, eval=evaluation)
    return outputs


def test_the_same_options_and_seed_repeat_a_run_with_dropout_bit_for_bit(dropout_runs):
    a, b = dropout_runs["a"], dropout_runs["b"]
    assert without_timings(metrics(a)) == without_timings(metrics(b))
    assert (a / ADAPTER).read_bytes() == (b / ADAPTER).read_bytes()


def test_training_draws_dropout_from_the_models_config(dropout_runs):
    """The first step's loss is computed before any update, and the runs differ only in
    the config's ``attention_dropout``: it differs because that dropout is active."""
    on, off = metrics(dropout_runs["a"])[0], metrics(dropout_runs["off"])[0]
    assert on["loss"] != pytest.approx(off["loss"], rel=1e-6)


def test_a_resumed_run_with_dropout_equals_the_uninterrupted_one(dropout_runs, tmp_path):
    uninterrupted = dropout_runs["a"]
    output = tmp_path / "out"
    shutil.copytree(uninterrupted, output)
    shutil.rmtree(output / "checkpoints" / "step-6")
    (output / ADAPTER).unlink()
    resumed = run_train("--config", output / "run.yaml", "--output", output, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "step-3 (step 3)" in resumed.stdout
    assert (output / ADAPTER).read_bytes() == (uninterrupted / ADAPTER).read_bytes()
    assert without_timings(metrics(output)) == without_timings(metrics(uninterrupted))


def test_evaluation_runs_in_eval_mode_and_training_continues_in_train_mode(dropout_runs, tmp_path):
    from roundpipe.train.evaluation import evaluate
    from roundpipe.train.loop import build_pipe
    from roundpipe.train.options import resolve
    from roundpipe.train.preflight import prepare

    given = {"model": dropout_runs["model-on"], "data": dropout_runs["data"], "output": tmp_path,
             "eval_data": dropout_runs["eval"], "devices": "emulated:2", "lora_dropout": 0.2,
             "seq_len": 32, "batch_size": 8}  # fmt: skip
    prepared = prepare(resolve(given))
    pipe, _ = build_pipe(prepared.options)
    with pipe:
        assert pipe.training and all(m.training for m in pipe.hf_model.modules())
        got, _ = evaluate(pipe, prepared.eval_batches)
        assert pipe.training and all(m.training for m in pipe.hf_model.modules())
    # the adapters start as zero updates (lora_B = 0): the base model, in eval mode
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        dropout_runs["model-on"], dtype=torch.float32
    ).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for index in range(prepared.eval_batches.steps_per_epoch):
            batch = prepared.eval_batches.batch(index)
            tokens = int((batch["labels"][:, 1:] != -100).sum())
            total += reference(**batch).loss.item() * tokens
            count += tokens
    assert got == pytest.approx(total / count, rel=1e-5)
