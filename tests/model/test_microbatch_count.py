"""How many microbatches a call splits into: ``RoundPipeRunConfig`` alone decides
(devices + 1 unless ``num_microbatch`` is given, at most the batch's rows where a caller
caps it), and the facade, ``roundpipe train`` and its long-sequence fit all ask it."""

from __future__ import annotations

import pytest
import torch
from support.oracle import batch, mlp

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.train.loop import step_run_config


@pytest.mark.parametrize(("devices", "want"), [(1, 2), (2, 3), (3, 4)])
def test_the_default_is_one_more_microbatch_than_devices(devices, want):
    assert RoundPipeRunConfig().microbatches_for(devices) == want


def test_an_explicit_microbatch_count_wins():
    assert RoundPipeRunConfig(num_microbatch=5).microbatches_for(2) == 5


def test_a_batch_of_fewer_rows_caps_the_count():
    assert RoundPipeRunConfig().microbatches_for(3, rows=2) == 2
    assert RoundPipeRunConfig(num_microbatch=5).microbatches_for(2, rows=8) == 5


def calls_of_loss_fn(model: RoundPipe) -> int:
    calls = []

    def counting_mse(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        calls.append(None)
        return torch.nn.functional.mse_loss(output, label)

    x, y = batch(size=12)
    model.forward_backward((x,), label=y, loss_fn=counting_mse)
    model.synchronize()
    return len(calls)


def test_the_facade_splits_a_call_into_the_configs_count():
    with RoundPipe(mlp(), devices="emulated:2") as model:
        assert calls_of_loss_fn(model) == 3


def test_the_facade_asks_the_config(monkeypatch):
    monkeypatch.setattr(RoundPipeRunConfig, "microbatches_for", lambda self, devices, rows=None: 2)
    with RoundPipe(mlp(), devices="emulated:2") as model:
        assert calls_of_loss_fn(model) == 2


@pytest.mark.parametrize(
    ("given", "devices", "rows", "world", "want"),
    [(None, 2, 8, 1, 3), (5, 2, 8, 1, 5), (None, 3, 4, 2, 2), (None, 2, 3, 1, 3)],
)
def test_a_training_step_splits_as_the_config_says(given, devices, rows, world, want):
    config = RoundPipeRunConfig(num_microbatch=given)
    assert config.microbatches_for(devices, rows // world) == want
    assert step_run_config(config, devices, rows, world).num_microbatch == want


def test_a_training_step_asks_the_config(monkeypatch):
    monkeypatch.setattr(RoundPipeRunConfig, "microbatches_for", lambda self, devices, rows=None: 7)
    assert step_run_config(RoundPipeRunConfig(), 2, 8, 1).num_microbatch == 7
