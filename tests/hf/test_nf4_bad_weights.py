"""A checkpoint weight holding NaN or inf under ``quantize="nf4"``: refused while it
loads, before any training, with one line naming the checkpoint tensor, what it holds
and where (bitsandbytes would quantize the block to garbage: its scale is not finite).
``roundpipe train --quantize nf4`` exits with code 2 and that line.

Oracle: the tensor and the element the test itself poisoned in the saved file.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.hf_families import build
from support.nf4_models import build_model
from support.train_cli import run_train
from support.train_fixtures import build_model_dir, write_data

import roundpipe
from roundpipe.hf.safetensors_io import CheckpointError

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")


def poisoned(directory, name: str, index: tuple, value: float, dtype=torch.float32):
    """``directory``'s single-file checkpoint with ``value`` at ``index`` of ``name``."""
    path = directory / "model.safetensors"
    tensors = {k: v.to(dtype) for k, v in load_file(path).items()}
    tensors[name][index] = value
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


def load_nf4(directory, dtype=torch.float32):
    return roundpipe.from_pretrained(
        directory,
        torch_dtype=dtype,
        lora=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
        quantize="nf4",
        devices="emulated:2",
    )


@pytest.fixture
def llama(tmp_path):
    build_model("llama").save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


@pytest.mark.parametrize(("value", "said"), [(float("nan"), "NaN"), (float("-inf"), "-inf")])
def test_a_linear_weight_holding_nan_or_inf_is_refused_naming_it(llama, value, said):
    name = "model.layers.1.mlp.down_proj.weight"
    directory = poisoned(llama, name, (5, 70), value)
    with pytest.raises(CheckpointError) as caught:  # a ValueError
        load_nf4(directory)
    message = str(caught.value)
    assert f"tensor {name!r} in {directory / 'model.safetensors'} holds {said} at [5, 70]" in (
        message
    )
    assert "\n" not in message


def test_a_bf16_checkpoint_is_named_in_its_own_dtype(llama):
    name = "model.layers.0.self_attn.k_proj.weight"
    directory = poisoned(llama, name, (3, 1), float("inf"), dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match=rf"{name}.* holds inf at \[3, 1\]"):
        load_nf4(directory, torch.bfloat16)


def test_a_finite_weight_that_overflows_the_model_dtype_says_so(llama):
    name = "model.layers.2.mlp.up_proj.weight"
    directory = poisoned(llama, name, (0, 2), 1e6)
    with pytest.raises(CheckpointError) as caught:
        load_nf4(directory, torch.float16)
    assert f"tensor {name!r}" in str(caught.value)
    assert "holds 1e+06 at [0, 2], which is inf in torch.float16" in str(caught.value)


@pytest.mark.parametrize(
    ("family", "name", "index", "where"),
    [
        # stored one tensor per expert: the per-expert tensor is named
        ("qwen3_moe", "model.layers.1.mlp.experts.2.up_proj.weight", (4, 9), "[4, 9]"),
        # stored stacked: the stacked tensor is named, the expert first in the index
        ("gpt_oss", "model.layers.0.mlp.experts.down_proj", (3, 10, 7), "[3, 10, 7]"),
    ],
)
def test_an_expert_weight_holding_nan_is_refused_naming_it(tmp_path, family, name, index, where):
    build(family).save_pretrained(tmp_path / family)
    directory = poisoned(tmp_path / family, name, index, float("nan"))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in .* holds NaN at \{where}"):
        roundpipe.from_pretrained(
            directory,
            torch_dtype=torch.float32,
            lora=peft.LoraConfig(r=4, target_modules=["q_proj"]),
            quantize="nf4",
            devices="emulated:2",
        )


def test_roundpipe_train_refuses_a_nan_weight_in_one_line_with_code_2(tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight"
    directory = poisoned(build_model_dir(tmp_path / "model"), name, (0, 0), float("nan"))
    data = write_data(tmp_path / "data.jsonl", "text", lines=8)
    run = run_train(
        "--model", directory, "--data", data, "--output", tmp_path / "run", "--quantize", "nf4",
        "--seq-len", "32", "--batch-size", "2", "--devices", "emulated:2", "--max_steps", "1",
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    (line,) = [line for line in run.stderr.splitlines() if line.startswith("roundpipe train")]
    assert line.startswith(f"roundpipe train: error: tensor {name!r} in ")
    assert "holds NaN at [0, 0]" in line
    assert "Traceback" not in run.stderr


def test_a_nan_weight_in_a_model_transformers_converts_is_refused_naming_the_module():
    # the converted-layout path quantizes the loaded modules in place
    from roundpipe.hf.converted_loading import quantize_in_place

    model = build("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.down_proj.*damaged"):
        quantize_in_place(model)
