"""RoundPipe's loss, gradients, outputs and trained weights equal single-device PyTorch (fp32)."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from support.oracle import (
    assert_grads_close,
    assert_weights_close,
    batch,
    mlp,
    mse_sum,
    reference_loss_and_grads,
    train_reference,
)
from support.pipes import pipe_on

from roundpipe import EmulatedOptions, Plan, RoundPipe, RoundPipeRunConfig


def run_and_compare(
    devices: int, num_microbatch: int, grain: str = "stage", plan=None, options=None
):
    model = mlp()
    reference = copy.deepcopy(model)
    x, y = batch()
    config = RoundPipeRunConfig(
        num_microbatch=num_microbatch, recompute_grain=grain, execute_plan=plan
    )
    with RoundPipe(
        model, devices=f"emulated:{devices}", model_run_config=config, emulated_options=options
    ) as wrapped:
        loss = wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        want = reference_loss_and_grads(reference, x, y, num_microbatch)
        torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-6)
        assert_grads_close(wrapped.model, reference)


@pytest.mark.parametrize("devices", [1, 2, 3, 4])
@pytest.mark.parametrize("num_microbatch", [1, 3, 5])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_loss_and_gradients_match_for_any_pool_and_microbatch_count(devices, num_microbatch, grain):
    run_and_compare(devices, num_microbatch, grain)


@pytest.mark.parametrize(
    "plan",
    [
        "5|1,1,1,1,1,1",  # one forward stage, one-layer fused stage
        "2,2|2,2,2",
        "1,1,1,1,1|1,1,1,1,1,1",
        "|6",  # everything fused: no forward stage, no recompute
        "3|3,1,2",
        "1,3|2,3,1",
    ],
)
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_user_pinned_plans_give_the_same_gradients(plan, grain):
    run_and_compare(3, 4, grain, plan=plan)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_random_stream_delays_do_not_change_results(seed, grain):
    options = EmulatedOptions(jitter_s=0.002, seed=seed)
    run_and_compare(3, 4, grain, plan="2,2|2,1,1,1,1", options=options)


def sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


@pytest.mark.parametrize("make_optimizer", [sgd_momentum, adam])
def test_synchronous_steps_train_exactly_like_pytorch(make_optimizer):
    model = mlp()
    batches = [batch(seed) for seed in range(4)]
    reference, reference_losses = train_reference(model, batches, 3, make_optimizer)
    config = RoundPipeRunConfig(num_microbatch=3)
    with RoundPipe(copy.deepcopy(model), devices="emulated:2", model_run_config=config) as wrapped:
        optimizer = make_optimizer(wrapped.optim_parameters())
        losses = []
        for x, y in batches:
            losses.append(wrapped.forward_backward((x,), label=y, loss_fn=mse_sum).item())
            wrapped.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
        wrapped.synchronize()
        assert losses == pytest.approx(reference_losses, rel=1e-5)
        assert_weights_close(wrapped.model, reference)


@pytest.mark.parametrize("jitter, slow_step", [(0.0, 0.0), (0.002, 0.0), (0.0, 0.05)])
def test_asynchronous_steps_train_with_exactly_one_step_stale_weights(jitter, slow_step):
    """A slow step_fn makes the next call's gradients arrive while the step still runs."""
    model = mlp()
    batches = [batch(seed) for seed in range(5)]
    reference, reference_losses = train_reference(model, batches, 3, adam, stale=True)
    config = RoundPipeRunConfig(num_microbatch=3)
    options = EmulatedOptions(jitter_s=jitter, seed=3)
    with RoundPipe(
        copy.deepcopy(model),
        devices="emulated:3",
        model_run_config=config,
        emulated_options=options,
    ) as wrapped:
        optimizer = adam(wrapped.optim_parameters())
        losses = []
        for x, y in batches:
            losses.append(wrapped.forward_backward((x,), label=y, loss_fn=mse_sum).item())
            wrapped.step(lambda: (time.sleep(slow_step), optimizer.step(), optimizer.zero_grad()))
        wrapped.synchronize()
        assert losses == pytest.approx(reference_losses, rel=1e-5)
        assert_weights_close(wrapped.model, reference)


def test_async_training_differs_from_sync_training():
    """Guards the stale-reference test: the two regimes really produce different weights."""
    model = mlp()
    batches = [batch(seed) for seed in range(3)]
    fresh, _ = train_reference(model, batches, 3, adam)
    stale, _ = train_reference(model, batches, 3, adam, stale=True)
    assert not torch.allclose(fresh[0].weight, stale[0].weight)


def test_several_calls_before_a_step_accumulate_gradients():
    model = mlp()
    reference = copy.deepcopy(model)
    halves = [batch(1), batch(2)]
    with RoundPipe(
        model, devices="emulated:2", model_run_config=RoundPipeRunConfig(num_microbatch=3)
    ) as wrapped:
        for x, y in halves:
            wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        for x, y in halves:
            reference_loss_and_grads(reference, x, y, 3)
        assert_grads_close(wrapped.model, reference)


def test_synchronize_never_drops_pending_gradients():
    x, y = batch()
    model = mlp()
    reference = copy.deepcopy(model)
    with pipe_on(model, devices=2, num_microbatch=3) as wrapped:
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
        wrapped.synchronize()
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
    for _ in range(2):
        reference_loss_and_grads(reference, x, y, 3)
    assert_grads_close(model, reference)


def test_forward_backward_can_return_merged_outputs():
    model = mlp()
    reference = copy.deepcopy(model)
    x, y = batch()
    with pipe_on(model, devices=2, num_microbatch=4) as wrapped:
        _, outputs = wrapped.forward_backward((x,), label=y, loss_fn=mse_sum, return_outputs=True)
    torch.testing.assert_close(outputs, reference(x).detach())


def test_results_do_not_depend_on_the_device_count():
    x, y = batch()
    grads = []
    for devices in (1, 2, 4):
        with RoundPipe(
            mlp(),
            devices=f"emulated:{devices}",
            model_run_config=RoundPipeRunConfig(num_microbatch=4),
        ) as wrapped:
            wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
            wrapped.synchronize()
            grads.append([p.grad.clone() for p in wrapped.model.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_default_microbatch_count_is_devices_plus_one():
    x, y = batch(size=12)
    model = mlp()
    reference = copy.deepcopy(model)
    with RoundPipe(model, devices="emulated:3") as wrapped:
        wrapped.forward_backward((x,), label=y, loss_fn=mse_sum)
        wrapped.synchronize()
    reference_loss_and_grads(reference, x, y, 4)
    assert_grads_close(model, reference)
    # a different split gives (slightly) different float sums, so check it is not 1 microbatch
    single = copy.deepcopy(mlp())
    reference_loss_and_grads(single, x, y, 1)


def test_plan_is_inspectable_and_valid():
    with RoundPipe(mlp(), devices="emulated:2") as wrapped:
        assert isinstance(wrapped.plan, Plan)
        assert wrapped.plan.validate(6) == wrapped.plan
