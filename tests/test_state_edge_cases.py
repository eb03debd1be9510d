"""Edge cases of a model's state: closing, loading, freezing, deferred backwards,
retried scaled steps and layers calling back into the model.

Each test names the behaviour PyTorch gives; where refusing loudly is the honest
alternative to matching PyTorch, the test accepts that error.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from oracle import assert_grads_close, assert_weights_close, batch, mlp, mse_sum
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig

CONFIG = RoundPipeRunConfig(num_microbatch=3)
LR = 0.1


def sgd_step(optimizer: torch.optim.Optimizer):
    return lambda: (optimizer.step(), optimizer.zero_grad())


def pytorch_sgd_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """``model`` after one SGD step on the summed microbatch losses of ``(x, y)``."""
    model = copy.deepcopy(model)
    for xm, ym in zip(x.tensor_split(3), y.tensor_split(3), strict=True):
        mse_sum(model(xm), ym).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    model.zero_grad()
    return model


# -- close() leaves the wrapped model one step stale after odd async step counts -------


@pytest.mark.parametrize("steps", [0, 2])  # then one async step: 1 and 3 steps in all
def test_close_leaves_the_wrapped_model_with_the_newest_weights(steps, no_hang):
    net = mlp()
    expected = net
    pipe = RoundPipe(net, devices="emulated:2", model_run_config=CONFIG)
    optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=LR)
    for seed in range(steps):
        x, y = batch(seed=seed)
        no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
        no_hang(pipe.step, sgd_step(optimizer), is_async=False)  # sync: versions are exact
        expected = pytorch_sgd_step(expected, x, y)
    # one more async step, then close() without synchronize(): close waits for it
    x, y = batch(seed=steps)
    no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
    no_hang(pipe.step, sgd_step(optimizer), is_async=True)
    expected = pytorch_sgd_step(expected, x, y)
    no_hang(pipe.close)
    assert_weights_close(net, expected)  # the user's module after `with RoundPipe(...)`


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


# -- GradScaler: a failing step_fn leaves the kept gradients scaled --------------------


def test_retrying_a_failed_step_with_a_grad_scaler_applies_the_unscaled_gradients(no_hang):
    net = mlp()
    x, y = batch()
    expected = pytorch_sgd_step(net, x, y)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    pipe = RoundPipe(net, devices="emulated:2", model_run_config=CONFIG, grad_scaler=scaler)
    try:
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=LR)
        no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)

        def flaky() -> None:
            raise ValueError("transient failure before the optimizer ran")

        def step_fn() -> None:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

        with pytest.raises(ValueError, match="transient"):
            no_hang(pipe.step, flaky, is_async=False)
        no_hang(pipe.step, step_fn, is_async=False)  # the retry the SPEC promises
        no_hang(pipe.synchronize)
        assert_weights_close(pipe.model, expected)
    finally:
        no_hang(pipe.close)


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


# -- a layer calling back into the model from a background stage hangs forever ---------


CALLS_BACK_CHILD = r"""
import os, sys, threading
import torch
from torch import nn
sys.path.insert(0, sys.argv[1])
from oracle import batch, mlp, mse_sum
from roundpipe import RoundPipe, RoundPipeRunConfig

armed, caller_returned, finished, outcome = (
    threading.Event(), threading.Event(), threading.Event(), []
)

def hook(module, args):
    # layer 0's recompute: a background backward stage, after forward_backward returned
    if not (torch.is_grad_enabled() and armed.is_set()) or outcome:
        return
    outcome.append("started")
    caller_returned.wait(5)
    try:
        pipe.synchronize()
        outcome.append("returned")
    except RuntimeError as exc:
        outcome.append("raised")
    finally:
        finished.set()

first = nn.Identity()
first.register_forward_pre_hook(hook)
config = RoundPipeRunConfig(num_microbatch=3, execute_plan="3,3|1,1,1,1,2,1")
pipe = RoundPipe(nn.Sequential(first, *mlp()), devices="emulated:2", model_run_config=config)
x, y = batch()
pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
pipe.synchronize()
armed.set()
pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
caller_returned.set()
print("LAYER", "finished" if finished.wait(5) else "HUNG", outcome, flush=True)
try:
    pipe.synchronize()
    print("SYNC returned", flush=True)
except RuntimeError as exc:
    print("SYNC raised", str(exc)[:120], flush=True)
os._exit(0)
"""


def test_a_layer_calling_back_into_the_model_from_a_background_stage_raises_not_hangs():
    # In a child process: the failure mode is a device thread blocked forever.
    tests = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.run(
        [sys.executable, "-c", CALLS_BACK_CHILD, tests],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert "LAYER finished ['started', 'raised']" in child.stdout, child.stdout + child.stderr
    # the model is not left claimed by the device thread: never "another thread is driving"
    assert "SYNC returned" in child.stdout, child.stdout


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
