"""The dtype ``roundpipe train --full`` saves its model in: the base model's as stored
(bf16 here, though the run trains in fp32 on the CPU), or ``--save-dtype``.

The oracle: ``transformers`` loading the result, its weights equal to the ones the run
trained with (its last checkpoint's) rounded to that dtype. The runs are shared with
``test_train_export.py`` (``support/train_dtype_runs.py``).
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from support.train_dtype_runs import bf16_model_dir, bf16_runs, trained_weights  # noqa: E402

from roundpipe.cli import main  # noqa: E402
from roundpipe.train.result import stored_dtype  # noqa: E402


@pytest.fixture(scope="module")
def runs(train_files, tmp_path_factory):
    return bf16_runs(tmp_path_factory.mktemp("dtype-runs"), train_files["prompt_completion"])


def loaded(output):
    return transformers.AutoModelForCausalLM.from_pretrained(output, dtype="auto")


@pytest.mark.parametrize(("run", "dtype"), [("full", torch.bfloat16), ("full_fp32", torch.float32)])
def test_the_model_is_saved_in_the_base_dtype_or_save_dtype(runs, run, dtype):
    output = runs[run]
    assert json.loads((output / "config.json").read_text())["dtype"] == str(dtype)[6:]
    model = loaded(output)
    trained = trained_weights(output, 4)
    assert next(iter(trained.values())).dtype == torch.float32  # trained in fp32
    for name, param in model.named_parameters():
        assert param.dtype == dtype, name
        assert torch.equal(param, trained[name].to(dtype)), name


def test_the_default_save_is_half_the_size_of_the_fp32_one(runs):
    def size(run):
        return (runs[run] / "model.safetensors").stat().st_size

    assert size("full") < 0.55 * size("full_fp32")


def test_the_base_dtype_is_the_dtype_of_most_stored_bytes(runs, tmp_path):
    assert stored_dtype(runs["base"]) == torch.bfloat16
    mixed = tmp_path / "mixed"
    model = transformers.AutoModelForCausalLM.from_pretrained(runs["base"], dtype=torch.bfloat16)
    model.model.norm.float()  # a norm kept in fp32, as some checkpoints do
    model.save_pretrained(mixed)
    assert stored_dtype(mixed) == torch.bfloat16


def test_save_dtype_with_lora_is_refused(train_files, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", str(train_files["model"]), "--data", str(train_files["text"]),
              "--output", str(tmp_path / "out"), "--save-dtype", "bf16"])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--save-dtype bf16 sets the dtype of a --full model" in err
    assert not (tmp_path / "out").exists()


def test_an_fp32_base_is_saved_in_fp32(train_files, tmp_path):
    assert stored_dtype(train_files["model"]) == torch.float32
    assert stored_dtype(bf16_model_dir(tmp_path / "m")) == torch.bfloat16
