"""``pipe.zero_grad()`` discards the gradients the next step would apply, as
``model.zero_grad()`` does in PyTorch: those of calls still running too (it waits for
them), and inside ``step_fn`` those the step just applied."""

from __future__ import annotations

import copy

import pytest
import torch
from support.oracle import assert_weights_close, batch, mlp, mse_sum, reference_loss_and_grads

from roundpipe import RoundPipeRunConfig

NUM_MICROBATCH = 3
CONFIG = RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH, execute_plan="2,2|2,2,2")


def pytorch_steps(reference, batches_per_step, make_optimizer, set_to_none=True):
    """PyTorch: per entry, the batches' gradients (``None``: ``zero_grad`` there), one step."""
    model = copy.deepcopy(reference)
    optimizer = make_optimizer(model.parameters())
    for batches in batches_per_step:
        for seed in batches:
            if seed is None:
                model.zero_grad(set_to_none=set_to_none)
                continue
            x, y = batch(seed=seed)
            reference_loss_and_grads(model, x, y, NUM_MICROBATCH)
        optimizer.step()
    return model


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_zero_grad_between_calls_discards_the_gradients_of_the_calls_before_it(
    is_async, wrap, no_hang
):
    model, reference = wrap(mlp(), devices="emulated:2", model_run_config=CONFIG)
    optimizer = sgd(model.optim_parameters())
    x, y = batch(seed=1)
    no_hang(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
    no_hang(model.zero_grad)  # the call's backward stages may still be running
    x, y = batch(seed=2)
    no_hang(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
    no_hang(model.step, optimizer.step, is_async=is_async)
    no_hang(model.synchronize)
    assert_weights_close(model.model, pytorch_steps(reference, [[1, None, 2]], sgd))


def test_zero_grad_inside_step_fn_clears_the_gradients_the_step_applied(wrap, no_hang):
    model, reference = wrap(mlp(), devices="emulated:2", model_run_config=CONFIG)
    optimizer = sgd(model.optim_parameters())
    for seed in (1, 2):
        x, y = batch(seed=seed)
        no_hang(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
        no_hang(model.step, lambda: (optimizer.step(), model.zero_grad()), is_async=False)
    no_hang(model.synchronize)
    assert_weights_close(model.model, pytorch_steps(reference, [[1], [None, 2]], sgd))


def test_zero_grad_with_set_to_none_false_leaves_zero_gradients_an_adam_step_applies(wrap, no_hang):
    model, reference = wrap(mlp(), devices="emulated:2", model_run_config=CONFIG)
    optimizer = torch.optim.Adam(model.optim_parameters(), lr=0.01)
    x, y = batch(seed=1)
    no_hang(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
    no_hang(model.step, optimizer.step, is_async=False)
    no_hang(model.zero_grad, set_to_none=False)
    no_hang(model.step, optimizer.step, is_async=False)  # zero gradients: Adam still moves
    no_hang(model.synchronize)
    adam = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731
    expected = pytorch_steps(reference, [[1], [None]], adam, set_to_none=False)
    assert_weights_close(model.model, expected)
    assert all(p.grad is not None and not p.grad.any() for p in model.model.parameters())
