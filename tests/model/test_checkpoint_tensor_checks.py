"""Every tensor a checkpoint holds must be exactly what the model has: the same names,
shapes and dtypes, from one save; an error names the file, the tensor and both sides."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from support.checkpoints import mid_training, new_pipe, rewrite, truncate


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    with new_pipe(0) as pipe:
        optimizer, scheduler = mid_training(pipe, seed=0)
        pipe.save_checkpoint(path, optimizer, scheduler)
    return path


@pytest.mark.parametrize(
    ("file", "key"),
    [("weights", "param/0.bias"), ("masters", "0.bias"), ("masters", "grad/0.bias")],
)
def test_a_tensor_whose_shape_broadcasts_is_refused_naming_file_tensor_and_both_shapes(
    saved, file, key
):
    rewrite(saved / f"{file}.safetensors", lambda t: t.update({key: t[key][:1].clone()}))
    with new_pipe(5) as pipe, pytest.raises(ValueError) as caught:
        pipe.load_checkpoint(saved)
    message = str(caught.value)
    assert f"{file}.safetensors" in message and key in message, message
    assert "(1,)" in message and "(16,)" in message, message


def test_a_tensor_of_another_dtype_is_refused_naming_both_dtypes(saved):
    rewrite(
        saved / "weights.safetensors",
        lambda t: t.update({"param/0.weight": t["param/0.weight"].half()}),
    )
    with new_pipe(5) as pipe, pytest.raises(ValueError) as caught:
        pipe.load_checkpoint(saved)
    message = str(caught.value)
    assert "param/0.weight" in message and "float16" in message and "float32" in message, message


def test_a_tensor_the_model_does_not_have_is_refused(saved):
    rewrite(saved / "weights.safetensors", lambda t: t.update({"buffer/stray": torch.zeros(3)}))
    with new_pipe(5) as pipe, pytest.raises(ValueError, match="buffer/stray"):
        pipe.load_checkpoint(saved)


def test_a_truncated_file_is_refused_naming_it(saved):
    truncate(saved / "optimizer.safetensors")
    with new_pipe(5) as pipe, pytest.raises(ValueError) as caught:
        optimizer = torch.optim.AdamW(pipe.optim_parameters())
        pipe.load_checkpoint(saved, optimizer)
    assert str(saved / "optimizer.safetensors") in str(caught.value)


def test_files_of_two_saves_mixed_in_one_directory_are_refused(saved, tmp_path):
    other = tmp_path / "other"
    with new_pipe(3) as pipe:
        pipe.save_checkpoint(other)
    shutil.copy(other / "masters.safetensors", saved / "masters.safetensors")
    with new_pipe(5) as pipe, pytest.raises(ValueError, match=re.escape("another save")):
        pipe.load_checkpoint(saved)


def test_a_missing_optimizer_state_tensor_is_refused_before_anything_changes(saved):
    rewrite(saved / "optimizer.safetensors", lambda t: t.pop("1/exp_avg_sq"))
    with new_pipe(5) as pipe:
        optimizer = torch.optim.AdamW(pipe.optim_parameters())
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        with pytest.raises(ValueError) as caught:
            pipe.load_checkpoint(saved, optimizer)
        assert all(torch.equal(v, pipe.state_dict()[k]) for k, v in before.items())
        assert optimizer.state_dict()["state"] == {}
    message = str(caught.value)
    assert "optimizer.safetensors" in message and "1/exp_avg_sq" in message, message


def test_an_optimizer_whose_parameters_come_in_another_order_is_refused(saved):
    with new_pipe(5) as pipe:
        optimizer = torch.optim.AdamW(list(pipe.optim_parameters())[::-1])
        with pytest.raises(ValueError) as caught:
            pipe.load_checkpoint(saved, optimizer)
    message = str(caught.value)
    assert "exp_avg" in message and "same order" in message, message


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), id="SGD"),
        pytest.param(lambda params: torch.optim.Adam(params), id="Adam"),
    ],
)
def test_an_optimizer_of_another_kind_is_refused_before_anything_changes(saved, other):
    # AdamW's state loads into SGD without a complaint from load_state_dict, and the
    # step then fails (or, for Adam, silently applies no weight decay): refused by name.
    with new_pipe(5) as pipe:
        optimizer = other(pipe.optim_parameters())
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        with pytest.raises(ValueError) as caught:
            pipe.load_checkpoint(saved, optimizer)
        assert all(torch.equal(v, pipe.state_dict()[k]) for k, v in before.items())
        assert optimizer.state_dict()["state"] == {}
    message = str(caught.value)
    assert "torch.optim.adamw.AdamW" in message and type(optimizer).__name__ in message, message


def test_optimizer_states_of_another_dtype_are_refused(tmp_path):
    pytest.importorskip("torchao")
    from roundpipe.optim import make_adamw

    path = tmp_path / "ckpt"
    with new_pipe(0) as pipe:
        pipe.save_checkpoint(path, make_adamw(pipe.optim_parameters(), lr=0.1, states="bf16"))
    with new_pipe(5) as pipe:
        fp32 = make_adamw(pipe.optim_parameters(), lr=0.1, states="fp32")
        with pytest.raises(ValueError, match=r"state_dtype=torch.bfloat16"):
            pipe.load_checkpoint(path, fp32)
        again = make_adamw(pipe.optim_parameters(), lr=0.1, states="bf16")
        pipe.load_checkpoint(path, again)  # the kind it was saved with loads
