"""``roundpipe train --model`` and ``roundpipe export --merge`` on families beyond our
own adapter's: tiny saved checkpoints (a sliding-window Gemma 3, a Granite 4 Mamba/MoE
hybrid, a Qwen3.5 VLM on text) train with the CLI's defaults (LoRA on every linear
layer) and the loss falls on held-out data; a LoRA run exports a merged model that
transformers loads and that computes what peft's own merge computes.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from support.train_cli import COMMON, metrics, run_train  # noqa: E402
from support.train_fixtures import architecture_dir  # noqa: E402

from roundpipe.cli import main  # noqa: E402

FAMILIES = ["gemma3_text", "granitemoehybrid", "qwen3_5_vlm"]


@pytest.fixture(scope="module")
def runs(train_files, tmp_path_factory) -> dict:
    """One 8-step run per family with the CLI's defaults (LoRA on every linear layer)."""
    root = tmp_path_factory.mktemp("families")
    found = {}
    for name in FAMILIES:
        model = architecture_dir(name, root / name / "model")
        output = root / name / "out"
        done = run_train(
            "--model", model, "--data", train_files["messages"], "--output", output,
            "--steps", "8", "--eval-data", train_files["eval"], "--eval-every", "2",
            "--save-every", "4", *COMMON, "--lr", "2e-3",
        )  # fmt: skip
        found[name] = (model, output, done)
    return found


@pytest.mark.parametrize("name", FAMILIES)
def test_the_train_command_trains_the_family_with_its_defaults(name, runs):
    _, output, done = runs[name]
    assert done.returncode == 0, done.stderr
    rows = metrics(output)
    assert len([row for row in rows if "loss" in row]) == 8
    evals = [row["eval_loss"] for row in rows if "eval_loss" in row]
    assert len(evals) == 4 and evals[-1] < evals[0], evals
    assert json.loads((output / "adapter_config.json").read_text())["target_modules"]


def test_a_lora_run_on_a_hybrid_exports_the_merge_peft_computes(runs, tmp_path):
    model, output, done = runs["granitemoehybrid"]
    assert done.returncode == 0, done.stderr
    merged = tmp_path / "merged"
    checkpoint = output / "checkpoints" / "step-8"
    exported = ["export", "--checkpoint", str(checkpoint), "--output", str(merged), "--merge"]
    assert main(exported) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    want = peft.PeftModel.from_pretrained(base, output).merge_and_unload()
    got = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=ids).logits, want(input_ids=ids).logits)
