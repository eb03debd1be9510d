"""Dynamic loss scaling with torch's GradScaler across the optimizer thread.

RoundPipe multiplies each call's losses by the scale current when the call starts,
keeps gradients unscaled, and hands them to ``step_fn`` scaled by the scale current
when the step runs, so ``scaler.step`` / ``scaler.update`` work unchanged, also with
asynchronous steps that overlap the next calls.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.oracle import assert_weights_close, batch, mlp, mse_sum, weighted_microbatches

from roundpipe import RoundPipe, RoundPipeRunConfig


def reference_with_scaler(model, batches, init_scale):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    for x, y in batches:
        for xm, ym, weight in weighted_microbatches(x, y, 3):
            scaler.scale(mse_sum(model(xm), ym) * weight).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return model, scaler.get_scale()


@pytest.mark.parametrize("init_scale", [2.0**10, 2.0**127])  # the second overflows at first
def test_grad_scaler_steps_and_skips_exactly_like_pytorch(init_scale):
    model = mlp()
    batches = [batch(seed) for seed in range(6)]
    reference, reference_scale = reference_with_scaler(model, batches, init_scale)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    config = RoundPipeRunConfig(num_microbatch=3)
    with RoundPipe(
        copy.deepcopy(model), devices="emulated:2", model_run_config=config, grad_scaler=scaler
    ) as pipe:
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=0.01)

        def step_fn():
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

        for x, y in batches:
            pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
            pipe.step(step_fn, is_async=False)
        pipe.synchronize()
        assert_weights_close(pipe.model, reference)
    assert scaler.get_scale() == reference_scale
    if init_scale > 2.0**100:
        assert reference_scale < init_scale  # the overflow case really skipped steps


def test_returned_loss_is_unscaled():
    x, y = batch()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    config = RoundPipeRunConfig(num_microbatch=3)
    with RoundPipe(
        mlp(), devices="emulated:2", model_run_config=config, grad_scaler=scaler
    ) as pipe:
        loss = pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
    with RoundPipe(mlp(), devices="emulated:2", model_run_config=config) as pipe:
        plain = pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
    torch.testing.assert_close(loss, plain)


def test_async_steps_with_a_grad_scaler_match_the_stale_reference():
    from support.oracle import train_reference

    def sgd(params):
        return torch.optim.SGD(params, lr=0.01)

    model = mlp()
    batches = [batch(seed) for seed in range(5)]
    reference, _ = train_reference(model, batches, 3, sgd, stale=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    config = RoundPipeRunConfig(num_microbatch=3)
    with RoundPipe(
        copy.deepcopy(model), devices="emulated:3", model_run_config=config, grad_scaler=scaler
    ) as pipe:
        optimizer = sgd(pipe.optim_parameters())

        def step_fn():
            scaler.step(optimizer)
            scaler.update()  # grows the scale every step: calls in flight used older scales
            optimizer.zero_grad()

        for x, y in batches:
            pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
            pipe.step(step_fn)
        pipe.synchronize()
        assert_weights_close(pipe.model, reference)
    assert scaler.get_scale() == 2.0**13
