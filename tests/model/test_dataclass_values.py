"""Dataclass instances are values like tuples and dicts: a layer may take and return
them, and the tensors in their fields cross stage boundaries with their gradients, are
split into microbatches and merged back, as plain PyTorch would see them."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from support.oracle import (
    assert_grads_close,
    batch,
    mse_sum,
    reference_loss_and_grads,
    weighted_microbatches,
)
from torch import nn

from roundpipe import RoundPipeRunConfig


@dataclasses.dataclass
class Hidden:
    state: torch.Tensor
    tag: str = "mb"


@dataclasses.dataclass(frozen=True)
class FrozenHidden:
    state: torch.Tensor
    skip: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "skip", self.state.tanh())


@dataclasses.dataclass(slots=True)
class SlotsHidden:
    state: torch.Tensor


KINDS = [Hidden, FrozenHidden, SlotsHidden]


class Wrap(nn.Module):
    """Returns its projection in a dataclass of type ``kind``."""

    def __init__(self, kind: type) -> None:
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return self.kind(self.proj(x))


class Unwrap(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 4)

    def forward(self, value):
        extra = value.skip if isinstance(value, FrozenHidden) else 0
        return self.proj(value.state + extra)


def model_passing(kind: type) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Wrap(kind), Unwrap())


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.__name__)
@pytest.mark.parametrize("plan", ["1,1|1,1,1", "2|1,2", "1|2,1"])
def test_a_layer_returning_a_dataclass_passes_gradients_to_the_layers_before_it(
    plan, kind, wrap, no_hang
):
    model, reference = wrap(
        model_passing(kind),
        devices="emulated:3",
        model_run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=plan),
    )
    x, y = batch()
    loss = no_hang(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
    no_hang(model.synchronize)
    torch.testing.assert_close(loss, reference_loss_and_grads(reference, x, y, 3))
    assert_grads_close(model.model, reference)


class DataclassHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 4)

    def forward(self, x):
        return Hidden(self.proj(x), tag="head")


def test_dataclass_outputs_are_merged_into_one_dataclass_over_the_batch(wrap, no_hang):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), DataclassHead())
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan="1,1|1,1,1")
    model, reference = wrap(module, devices="emulated:2", model_run_config=config)
    x, y = batch()
    _, outputs = no_hang(
        model.forward_backward,
        (x,),
        label=y,
        loss_fn=lambda out, label: mse_sum(out.state, label),
        return_outputs=True,
    )
    assert type(outputs) is Hidden and outputs.tag == "head"
    torch.testing.assert_close(outputs.state, reference(x).state.detach())


@dataclasses.dataclass
class Features:
    """Only ever an input (dataclass types become tree nodes when first seen)."""

    values: torch.Tensor


class Unpack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, features: Features):
        return self.proj(features.values)


def test_a_dataclass_input_is_split_into_microbatches_from_the_first_call(wrap, no_hang):
    torch.manual_seed(0)
    module = nn.Sequential(Unpack(), nn.Tanh(), nn.Linear(16, 4))
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan="1,1|1,1,1")
    model, reference = wrap(module, devices="emulated:2", model_run_config=config)
    x, y = batch()
    loss = no_hang(model.forward_backward, (Features(x),), label=y, loss_fn=mse_sum)
    no_hang(model.synchronize)
    expected = copy.deepcopy(reference)
    total = torch.zeros(())
    for xm, ym, weight in weighted_microbatches(x, y, 3):
        step = mse_sum(expected(Features(xm)), ym) * weight
        step.backward()
        total = total + step.detach()
    torch.testing.assert_close(loss, total)
    assert_grads_close(model.model, expected)
