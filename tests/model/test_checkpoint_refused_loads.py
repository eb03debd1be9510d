"""A load that refuses a checkpoint changes nothing: weights, masters, gradients,
optimizer, scheduler and RNG states stay exactly as they were."""

from __future__ import annotations

import json

import pytest
import torch
from support.checkpoints import (
    assert_same,
    live_state,
    mid_training,
    new_pipe,
    rewrite,
    truncate,
)


def _widen(tensors: dict[str, torch.Tensor]) -> None:
    tensors["param/0.bias"] = torch.zeros(1)  # broadcasts over the (16,) bias


def _to_float64(tensors: dict[str, torch.Tensor]) -> None:
    tensors["0.weight"] = tensors["0.weight"].double()


def _damage_state(path) -> None:
    file = path / "state.json"
    file.write_text(file.read_text()[:-20])


def _drop_scheduler(path) -> None:
    file = path / "state.json"
    state = json.loads(file.read_text())
    del state["lr_scheduler"]
    file.write_text(json.dumps(state))


# name: (what the checkpoint suffers, the error, what its message names)
REFUSALS = {
    "a truncated masters file": (
        lambda p: truncate(p / "masters.safetensors"), ValueError, "masters.safetensors"),
    "a truncated weights file": (
        lambda p: truncate(p / "weights.safetensors", 0.9), ValueError, "weights.safetensors"),
    "a missing optimizer file": (
        lambda p: (p / "optimizer.safetensors").unlink(), FileNotFoundError,
        "optimizer.safetensors"),
    "a missing rng file": (
        lambda p: (p / "rng.safetensors").unlink(), FileNotFoundError, "rng.safetensors"),
    "a damaged state.json": (_damage_state, ValueError, "state.json"),
    "a scheduler for a checkpoint saved without one": (
        _drop_scheduler, ValueError, "no lr_scheduler state"),
    "a weight of another shape": (
        lambda p: rewrite(p / "weights.safetensors", _widen), ValueError, "0.bias"),
    "a master of another dtype": (
        lambda p: rewrite(p / "masters.safetensors", _to_float64), ValueError, "0.weight"),
}  # fmt: skip


@pytest.mark.parametrize("refusal", REFUSALS)
def test_a_refused_load_leaves_the_pipe_exactly_as_it_was(tmp_path, refusal):
    damage, error, named = REFUSALS[refusal]
    path = tmp_path / "ckpt"
    with new_pipe(0) as pipe:
        optimizer, scheduler = mid_training(pipe, seed=0)
        pipe.save_checkpoint(path, optimizer, scheduler)
    damage(path)
    with new_pipe(5) as pipe:
        optimizer, scheduler = mid_training(pipe, seed=10)
        before = live_state(pipe, optimizer, scheduler)
        with pytest.raises(error, match=named):
            pipe.load_checkpoint(path, optimizer, scheduler)
        assert_same(live_state(pipe, optimizer, scheduler), before)


def test_an_optimizer_for_a_checkpoint_saved_without_one_is_refused_and_nothing_changes(
    tmp_path,
):
    path = tmp_path / "ckpt"
    with new_pipe(0) as pipe:
        mid_training(pipe, seed=0)
        pipe.save_checkpoint(path)
    with new_pipe(5) as pipe:
        optimizer, scheduler = mid_training(pipe, seed=10)
        before = live_state(pipe, optimizer, scheduler)
        with pytest.raises(ValueError, match="no optimizer state"):
            pipe.load_checkpoint(path, optimizer)
        assert_same(live_state(pipe, optimizer, scheduler), before)


def test_an_optimizer_of_other_parameter_groups_is_refused_and_nothing_changes(tmp_path):
    path = tmp_path / "ckpt"
    with new_pipe(0) as pipe:
        optimizer, scheduler = mid_training(pipe, seed=0)
        pipe.save_checkpoint(path, optimizer, scheduler)
    with new_pipe(5) as pipe:
        optimizer, scheduler = mid_training(pipe, seed=10)
        before = live_state(pipe, optimizer, scheduler)
        masters = list(pipe.optim_parameters())
        other = torch.optim.AdamW([{"params": masters[:2]}, {"params": masters[2:]}])
        with pytest.raises(ValueError, match="parameter groups"):
            pipe.load_checkpoint(path, other, scheduler)
        assert_same(live_state(pipe, optimizer, scheduler), before)
