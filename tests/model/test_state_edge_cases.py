"""Edge cases of a model's state: loading, deferred backwards and freezing.

Each test names the behaviour PyTorch gives; where refusing loudly is the honest
alternative to matching PyTorch, the test accepts that error.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.oracle import assert_grads_close, batch, mlp, mse_sum

from roundpipe import RoundPipeRunConfig

CONFIG = RoundPipeRunConfig(num_microbatch=3)
LR = 0.1


def sgd_step(optimizer: torch.optim.Optimizer):
    return lambda: (optimizer.step(), optimizer.zero_grad())


# -- load_state_dict(assign=True) is silently ignored ----------------------------------


def test_load_state_dict_with_assign_is_refused_and_changes_nothing(wrap, no_hang):
    # assign=True would swap in parameter objects the runtime does not track.
    pipe, reference = wrap(mlp(), devices="emulated:2", model_run_config=CONFIG)
    loaded = mlp(seed=99)
    with pytest.raises(ValueError, match="assign"):
        no_hang(pipe.load_state_dict, copy.deepcopy(loaded.state_dict()), assign=True)
    x, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(no_hang(pipe, x), reference(x), atol=1e-5, rtol=1e-5)


# -- a partial load_state_dict rounds the fp32 masters of a bf16 model -----------------


def test_partial_load_state_dict_keeps_the_fp32_masters_of_parameters_it_does_not_load(
    wrap, no_hang
):
    pipe, _ = wrap(mlp().to(torch.bfloat16), devices="emulated:2", model_run_config=CONFIG)
    optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=LR)
    x, y = batch()

    def loss_fn(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return mse_sum(out.float(), label.float())

    no_hang(pipe.forward_backward, (x.bfloat16(),), label=y.bfloat16(), loss_fn=loss_fn)
    no_hang(pipe.step, sgd_step(optimizer), is_async=False)
    before = {name: m.detach().clone() for name, m in pipe.optim_named_parameters()}
    assert not torch.equal(before["2.weight"], before["2.weight"].bfloat16().float())
    partial = {"0.weight": torch.zeros(16, 8, dtype=torch.bfloat16)}
    no_hang(pipe.load_state_dict, partial, strict=False)
    after = dict(pipe.optim_named_parameters())
    assert torch.equal(after["0.weight"], torch.zeros(16, 8))
    for name, master in after.items():
        if name != "0.weight":
            assert torch.equal(master.detach(), before[name]), f"{name}: master rewritten"


# -- model(x) then .backward(): weights changed in between are not noticed -------------


def test_load_state_dict_between_a_plain_forward_and_its_backward_raises(wrap, no_hang):
    pipe, reference = wrap(mlp(), devices="emulated:2", model_run_config=CONFIG)
    x, _ = batch()
    out = no_hang(pipe, x)
    no_hang(pipe.load_state_dict, mlp(seed=99).state_dict())
    # PyTorch would raise (weights modified in place since the forward); the runtime
    # promises the same ("a step or weight write between model(x) and .backward()").
    with pytest.raises(RuntimeError, match="between model\\(x\\) and .backward"):
        no_hang(out.sum().backward)


def test_synchronize_between_a_plain_forward_and_its_backward_keeps_the_forward_weights(
    wrap, no_hang
):
    pipe, reference = wrap(mlp(), devices="emulated:2", model_run_config=CONFIG)
    optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=LR)
    x, y = batch()
    no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
    no_hang(pipe.step, sgd_step(optimizer), is_async=True)
    out = no_hang(pipe, x)  # async: this forward runs v0, the weights before the step
    no_hang(pipe.synchronize)  # e.g. pipe.state_dict() for a checkpoint
    try:
        no_hang(out.sum().backward)
    except RuntimeError:
        return  # refusing loudly is acceptable
    no_hang(pipe.synchronize)
    at_forward = copy.deepcopy(reference)  # v0
    at_forward(x).sum().backward()
    assert_grads_close(pipe.model, at_forward)


# -- a second backward through a model(x) output is silently dropped -------------------


def test_a_second_backward_through_a_plain_forward_accumulates_again(wrap, no_hang):
    pipe, reference = wrap(mlp(), devices="emulated:2", model_run_config=CONFIG)
    x, _ = batch()
    out = no_hang(pipe, x)
    no_hang(out.sum().backward, retain_graph=True)
    try:
        no_hang(out.sum().backward)
    except RuntimeError:
        return  # refusing loudly is acceptable
    no_hang(pipe.synchronize)
    expected = reference(x)
    expected.sum().backward(retain_graph=True)
    expected.sum().backward()
    assert_grads_close(pipe.model, reference)


# -- misuse paths that silently train the wrong thing -----------------------------------


def test_a_parameter_frozen_after_wrapping_is_not_trained(wrap, no_hang):
    pipe, reference = wrap(mlp(), devices="emulated:2", model_run_config=CONFIG)
    pipe.model[0].weight.requires_grad_(False)  # as in PyTorch fine-tuning
    optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=LR)
    x, y = batch()
    try:
        no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
        no_hang(pipe.step, sgd_step(optimizer), is_async=False)
    except RuntimeError:
        return  # refusing loudly is acceptable
    no_hang(pipe.synchronize)
    torch.testing.assert_close(pipe.model[0].weight.detach(), reference[0].weight.detach())
