"""Changes to parameters after wrapping that PyTorch would honour and RoundPipe cannot
are refused by name at the next call, never silently ignored: hooks registered on the
wrapped model's own parameters (which never receive gradients: the masters do), and a
master frozen between calls (PyTorch gives a frozen parameter no gradient)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from roundpipe import RoundPipe


def make_pipe() -> RoundPipe:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    return RoundPipe(model, devices="emulated:2")


def call(pipe: RoundPipe) -> torch.Tensor:
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    return pipe.forward_backward((x,), label=y, loss_fn=nn.functional.mse_loss)


@pytest.mark.parametrize(
    "register",
    [
        pytest.param(lambda p: p.register_post_accumulate_grad_hook(lambda _: None), id="post"),
        pytest.param(lambda p: p.register_hook(lambda g: g), id="tensor"),
    ],
)
def test_a_hook_on_a_wrapped_parameter_is_refused_naming_it(register):
    with make_pipe() as pipe:
        call(pipe)
        handle = register(pipe.model[2].weight)
        with pytest.raises(RuntimeError, match=r"2\.weight.*optim_parameters"):
            call(pipe)
        handle.remove()
        call(pipe)  # usable again once the hook is gone


def test_a_hook_on_a_master_parameter_still_runs():
    fired = []
    with make_pipe() as pipe:
        master = dict(pipe.optim_named_parameters())["2.weight"]
        master.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad is not None))
        call(pipe)
        pipe.synchronize()
    assert fired == [True]


def test_a_master_frozen_between_calls_is_refused_naming_it():
    with make_pipe() as pipe:
        call(pipe)
        master = dict(pipe.optim_named_parameters())["0.bias"]
        master.requires_grad_(False)
        with pytest.raises(RuntimeError, match=r"0\.bias.*frozen"):
            call(pipe)
        master.requires_grad_(True)
        call(pipe)
