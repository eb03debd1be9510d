"""Training on a mixed pool (devices of different speeds, issue 35) equals plain PyTorch
and the same run on an equal pool; dropout recomputed on another kind of device is
refused, and the emulator's class-dependent masks show why (docs/design.md#mixed-pools).
"""

from __future__ import annotations

import copy

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
from torch import nn

from roundpipe import EmulatedOptions, MixedPoolDropoutError, RoundPipe, RoundPipeRunConfig
from roundpipe.runtime import calls as runtime_calls

MIXED = "emulated:3@1,0.5,0.25"


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def train(devices: str, is_async: bool, grain: str, plan=None, options=None):
    model = mlp()
    config = RoundPipeRunConfig(num_microbatch=3, recompute_grain=grain, execute_plan=plan)
    batches = [batch(seed) for seed in range(4)]
    with RoundPipe(
        copy.deepcopy(model), devices=devices, model_run_config=config, emulated_options=options
    ) as pipe:
        assert pipe.pool.mixed == ("@" in devices)
        optimizer = adam(pipe.optim_parameters())
        losses = []
        for x, y in batches:
            losses.append(pipe.forward_backward((x,), label=y, loss_fn=mse_sum).item())
            pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=is_async)
        pipe.synchronize()
        weights = [p.detach().clone() for p in pipe.model.parameters()]
    reference, reference_losses = train_reference(model, batches, 3, adam, stale=is_async)
    assert losses == pytest.approx(reference_losses, rel=1e-5)
    assert_weights_close(pipe.model, reference)
    return losses, weights


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_a_mixed_pool_trains_like_pytorch_and_like_an_equal_pool(is_async, grain):
    plan = "2,2|2,1,1,1,1"  # 7 jobs on 3 devices: a mixed pool starts each call at device 0
    options = EmulatedOptions(jitter_s=1e-3, seed=5)
    mixed = train(MIXED, is_async, grain, plan, options)
    equal = train("emulated:3", is_async, grain, plan, options)
    assert mixed[0] == equal[0]
    for a, b in zip(mixed[1], equal[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_the_automatic_plan_on_a_mixed_pool_gives_pytorchs_gradients():
    model = mlp()
    reference = copy.deepcopy(model)
    x, y = batch()
    config = RoundPipeRunConfig(num_microbatch=4)
    with RoundPipe(model, devices="emulated:4@1,1,0.5,0.5", model_run_config=config) as pipe:
        for _ in range(3):  # measured, maybe re-planned; the gradients accumulate
            loss = pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
            want = reference_loss_and_grads(reference, x, y, 4)
        pipe.synchronize()
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-6)
    assert_grads_close(model, reference)


def dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    ).double()


def test_dropout_recomputed_on_another_kind_of_device_is_refused_before_any_work():
    model = dropout_model()
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan="2,2|1,1,1,1,1")
    x, y = batch()
    with RoundPipe(model, devices="emulated:2@1,0.5", model_run_config=config) as pipe:
        with pytest.raises(MixedPoolDropoutError, match="(?s)layer 1.*dropout to 0"):
            pipe.forward_backward((x.double(),), label=y.double(), loss_fn=mse_sum)
        assert all(p.grad is None for p in model.parameters())
        model.eval()  # no dropout drawn: the same pool trains
        pipe.forward_backward((x.double(),), label=y.double(), loss_fn=mse_sum)
        pipe.synchronize()
    assert all(p.grad is not None and p.grad.any() for p in model.parameters())


def test_model_x_then_backward_is_checked_too():
    """``model(x)`` runs every layer as a forward job, then each backward stage: with
    this plan layer 1 is recomputed on the other device (a fused call would not)."""
    model = dropout_model()
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan="4|1,1,1,1,1")
    x, y = batch()
    with RoundPipe(model, devices="emulated:2@1,0.5", model_run_config=config) as pipe:
        with pytest.raises(MixedPoolDropoutError, match="layer 1"):
            pipe(x.double()).sum().backward()
        with torch.no_grad():
            pipe(x.double())  # nothing recomputed: allowed
        pipe.forward_backward((x.double(),), label=y.double(), loss_fn=mse_sum)
        pipe.synchronize()


def test_dropout_whose_recompute_stays_on_its_kind_of_device_trains_as_on_an_equal_pool():
    """Jobs 0 and 2 (forward stage 0, backward stage 1 recomputing it) are both on
    device 0 of a pool of two: the masks agree, and the run equals one on an equal pool
    (which equals PyTorch drawing from the same seeds: test_dropout_determinism.py)."""
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan="2|3,2")
    x, y = batch()
    runs = []
    for devices, drop in (("emulated:2@1,0.5", True), ("emulated:2", True), ("emulated:2", False)):
        model = dropout_model().train(drop)
        with RoundPipe(model, devices=devices, model_run_config=config) as pipe:
            loss = pipe.forward_backward((x.double(),), label=y.double(), loss_fn=mse_sum)
            pipe.synchronize()
        runs.append((loss, [p.grad.clone() for p in model.parameters()]))
    (mixed_loss, mixed_grads), (equal_loss, equal_grads), (undropped_loss, _) = runs
    assert torch.equal(mixed_loss, equal_loss)
    assert all(torch.equal(a, b) for a, b in zip(mixed_grads, equal_grads, strict=True))
    assert not torch.equal(mixed_loss, undropped_loss)  # the masks were drawn


def test_without_the_rule_a_mixed_pool_would_give_wrong_gradients(monkeypatch):
    """What the rule prevents: the emulator draws other masks on another class, as CUDA
    does on another GPU model, so the recompute's masks are not the forward's."""
    monkeypatch.setattr(runtime_calls, "check_recompute_classes", lambda *args: None)
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan="2,2|1,1,1,1,1")
    x, y = batch()
    grads = {}
    for devices in ("emulated:2", "emulated:2@1,0.5"):
        model = dropout_model()
        with RoundPipe(model, devices=devices, model_run_config=config) as pipe:
            torch.manual_seed(3)
            pipe.forward_backward((x.double(),), label=y.double(), loss_fn=mse_sum)
            pipe.synchronize()
        grads[devices] = model[0].weight.grad.clone()
    assert not torch.allclose(grads["emulated:2"], grads["emulated:2@1,0.5"])
