"""Master weights: the fp32 copies the optimizer updates.

Frozen parameters get no master copy and no gradient; a half-precision model gets fp32
masters; ``OptimizerCtx`` yields the masters; weights loaded after the optimizer exists
are used and kept, and in-place writes to the model's weights are adopted.
"""

from __future__ import annotations

import copy

import torch
from support.oracle import assert_grads_close, batch, mlp, mse_sum, reference_loss_and_grads
from support.pipes import pipe_on

from roundpipe import RoundPipe, RoundPipeRunConfig


def test_frozen_parameters_get_no_master_copy_and_no_gradient():
    model = mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    reference = copy.deepcopy(model)
    x, y = batch()
    with pipe_on(model, devices=2, num_microbatch=3) as wrapped:
        trainable = sum(p.requires_grad for p in model.parameters())
        assert len(list(wrapped.optim_parameters())) == trainable
        optimizer = torch.optim.SGD(wrapped.optim_parameters(), lr=0.1)
        frozen_before = model[0].weight.detach().clone()
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        assert model[0].weight.grad is None
        reference_loss_and_grads(reference, x, y, 3)
        assert_grads_close(model, reference)
        wrapped.step(optimizer.step, is_async=False)
        wrapped.synchronize()
        assert torch.equal(model[0].weight, frozen_before)


def test_weights_loaded_after_the_optimizer_exists_are_used_and_kept():
    x, y = batch()
    source = mlp(seed=5)
    with RoundPipe(
        mlp(seed=0), devices="emulated:2", model_run_config=RoundPipeRunConfig(num_microbatch=3)
    ) as wrapped:
        optimizer = torch.optim.SGD(wrapped.optim_parameters(), lr=0.1)
        wrapped.load_state_dict(source.state_dict())
        for master, want in zip(wrapped.optim_parameters(), source.parameters(), strict=True):
            torch.testing.assert_close(master.detach(), want.detach())
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.step(optimizer.step, is_async=False)
        wrapped.synchronize()
        reference = copy.deepcopy(source)
        reference_loss_and_grads(reference, x, y, 3)
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
        for got, want in zip(wrapped.model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.detach(), want.detach())


def test_in_place_writes_to_model_weights_are_adopted():
    x, y = batch()
    model = mlp()
    with pipe_on(model, devices=2, num_microbatch=3) as wrapped:
        list(wrapped.optim_parameters())  # masters exist
        with torch.no_grad():
            model[0].weight.mul_(2.0)
        reference = copy.deepcopy(model)
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        reference_loss_and_grads(reference, x, y, 3)
        assert_grads_close(model, reference)
        torch.testing.assert_close(
            next(wrapped.optim_parameters()).detach(), model[0].weight.detach()
        )


def test_optimizer_context_yields_master_parameters():
    with RoundPipe(mlp(), devices="emulated:2") as wrapped:
        masters = list(wrapped.optim_parameters())
        with wrapped.OptimizerCtx():
            inside = list(wrapped.parameters())
        outside = list(wrapped.parameters())
    assert [id(p) for p in inside] == [id(p) for p in masters]
    assert all(a is not b for a, b in zip(inside, outside, strict=False))
    assert all(p.dtype == torch.float32 for p in masters)


def test_half_precision_model_gets_fp32_master_weights():
    model = mlp().to(torch.bfloat16)
    with RoundPipe(model, devices="emulated:2") as wrapped:
        assert all(p.dtype == torch.float32 for p in wrapped.optim_parameters())
