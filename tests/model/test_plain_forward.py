"""``model(x)`` on a RoundPipe model: inference equals the plain model, and a backward
through it gives PyTorch's gradients.

Two plain forwards then one backward accumulate both; a step between a plain forward
and its backward raises as PyTorch does (the weights changed in place since the
forward), and the model goes on. (Dropout masks in a plain forward:
``test_model_features.py``.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.oracle import assert_grads_close, batch, mlp, mse_sum
from support.pipes import pipe_on

from roundpipe import RoundPipe, RoundPipeRunConfig


def test_inference_matches_the_plain_model():
    model = mlp()
    reference = copy.deepcopy(model)
    x, _ = batch()
    with RoundPipe(model, devices="emulated:3") as wrapped, torch.no_grad():
        torch.testing.assert_close(wrapped(x), reference(x))


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_backward_through_a_plain_forward_gives_pytorch_gradients(grain):
    model = mlp()
    reference = copy.deepcopy(model)
    x, y = batch()
    config = RoundPipeRunConfig(num_microbatch=4, recompute_grain=grain)
    with RoundPipe(model, devices="emulated:3", model_run_config=config) as wrapped:
        loss = mse_sum(wrapped(x), y)
        loss.backward()
        wrapped.synchronize()
    want = mse_sum(reference(x), y)
    want.backward()
    torch.testing.assert_close(loss, want)
    assert_grads_close(model, reference)


def test_two_plain_forwards_then_one_backward_accumulate_both():
    model = mlp()
    reference = copy.deepcopy(model)
    (x1, y1), (x2, y2) = batch(1), batch(2)
    with pipe_on(model, devices=2, num_microbatch=3) as wrapped:
        total = mse_sum(wrapped(x1), y1) + 0.5 * mse_sum(wrapped(x2), y2)
        total.backward()
        wrapped.synchronize()
    (mse_sum(reference(x1), y1) + 0.5 * mse_sum(reference(x2), y2)).backward()
    assert_grads_close(model, reference)


def test_a_step_between_a_plain_forward_and_its_backward_raises_like_pytorch():
    # PyTorch refuses a backward through weights modified in place since the forward.
    x, y = batch()
    with pipe_on(mlp(), devices=2, num_microbatch=3) as wrapped:
        optimizer = torch.optim.SGD(wrapped.optim_parameters(), lr=0.1)
        mse_sum(wrapped(x), y).backward()
        loss = mse_sum(wrapped(x), y)
        wrapped.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
        with pytest.raises(RuntimeError, match="between model\\(x\\) and .backward"):
            loss.backward()
        mse_sum(wrapped(x), y).backward()  # the model goes on
        wrapped.synchronize()
