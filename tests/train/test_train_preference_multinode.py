"""``roundpipe train --method dpo|kto`` under ``torchrun``: 2 local processes on gloo
train like one process on the same global batches (each process a share of the
examples, a DPO pair's two rows together; the loss the global batch's mean, the metrics
the global batch's, KTO's KL estimate the mean of the processes' as TRL gathers it).
Tolerances as ``test_train_multinode.py``'s: only the order of float sums differs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from support.train_fixtures import WORDS, build_model_dir  # noqa: E402
from support.train_ranks import LIMIT_S, finish, metrics, single, torchrun  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

METRICS = {
    "dpo": ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
            "rewards/margins", "logps/chosen", "logps/rejected", "mean_token_accuracy"),
    "kto": ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen",
            "logps/rejected"),
}  # fmt: skip


def write_preferences(path: Path, method: str, count: int = 16) -> Path:
    rng = random.Random(3)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS[3:]) for _ in range(n))

    with path.open("w") as file:
        for i in range(count):
            record = {"prompt": words(3), "chosen": " " + words(2), "rejected": " " + words(3)}
            if method == "kto":
                record = {"prompt": words(3), "completion": " " + words(2), "label": i % 3 != 1}
            file.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("pref-ranks") / "model")


@pytest.mark.parametrize(("method", "mode"), [("dpo", "--full"), ("kto", "--lora-r")])
def test_two_processes_train_like_one_process(method, mode, model_dir, tmp_path):
    data = write_preferences(tmp_path / f"{method}.jsonl", method)
    how = ["--full"] if mode == "--full" else ["--lora-r", "4"]
    args = ["--model", model_dir, "--data", data, "--method", method, *how, "--sync",
            "--seq-len", "32", "--batch-size", "8", "--devices", "emulated:2",
            "--lr", "1e-2", "--steps", "4", "--beta", "0.5"]  # fmt: skip
    one = single(*args, "--microbatches", "2", "--output", tmp_path / "one")
    two = torchrun(2, *args, "--microbatches", "1", "--output", tmp_path / "two")
    done_one, done_two = finish([one, two], LIMIT_S)
    assert done_one.returncode == 0, done_one.stderr
    assert done_two.returncode == 0, done_two.stderr
    want, got = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for key in METRICS[method]:
        values = [r[key] for r in want if key in r]
        assert len(values) >= 2, key
        assert [r[key] for r in got if key in r] == pytest.approx(values, rel=1e-5, abs=1e-6), key
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]
    name = "model.safetensors" if mode == "--full" else "adapter_model.safetensors"
    from safetensors.torch import load_file

    trained, reference = load_file(tmp_path / "two" / name), load_file(tmp_path / "one" / name)
    assert trained.keys() == reference.keys()
    for key, tensor in reference.items():
        torch.testing.assert_close(trained[key], tensor, rtol=1e-4, atol=1e-5, msg=key)
