"""``--precompute-ref-log-probs``: a LoRA run's reference computed once, before the first
step, with the adapters off, trains as the run whose reference is the pipe with its
adapters off at every step (the same base, so the same numbers up to rounding)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("yaml")

from support.train_fixtures import build_model_dir  # noqa: E402
from test_train_preference_multinode import METRICS, write_preferences  # noqa: E402

from roundpipe.cli import main  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def rows(output) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_a_precomputed_lora_reference_trains_as_the_per_step_one(method, tmp_path, capsys):
    model = build_model_dir(tmp_path / "model")
    data = write_preferences(tmp_path / "data.jsonl", method, count=8)
    common = ["train", "--model", str(model), "--data", str(data), "--method", method,
              "--lora-r", "4", "--sync", "--devices", "emulated:2", "--batch-size", "4",
              "--steps", "4", "--lr", "1e-2", "--eval-split", "0.25"]  # fmt: skip
    assert main([*common, "--output", str(tmp_path / "each")]) == 0
    assert main([*common, "--output", str(tmp_path / "once"), "--precompute-ref-log-probs"]) == 0
    out = capsys.readouterr().out
    assert "computing the reference log-probabilities of the 6 training examples" in out
    each, once = rows(tmp_path / "each"), rows(tmp_path / "once")
    for key in (*METRICS[method], "eval_loss"):
        want = [r[key] for r in each if key in r]
        assert want, key
        assert [r[key] for r in once if key in r] == pytest.approx(want, rel=1e-5, abs=1e-6)
    from safetensors.torch import load_file

    name = "adapter_model.safetensors"
    a, b = load_file(tmp_path / "each" / name), load_file(tmp_path / "once" / name)
    for key, tensor in a.items():
        torch.testing.assert_close(b[key], tensor, rtol=1e-4, atol=1e-5, msg=key)


def test_the_option_belongs_to_preference_methods(tmp_path, capsys):
    code = None
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "m", "--data", "d.jsonl", "--output", str(tmp_path / "o"),
              "--precompute-ref-log-probs"])  # fmt: skip
    code = exit_info.value.code
    assert code == 2
    assert "--precompute-ref-log-probs: not an option of --method sft" in capsys.readouterr().err
